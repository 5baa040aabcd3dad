"""What the stream transports (tcp, shm) share: one rail is one ordered stream.

- :mod:`.wire`: the format of requests, answers and the opening;
- :mod:`.io`: moving bytes over a socket (scatter, gather, bounded stalls);
- :mod:`.rail`: the initiator's rail (one connection, no thread of its own), opened
  by :mod:`.opening`;
- :mod:`.server`: the target's server (accept, open, check, move, count, answer);
- :mod:`.pump`: the process's data-plane threads, a poller and a bounded pool of
  workers that every rail and served connection shares.

The transports say only how the payload moves: :class:`StreamServer`'s ``land`` and
``serve`` on the target, :class:`StreamRail`'s ``_send_request`` and ``_take_read`` on
the initiator.
"""

from transfer_engine.transport.stream.connection import Connection
from transfer_engine.transport.stream.io import (
    PeerClosed,
    drain,
    recv_exact,
    recv_scatter,
    send_bytes,
    send_gather,
    set_stall_timeout,
    tune_socket,
)
from transfer_engine.transport.stream.opening import open_rail
from transfer_engine.transport.stream.rail import StreamRail
from transfer_engine.transport.stream.server import (
    HELLO_TIMEOUT,
    MAX_CONNECTIONS,
    MAX_OPENING,
    RESOURCE_ERRORS,
    STALL_TIMEOUT,
    Refused,
    StreamServer,
)
from transfer_engine.transport.stream.targets import Targets
from transfer_engine.transport.stream.wire import (
    ANSWER,
    FLAG_FIRST,
    FLAG_IMM,
    FLAG_UNIFORM,
    HEADER,
    KIND_ANNOUNCE,
    KIND_ANSWER,
    KIND_HELLO,
    KIND_READ,
    KIND_WRITE,
    LOCAL_DT,
    MAX_BODY,
    MAX_ENTRIES,
    WIRE_VERSION,
    encode_announce,
    encode_request,
    pack_local,
    pack_uniform,
    unpack_error,
)

__all__ = ["ANSWER", "FLAG_FIRST", "FLAG_IMM", "FLAG_UNIFORM", "HEADER", "HELLO_TIMEOUT",
           "KIND_ANNOUNCE", "KIND_ANSWER", "KIND_HELLO", "KIND_READ", "KIND_WRITE", "LOCAL_DT",
           "MAX_BODY", "MAX_CONNECTIONS", "MAX_ENTRIES", "MAX_OPENING", "RESOURCE_ERRORS",
           "STALL_TIMEOUT", "WIRE_VERSION",
           "Connection", "PeerClosed", "Refused", "StreamRail", "StreamServer", "Targets",
           "drain", "encode_announce", "encode_request", "open_rail", "pack_local",
           "pack_uniform", "recv_exact", "recv_scatter", "send_bytes", "send_gather",
           "set_stall_timeout", "tune_socket", "unpack_error"]
