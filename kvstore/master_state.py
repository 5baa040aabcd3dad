"""What the parts of the kvstore master share: the state ``Master.__init__`` sets, named
with its types, and the records it keeps of storage nodes, their pools and pending puts.

:class:`~kvstore.master.Master` is put together from parts, one module each: placing
puts (:mod:`kvstore.placement`), giving space back (:mod:`kvstore.reclaim`), the
journal pushed to the nodes (:mod:`kvstore.journal`), node membership
(:mod:`kvstore.nodes`) and tier moves (:mod:`kvstore.moves`); the service loop and the
requests that only read stay in :mod:`kvstore.master`. Naming the shared state and the
methods the parts call across each other here lets each part read as what it is and
type check on its own. Every part runs on the master's thread with its lock held.
"""

from __future__ import annotations

import collections
import heapq
import secrets
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from kvstore.index import has_duplicates
from kvstore.moves import TierMoves
from kvstore.protocol import MAX_BATCH, column
from kvstore.space import Space
from transfer_engine.errors import ProtocolError

if TYPE_CHECKING:
    import itertools
    import threading
    from collections.abc import Callable

    import zmq

    from kvstore.moves import Move
    from kvstore.objects import ObjectTable
    from kvstore.protocol import KvPut
    from transfer_engine.control.auth import Signer
    from transfer_engine.control.messages import Message

__all__ = ["MasterState", "Node", "Pool", "PendingPut", "I64", "check_distinct"]

I64 = npt.NDArray[np.int64]


@dataclass(eq=False)
class Node:
    """A storage node as the master keeps it: its pools, and its journal's state."""

    name: str
    incarnation: str
    control: str
    pod: str
    zone: str
    identity: bytes
    last_seen: float
    since: float = 0.0  # when it began registering
    pools: list[int] = field(default_factory=list)
    active: bool = False
    parts: list[np.ndarray] = field(default_factory=list)
    seq: int = 0  # last journal seq sent
    acked: int = 0
    unacked: collections.deque[tuple[int, float, bytes]] = field(
        default_factory=collections.deque)
    outbox: list[np.ndarray] = field(default_factory=list)
    frees: list[tuple[int, int, int]] = field(default_factory=list)  # not yet sent
    fence: dict[str, None] = field(default_factory=dict)  # writers cut with those frees
    quarantine: collections.deque[tuple[int, list[tuple[int, int, int]]]] = field(
        default_factory=collections.deque)
    moving: list[int] = field(default_factory=list)  # rows of tier copies not yet sent
    # a client's write to it failed lately: new objects go elsewhere while they can
    suspect_until: float = 0.0
    copies: collections.deque[tuple[int, list[int]]] = field(
        default_factory=collections.deque)  # (journal seq, rows copied by it)


@dataclass(eq=False)
class Pool:
    """A pool of a node (its DRAM, or its disk file) and the master's map of its space."""

    index: int
    node: Node
    local: int  # the node's own number for this pool
    segment: str
    tier: str
    space: Space
    usable_after: float
    alive: bool = True
    pressure: bool = False  # disk: a demotion found no room (eviction may drop from it)
    coming: int = 0  # bytes freed through the journal, not yet acknowledged


@dataclass(eq=False)
class PendingPut:
    """A put between placement and commit (dropped, its space freed, at ``deadline``)."""

    deadline: float
    keys_placed: I64  # positions in the request of the keys that got rows
    rows: I64
    n: int
    writer: str = ""  # the engine that writes the values (fenced off should it be late)


def check_distinct(keys: np.ndarray) -> None:
    if has_duplicates(keys):
        raise ProtocolError("keys in one request must be distinct")


class MasterState(TierMoves):
    """The master's shared state, the request helpers every part uses, and the methods
    its parts call across each other."""

    if TYPE_CHECKING:
        lease_s: float
        put_timeout_s: float
        grace_s: float
        node_interval: float
        node_max_missed: int
        max_replicas: int
        epoch: str
        table: ObjectTable
        counters: collections.Counter[str]
        _signer: Signer | None
        _clock: Callable[[], float]
        _lock: threading.RLock
        _sock: zmq.Socket[bytes]
        _nodes: dict[str, Node]
        _pools: list[Pool]
        _dead_pools: collections.deque[tuple[float, int]]  # (died at, pool number)
        _puts: dict[int, PendingPut]
        _put_ids: itertools.count[int]
        _leases: dict[int, tuple[float, I64]]
        _lease_heap: list[tuple[float, int]]
        _key_bytes: int
        _parked: list[tuple[bytes, KvPut, float, float]]
        _version: int
        _moves: dict[int, Move]
        _moving: dict[int, int]

        def _reply(self, ident: bytes, msg: Message) -> None: ...
        def _unpark(self, now: float) -> None: ...
        def _release(self, lease_ids: np.ndarray) -> None: ...
        def _unlease(self, rows: I64) -> None: ...
        def _retire(self, rows: I64) -> None: ...
        def _free_rows(self, rows: I64) -> None: ...
        def _queue_free(self, p: int, off: int, length: int) -> None: ...
        def _evict(self, nbytes: int) -> bool: ...
        def _drop_replicas(self, rows: I64, dead: np.ndarray, *, free: bool
                           ) -> np.ndarray: ...
        def _journal_commits(self, rows: I64) -> None: ...
        def _journal_retired(self, rows: I64) -> None: ...
        def _send_node(self, node: Node, frame: bytes) -> None: ...
        def _acked(self, node: Node, seq: int) -> None: ...
        def _drop_node(self, node: Node, reason: str) -> None: ...

    def _lease(self, rows: I64) -> int:
        """A new lease on ``rows`` (their counts already raised), ending after
        ``lease_s``; its id is random, so that no client can release another's, nor a
        client of a previous master a lease of this one."""
        lease = secrets.randbits(62) or 1
        while lease in self._leases:
            lease = secrets.randbits(62) or 1
        expiry = self._clock() + self.lease_s
        self._leases[lease] = (expiry, rows)
        heapq.heappush(self._lease_heap, (expiry, lease))
        return lease

    def _keys(self, data: bytes) -> npt.NDArray[np.uint64]:
        keys = column(data, "<u8", None, "keys")
        if keys.size % 2 or keys.size // 2 > MAX_BATCH:
            raise ProtocolError(f"keys: a batch holds 1 to {MAX_BATCH} 16-byte keys")
        return keys.reshape(-1, 2).astype(np.uint64)

    def _node_table(self, pools: np.ndarray) -> tuple[list[Any], np.ndarray]:
        """Rows of the nodes ``pools`` refer to, and ``pools`` renumbered into them."""
        flat = pools.ravel()
        used = sorted(set(flat[flat >= 0].tolist()))  # a batch touches few pools
        rows = []
        for p in used:
            pool = self._pools[p]
            rows.append([pool.node.name, pool.node.incarnation, pool.node.control,
                         pool.segment])
        renumber = np.full(len(self._pools) + 1, -1, dtype=np.int32)  # [-1] stays -1
        renumber[used] = np.arange(len(used), dtype=np.int32)
        return rows, renumber[pools]

