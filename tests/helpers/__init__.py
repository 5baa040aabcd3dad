"""What the tests share and are not tests themselves: fixtures and checks imported by
test modules (``transport_contract``, ``planning``, ``rails``, ``faults``, ...), and the
child-process scripts tests launch (``python -m tests.helpers.peer_process``, ...).

Test modules import from here, never from one another; nothing outside ``tests/``
imports from ``tests/``.
"""
