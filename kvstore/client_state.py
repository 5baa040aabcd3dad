"""What the parts of the kvstore client share: the state ``Client.__init__`` sets, named
with its types, the master's answer of where a batch's values live, and the requests to
the master that every part makes.

:class:`~kvstore.client.Client` is put together from parts, one module each: moving
bytes between registered memory and the nodes (:mod:`kvstore.transfers`), reads started
before the master answers (:mod:`kvstore.guesses`) and the put path
(:mod:`kvstore.puts`); the get path and the queries stay in :mod:`kvstore.client`.
Naming the shared state and the methods the parts call across each other here lets each
part read as what it is and type check on its own. Every part runs with the client's
lock held.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np
import numpy.typing as npt

from kvstore.errors import StoreError
from kvstore.protocol import KvLocated, KvPlaced, column, pack
from transfer_engine.control.messages import Message
from transfer_engine.errors import ProtocolError

if TYPE_CHECKING:
    import threading
    from collections import OrderedDict

    from kvstore.link import MasterLink
    from kvstore.tiers import LocalTier
    from transfer_engine import Engine
    from transfer_engine.handle import TransferHandle
    from transfer_engine.peer import Peer
    from transfer_engine.segment import Segment

__all__ = ["ClientState", "Where", "Job", "I64", "U64", "expect"]

I64 = npt.NDArray[np.int64]
U64 = npt.NDArray[np.uint64]
Job = tuple[int, int, int, int]
"""One value to move: (local address, remote offset, length, tag)."""
NODE_ROW = ("name", "incarnation", "endpoint", "segment")
"""The fields of a node row in the master's answers."""
MAX_REPLICAS = 64
"""Replica columns an answer may have at most (the master sends its ``max_replicas``)."""

_R = TypeVar("_R", bound=Message)


def expect(reply: Message, kind: type[_R], peer: str | None = None) -> _R:
    """``reply`` as the answer ``kind`` the request calls for; another kind is a
    :class:`ProtocolError` (an ``assert`` would vanish under ``-O``)."""
    if not isinstance(reply, kind):
        raise ProtocolError(f"expected a {kind.kind} answer, got {reply.kind}", peer=peer)
    return reply


@dataclass
class Where:
    """Replicas of a batch as the master answered them."""

    status: npt.NDArray[np.int8]
    nodes: list[Any]
    pools: npt.NDArray[np.int32]  # [n, R], index into nodes, -1 none
    offsets: I64  # [n, R]

    @classmethod
    def of(cls, msg: KvPlaced | KvLocated, n: int, peer: str | None = None) -> Where:
        """The answer's placement, checked so that a malformed one raises
        :class:`ProtocolError` (naming ``peer``, the master) here rather than an
        ``IndexError`` deep in a read or write: node rows are
        ``[name, incarnation, endpoint, segment]`` strings, each key's replicas are
        indices into them followed by -1s only, and their offsets are >= 0."""
        r = msg.replicas
        if not 1 <= r <= MAX_REPLICAS:
            raise ProtocolError(f"{msg.kind}: replicas {r} is not 1..{MAX_REPLICAS}",
                                peer=peer)
        for j, row in enumerate(msg.nodes):
            if not isinstance(row, list | tuple) or len(row) != len(NODE_ROW) or not all(
                    isinstance(v, str) for v in row):
                raise ProtocolError(f"{msg.kind}: node row {j} is {str(row)[:120]}, not "
                                    f"{len(NODE_ROW)} strings {list(NODE_ROW)}", peer=peer)
        pools = column(msg.pools, "<i4", n * r, "pools", peer).reshape(n, r)
        offsets = column(msg.offsets, "<i8", n * r, "offsets", peer).reshape(n, r)
        used = pools >= 0
        bad = (pools < -1) | (pools >= len(msg.nodes)) | (used & (offsets < 0))
        bad[:, 1:] |= used[:, 1:] & ~used[:, :-1]  # a replica after a -1
        if bad.any():
            i, k = (int(x) for x in np.argwhere(bad)[0])
            raise ProtocolError(f"{msg.kind}: the batch's key {i}, replica {k}, names pool "
                                f"{int(pools[i, k])} at offset {int(offsets[i, k])} "
                                f"({len(msg.nodes)} node rows)", peer=peer)
        return cls(column(msg.status, "<i1", n, "status", peer), list(msg.nodes), pools,
                   offsets)

    def node_rows(self) -> list[tuple[str, ...]]:
        """The node rows of the answer, comparable with each other and usable as keys."""
        return [tuple(str(v) for v in row) for row in self.nodes]


class ClientState:
    """The client's shared state, its requests to the master, and the methods its
    parts call across each other."""

    if TYPE_CHECKING:
        engine: Engine
        replicas: int
        checksum: bool
        timeout: float
        remote_hits: int
        guessed_reads: int
        _closed: bool
        _link: MasterLink
        _tier: LocalTier | None
        _lock: threading.RLock
        _release: list[int]
        _peers: dict[str, tuple[str, Peer]]
        _bad: dict[str, float]
        _buffers: list[tuple[int, int, Segment]]
        _staging: np.ndarray | None
        _staging_seg: Segment | None
        _staging_min: int
        _staging_keep: int
        max_value_bytes: int
        _guesses: OrderedDict[tuple[int, int], tuple[int, tuple[str, ...], int, int]]
        _guessing: bool
        _late_failed: list[int]
        _late_reasons: list[str]

        def _local(self, addrs: I64, lens: I64) -> list[tuple[Segment, int]]: ...
        def _stage(self, nbytes: int) -> tuple[np.ndarray, int]: ...
        def _usable(self, name: str) -> bool: ...
        def _move(self, write: bool, jobs: dict[int, list[Job]], nodes: list[Any],
                  deadline: float, start_by: float | None = ...
                  ) -> dict[int, BaseException]: ...
        def _post_moves(self, write: bool, jobs: dict[int, list[Job]], nodes: list[Any],
                        blame: bool = ..., start_by: float | None = ...
                        ) -> tuple[list[tuple[int, TransferHandle]],
                                   dict[int, BaseException]]: ...
        def _wait_moves(self, handles: list[tuple[int, TransferHandle]], nodes: list[Any],
                        deadline: float, blame: bool = ...) -> dict[int, BaseException]: ...
        def _remember(self, rows: U64, idx: npt.NDArray[np.int64], versions: U64,
                      where: Where, lengths: I64) -> None: ...

    def _take_release(self) -> bytes:
        out = pack(self._release, "<u8")
        self._release = []
        return out

    def _request(self, msg: Message, between: Callable[[], None] | None = None) -> Message:
        if self._closed:
            raise StoreError("the client is closed")
        return self._link.request(msg, self.timeout, between)
