from __future__ import annotations

from tests.helpers.transport_contract import TransportContract


class TestShmContract(TransportContract):
    """Same-host transport on its own (no TCP beside it to fall back to)."""

    transports = ["shm"]
