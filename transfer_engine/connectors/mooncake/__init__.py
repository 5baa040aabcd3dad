"""Mooncake's Python transfer-engine API (``mooncake.engine``) on our engine.

- :mod:`.engine`: ``TransferEngine``, ``TransferOpcode``, ``TransferNotify``.
- :mod:`.rpc`: ``RpcInterface`` (alias ``CoroRPCInterface``), messages between processes.
- :mod:`.metadata`: P2P handshake and HTTP metadata modes; an HTTP metadata server
  speaking Mooncake's protocol (``te-mooncake metadata-server``).
- :mod:`.cli`: ``te-mooncake``: run unchanged ``import mooncake.engine`` code on ours.

docs/mooncake.md lists what is the same, what differs, and why.
"""

from transfer_engine.connectors.mooncake.engine import (
    SUPPORT_CUDA,
    Read,
    TransferEngine,
    TransferNotify,
    TransferOpcode,
    Write,
)
from transfer_engine.connectors.mooncake.rpc import (
    CoroRPCInterface,
    ReceivedData,
    ReceivedTensor,
    RpcInterface,
    create_rpc_client,
    create_rpc_server,
)

__all__ = ["TransferEngine", "TransferOpcode", "TransferNotify", "Read", "Write",
           "SUPPORT_CUDA", "RpcInterface", "CoroRPCInterface", "ReceivedData",
           "ReceivedTensor", "create_rpc_client", "create_rpc_server"]
