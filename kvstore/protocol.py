"""Wire messages between store clients, storage nodes and the master.

They ride on the control plane's message machinery (:mod:`transfer_engine.control.
messages`: versioned msgpack, a size limit per kind, a ``kind`` tag) and are signed like
every control message (:mod:`transfer_engine.control.auth`). Array fields (keys,
lengths, placements) travel as raw little-endian bytes, one field per column, so a batch
of thousands of keys costs a few ``frombuffer`` calls, not a Python object per key;
:func:`column` checks their length and dtype on the way in.

Who sends what:

* client -> master: ``kv-put`` (allocate) -> ``kv-placed``; the client WRITEs the values
  to the nodes itself, then ``kv-commit`` -> ``kv-committed``. ``kv-get`` -> ``kv-located``
  (with a lease), then the client READs from the nodes. ``kv-query`` / ``kv-remove`` ->
  ``kv-found``; ``kv-stats`` -> ``kv-stats!``. Every client request carries ``release``:
  the lease ids the client is done with, so releasing costs no round trip of its own.
* node -> master: ``kv-node`` (register; a restarted master learns the node's objects from
  its directory, sent in parts) -> ``kv-node!``; ``kv-beat`` (heartbeat, acknowledging
  journal pushes) -> ``kv-beat!``.
* master -> node, unsolicited: ``kv-journal`` (commits, frees and tier copies of the
  node's space, in order). The master reuses freed space only once the node acknowledged
  the free, so a node's directory never names space that holds another object's bytes.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import numpy.typing as npt

from transfer_engine.control.messages import MAX_MESSAGE_BYTES, SMALL, Message, message
from transfer_engine.errors import ProtocolError

__all__ = [
    "Status", "ENTRY", "JOURNAL", "Op", "column", "pack",
    "KvPut", "KvPlaced", "KvCommit", "KvCommitted", "KvGet", "KvLocated", "KvQuery",
    "KvRemove", "KvFound", "KvStats", "KvStatsReply", "KvNode", "KvNodeWelcome", "KvBeat",
    "KvBeatAck", "KvJournal", "MAX_FENCE",
]

MAX_BATCH = 1 << 16
MAX_FENCE = 256
"""Writers fenced by one journal push at most (names of up to 1,024 characters)."""
"""Keys per request at most (keeps every message under the control plane's limit)."""


class Status(enum.IntEnum):
    """Per-key outcome of a request (one ``int8`` per key on the wire)."""

    OK = 0
    MISSING = 1  # get / query / remove: no committed object under the key
    EXISTS = 2  # put with if_absent: the key is stored already, nothing to write
    RETRY = 3  # put: space is being reclaimed; ask again shortly
    NO_SPACE = 4  # put: no pool can hold the value, even after eviction
    TOO_LARGE = 5  # put: the value exceeds every pool
    RECOVERING = 6  # put: a restarted master allocates nothing during its grace period
    FAILED = 7  # commit: every replica of the key was lost


class Op(enum.IntEnum):
    """Journal operations pushed to a node."""

    COMMIT = 1
    FREE = 2
    COPY = 3  # copy the node's replica of (key, version) to the entry's range, then COMMIT it
    RETIRE = 4  # the object at (pool, offset) is gone from the index; its space follows


ENTRY = np.dtype([("key", "<u8", (2,)), ("pool", "<i8"), ("offset", "<i8"),
                  ("length", "<i8"), ("checksum", "<u8"), ("version", "<u8"),
                  ("expires", "<f8")])
"""One object replica in a node's directory (``pool`` is the node's own segment number;
``expires``: when its TTL ends, in seconds of the epoch (``time.time()``), 0 for never,
so that a restarted master keeps it)."""

JOURNAL = np.dtype([("op", "<i8"), ("entry", ENTRY)])
"""One journal operation: commit the entry, free the range at (pool, offset), copy the
node's replica of the entry's (key, version) into the entry's range and commit it (a
move between the node's DRAM and disk pools), or retire the object at (pool, offset): a
reader's lease still holds its space, but it is no longer stored (a directory entry of
version 0, which a restarted master frees once its own lease passes, and never
publishes)."""
RETIRED_VERSION = 0  # a directory entry's version once retired (versions start above)


def wall_time(deadlines: np.ndarray, now: float) -> np.ndarray:
    """The master's TTL ``deadlines`` (its clock, which reads ``now``) as the epoch
    seconds a node keeps in ``expires`` (0: none)."""
    finite = np.isfinite(deadlines)
    return np.where(finite, time.time() + np.where(finite, deadlines, now) - now, 0.0)


def column(data: object, dtype: npt.DTypeLike, count: int | None, what: str,
           peer: str | None = None) -> np.ndarray[Any, Any]:
    """``data`` (bytes from a message) as a read-only array of ``dtype``; raises
    :class:`ProtocolError` when it is not bytes or not ``count`` items."""
    dt = np.dtype(dtype)
    if not isinstance(data, bytes) or len(data) % dt.itemsize:
        raise ProtocolError(f"{what}: not a packed {dt} column", peer=peer)
    arr = np.frombuffer(data, dtype=dt)
    if count is not None and arr.shape[0] != count:
        raise ProtocolError(f"{what}: {arr.shape[0]} items where {count} were expected",
                            peer=peer)
    return arr


def pack(arr: npt.ArrayLike, dtype: npt.DTypeLike) -> bytes:
    return np.ascontiguousarray(arr, dtype=dtype).tobytes()


_BIG = MAX_MESSAGE_BYTES


@message
@dataclass(frozen=True, slots=True)
class KvPut(Message):
    """Allocate space for ``keys`` (``uint64[n, 2]``) of ``lengths`` (``int64[n]``), with
    ``replicas`` copies each on distinct nodes; ``checksums`` (``uint64[n]``, 0: none)
    are recorded. ``ttl`` seconds (0: none). ``if_absent``: keys already stored answer
    EXISTS and get no space. ``writer``: the name of the engine that will write the
    values; should the put not be committed in time, the nodes fence that engine off
    before its space is reused (empty: no fence)."""

    kind: ClassVar[str] = "kv-put"
    max_bytes: ClassVar[int] = _BIG
    keys: bytes = b""
    lengths: bytes = b""
    checksums: bytes = b""
    replicas: int = 1
    ttl: float = 0.0
    if_absent: bool = False
    release: bytes = b""
    writer: str = ""


@message
@dataclass(frozen=True, slots=True)
class KvPlaced(Message):
    """Where to write: for key ``i`` and replica ``r``, ``pools[i, r]`` (an index into
    ``nodes``, -1: none) and ``offsets[i, r]``. ``status`` per key. ``nodes`` rows are
    ``[node name, incarnation, engine endpoint, segment name]``. ``deadline_s``: the put
    must be committed within this many seconds or its space is reclaimed. ``versions``
    (``uint64[n]``, 0 where not placed): what a get answers for the object once it is
    committed (a client's local tier keys its copies by it)."""

    kind: ClassVar[str] = "kv-placed"
    max_bytes: ClassVar[int] = _BIG
    put_id: int = 0
    status: bytes = b""
    versions: bytes = b""
    replicas: int = 1
    nodes: list[Any] = field(default_factory=list)
    pools: bytes = b""
    offsets: bytes = b""
    deadline_s: float = 0.0


@message
@dataclass(frozen=True, slots=True)
class KvCommit(Message):
    """The values of put ``put_id`` are written, except to the nodes named in ``failed``
    (replicas there are dropped). ``abort``: store nothing, free the space."""

    kind: ClassVar[str] = "kv-commit"
    max_bytes: ClassVar[int] = SMALL * 16
    put_id: int = 0
    failed: list[Any] = field(default_factory=list)
    abort: bool = False
    release: bytes = b""


@message
@dataclass(frozen=True, slots=True)
class KvCommitted(Message):
    """Per key: OK (visible to readers now) or FAILED (not stored)."""

    kind: ClassVar[str] = "kv-committed"
    max_bytes: ClassVar[int] = _BIG
    status: bytes = b""


@message
@dataclass(frozen=True, slots=True)
class KvGet(Message):
    """Locate ``keys`` and lease their bytes for reading."""

    kind: ClassVar[str] = "kv-get"
    max_bytes: ClassVar[int] = _BIG
    keys: bytes = b""
    release: bytes = b""


@message
@dataclass(frozen=True, slots=True)
class KvLocated(Message):
    """Replicas of each found key (``status`` OK) as in :class:`KvPlaced`, with
    ``lengths``, ``checksums`` and ``versions`` (a new put of a key gets a new version;
    moving an object between a node's tiers keeps it). The space stays as it is until
    ``lease_id`` is released or ``lease_s`` seconds pass, whichever is first."""

    kind: ClassVar[str] = "kv-located"
    max_bytes: ClassVar[int] = _BIG
    lease_id: int = 0
    lease_s: float = 0.0
    status: bytes = b""
    lengths: bytes = b""
    checksums: bytes = b""
    versions: bytes = b""
    replicas: int = 1
    nodes: list[Any] = field(default_factory=list)
    pools: bytes = b""
    offsets: bytes = b""


@message
@dataclass(frozen=True, slots=True)
class KvQuery(Message):
    kind: ClassVar[str] = "kv-query"
    max_bytes: ClassVar[int] = _BIG
    keys: bytes = b""
    release: bytes = b""


@message
@dataclass(frozen=True, slots=True)
class KvRemove(Message):
    kind: ClassVar[str] = "kv-remove"
    max_bytes: ClassVar[int] = _BIG
    keys: bytes = b""
    release: bytes = b""


@message
@dataclass(frozen=True, slots=True)
class KvFound(Message):
    """Per key: OK (stored; for remove: removed) or MISSING."""

    kind: ClassVar[str] = "kv-found"
    max_bytes: ClassVar[int] = _BIG
    status: bytes = b""


@message
@dataclass(frozen=True, slots=True)
class KvStats(Message):
    kind: ClassVar[str] = "kv-stats"
    max_bytes: ClassVar[int] = SMALL
    release: bytes = b""


@message
@dataclass(frozen=True, slots=True)
class KvStatsReply(Message):
    kind: ClassVar[str] = "kv-stats!"
    max_bytes: ClassVar[int] = 1 << 20
    stats: dict[str, Any] = field(default_factory=dict)


@message
@dataclass(frozen=True, slots=True)
class KvNode(Message):
    """Node -> master: join (or rejoin a restarted master). ``pools`` rows are
    ``[segment name, capacity bytes, tier]``. ``entries`` is one part of the node's
    directory (:data:`ENTRY` records); ``last`` marks the final part, after which the
    master places objects on the node."""

    kind: ClassVar[str] = "kv-node"
    max_bytes: ClassVar[int] = _BIG
    name: str = ""
    incarnation: str = ""
    epoch: str = ""  # the master the node served before ("" if none): its space may be in use
    control: str = ""
    pod: str = ""
    zone: str = ""
    pools: list[Any] = field(default_factory=list)
    part: int = 0
    last: bool = True
    entries: bytes = b""


@message
@dataclass(frozen=True, slots=True)
class KvNodeWelcome(Message):
    kind: ClassVar[str] = "kv-node!"
    max_bytes: ClassVar[int] = SMALL
    epoch: str = ""
    interval: float = 0.5
    max_missed: int = 4


@message
@dataclass(frozen=True, slots=True)
class KvBeat(Message):
    """Node -> master: alive; every journal push up to ``acked`` is applied."""

    kind: ClassVar[str] = "kv-beat"
    max_bytes: ClassVar[int] = SMALL
    name: str = ""
    incarnation: str = ""
    epoch: str = ""
    acked: int = 0


@message
@dataclass(frozen=True, slots=True)
class KvBeatAck(Message):
    """``known`` False: the master does not know this node (it restarted, or dropped
    the node as silent): register again, with the directory."""

    kind: ClassVar[str] = "kv-beat!"
    max_bytes: ClassVar[int] = SMALL
    known: bool = True
    epoch: str = ""


@message
@dataclass(frozen=True, slots=True)
class KvJournal(Message):
    """Master -> node: apply ``ops`` (:data:`JOURNAL` records) in order, then
    acknowledge ``seq`` with a beat. ``fence``: engines (at most :data:`MAX_FENCE`)
    whose puts expired with space among these frees: the node cuts them off its engine
    first, and neither applies nor acknowledges until that holds, so that a late WRITE
    of a stalled writer never lands in space given to another object."""

    kind: ClassVar[str] = "kv-journal"
    max_bytes: ClassVar[int] = _BIG
    epoch: str = ""
    seq: int = 0
    ops: bytes = b""
    fence: list[Any] = field(default_factory=list)
