"""What the parts of the engine share.

:class:`~transfer_engine.engine.Engine` is put together from parts, one module each:
the transfer table (:mod:`~transfer_engine.transfer`), the peer table and handshake
(:mod:`~transfer_engine.peers`), the registry glue (:mod:`~transfer_engine.membership`)
and the control endpoint (:mod:`~transfer_engine.control.endpoint`). They share the
engine's state, which ``Engine.__init__`` sets; this class names it, with its types, so
that each part reads as what it is and type checks on its own.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import collections
    import itertools
    import threading
    from concurrent.futures import Future
    from contextlib import ExitStack

    import zmq

    from transfer_engine.control.auth import Signer
    from transfer_engine.control.metastore import MetadataStore
    from transfer_engine.control.tickets import TicketBook
    from transfer_engine.notify import ImmediateCounter
    from transfer_engine.peer import Peer
    from transfer_engine.segment import Segment
    from transfer_engine.transfer import _Transfer
    from transfer_engine.transport.base import Completion, Transport
    from transfer_engine.watchdog import Watchdog

__all__ = ["EngineState"]


class EngineState:
    """The engine's shared state and the methods its parts call across each other."""

    if TYPE_CHECKING:
        name: str
        host: str
        timeout: float
        endpoint: str
        incarnation: str
        role: str
        pod: str
        zone: str
        transfer_timeout: float | None
        peer_timeout: float | None
        stats: collections.Counter[str]
        membership: MetadataStore | None
        _lock: threading.RLock
        _closed: bool
        _stack: ExitStack
        _zctx: zmq.Context[Any]
        _router: zmq.Socket[bytes]
        _control_stop: threading.Event
        _control_thread: threading.Thread
        _signer: Signer | None
        _secret: bytes | None
        _tickets: TicketBook
        _transports: dict[str, Transport]
        _segments: dict[int, Segment]
        _peers: dict[str, Peer]
        _by_address: dict[str, Peer]
        _connecting: dict[str, Future[Peer]]
        _retired: set[Peer]
        _live: dict[int, _Transfer]
        _transfer_ids: itertools.count[int]
        _wr_ids: itertools.count[int]
        _counter: ImmediateCounter
        _watchdog: Watchdog | None

        def metadata(self) -> dict[str, Any]: ...
        def _check_open(self, op: str) -> None: ...
        def peer(self, name: str) -> Peer: ...
        def peer_lost(self, name: str, reason: str = ...) -> int: ...
        def _on_complete(self, done: Completion) -> None: ...
