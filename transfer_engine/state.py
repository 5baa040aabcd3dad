"""What the parts of the engine share.

:class:`~transfer_engine.engine.Engine` is put together from parts, one module each:
the transfer table (:mod:`~transfer_engine.transfer`), the peer table and handshake
(:mod:`~transfer_engine.peers`), the registry glue (:mod:`~transfer_engine.membership`)
and the control endpoint (:mod:`~transfer_engine.endpoint`). They share the
engine's state, which ``Engine.__init__`` sets; this class names it, with its types, so
that each part reads as what it is and type checks on its own.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from transfer_engine.descriptor import Op
from transfer_engine.errors import TransferError
from transfer_engine.handle import TransferHandle
from transfer_engine.peer import Peer
from transfer_engine.planner import Columns
from transfer_engine.segment import Segment
from transfer_engine.transport.base import Rail, Work

if TYPE_CHECKING:
    import collections
    import itertools
    from concurrent.futures import Future
    from contextlib import ExitStack

    import zmq

    from transfer_engine.control.auth import Signer
    from transfer_engine.control.metastore import MetadataStore
    from transfer_engine.control.tickets import TicketBook
    from transfer_engine.latency import Latencies
    from transfer_engine.notify import ImmediateCounter
    from transfer_engine.staging import Staged, Staging
    from transfer_engine.transport.base import Completion, Transport
    from transfer_engine.watchdog import Watchdog

__all__ = ["EngineState", "LiveTransfer", "TrafficPolicy"]


class TrafficPolicy(Protocol):
    """What steers the engine's transport choice per transfer (for example
    ``scheduler.policy.TrafficPolicy``: same host, then pod, then zone over RDMA, the
    RDMA/TCP share following measured latency and success)."""

    def order(self, transports: Iterable[str], local_meta: Mapping[str, Any],
              peer_meta: Mapping[str, Any]) -> list[str]:
        """``transports`` best first for the next transfer to that peer."""
        ...

    def record(self, peer: str, transport: str, latency: float, ok: bool,
               nbytes: int = 0) -> None:
        """How a transfer over ``transport`` went."""
        ...


@dataclass(eq=False)
class LiveTransfer:
    """Engine-side state of one transfer across its attempts."""

    handle: TransferHandle
    peer: Peer
    op: Op
    extents: Columns
    notify: bytes | None
    transports: list[str]
    local_segments: list[Segment]
    remaining: int = 0
    error: TransferError | None = None
    notifying: bool = False
    started: float = 0.0  # monotonic start of the current attempt
    finished: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)
    posted: list[tuple[Rail, Work]] | None = None  # the current attempt's work
    posting: bool = False  # rail.post calls of ``posted`` under way
    stopping: TransferError | None = None  # why it was cancelled (or timed out)
    staged: Staged | None = None  # device memory moved through a bounce (staging.py)
    retries: int = 0  # attempts made again after another transfer's cancel (transfer.py)
    first_id: int | None = None  # the first attempt's transfer id (its immediates')


class EngineState:
    """The engine's shared state and the methods its parts call across each other."""

    if TYPE_CHECKING:
        name: str
        host_id: str
        hold_gil: float
        host: str
        timeout: float
        endpoint: str
        incarnation: str
        role: str
        pod: str
        zone: str
        transfer_timeout: float | None
        traffic: TrafficPolicy | None
        _placement: dict[str, Any]
        peer_timeout: float | None
        stats: collections.Counter[str]
        latencies: Latencies
        membership: MetadataStore | None
        _lock: threading.RLock
        _closed: bool
        _stack: ExitStack
        _zctx: zmq.Context[Any]
        _signer: Signer | None
        _secret: bytes | None
        _tickets: TicketBook
        _transports: dict[str, Transport]
        _segments: dict[int, Segment]
        _peers: dict[str, Peer]
        _by_address: dict[str, Peer]
        _connecting: dict[str, Future[Peer]]
        _retired: set[Peer]
        _live: dict[int, LiveTransfer]
        _transfer_ids: itertools.count[int]
        _wr_ids: itertools.count[int]
        _counter: ImmediateCounter
        _watchdog: Watchdog | None
        _staging_area: Staging | None

        def metadata(self) -> dict[str, Any]: ...
        def _check_open(self, op: str) -> None: ...
        def peer(self, name: str) -> Peer: ...
        def peer_lost(self, name: str, reason: str = ...) -> int: ...
        def _on_complete(self, done: Completion) -> None: ...
