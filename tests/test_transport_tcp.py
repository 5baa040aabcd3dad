from __future__ import annotations

from tests.transport_contract import TransportContract


class TestTcpContract(TransportContract):
    transports = ["tcp"]
