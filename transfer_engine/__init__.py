"""KV-cache transfer engine for disaggregated LLM inference.

Importing this package loads neither torch, cupy nor pyverbs; transports and
connectors that need them are imported when chosen.
"""

from transfer_engine.descriptor import Blocks, Descriptor, Extent, Op
from transfer_engine.engine import Engine
from transfer_engine.errors import (
    BusyError,
    ClosedError,
    ConnectError,
    InvalidDescriptorError,
    NotSupportedError,
    PeerLostError,
    ProtocolError,
    RegistrationError,
    RemoteError,
    TransferCancelled,
    TransferEngineError,
    TransferError,
    TransferTimeout,
    UnknownPeerError,
)
from transfer_engine.handle import TransferHandle, TransferState
from transfer_engine.notify import Notification
from transfer_engine.peer import Peer
from transfer_engine.segment import RemoteSegment, Segment

__version__ = "0.1.0"

__all__ = [
    "Engine", "Segment", "RemoteSegment", "Descriptor", "Blocks", "Extent", "Op", "Peer",
    "TransferHandle", "TransferState", "Notification",
    "TransferEngineError", "TransferError", "InvalidDescriptorError", "RegistrationError",
    "ConnectError", "ProtocolError", "TransferTimeout", "PeerLostError", "ClosedError",
    "BusyError", "NotSupportedError", "UnknownPeerError", "RemoteError",
    "TransferCancelled",
]
