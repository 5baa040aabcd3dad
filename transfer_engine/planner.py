"""Transfer planning: pure functions from descriptor pairs to work requests on rails.

    pairs --coalesce--> fewer, longer pairs
          --slice-----> extents of at most ``slice_size`` bytes
          --pack------> work requests of at most ``max_sge`` local extents and
                        ``max_wr_bytes`` bytes (one contiguous remote extent when the
                        transport cannot scatter remotely, as with RDMA WRITE)
          --assign----> rails, balanced by bytes (optionally weighted, e.g. by link rate)
          --mark------> the last request of each used rail carries the immediate

Pairs travel as :class:`Columns` (five int64 arrays), so the per-extent work of a transfer
of thousands of small blocks is done by NumPy: planning 128 blocks costs tens of
microseconds, not the hundreds a loop over tuples costs. The tuple-based functions
(:func:`coalesce`, :func:`slice_pairs`, :func:`pack`, :func:`plan_transfer`) are the same
code behind a conversion.

Everything here is deterministic and side-effect free, so it is tested exhaustively on
any machine and shared by every transport.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, overload

import numpy as np

__all__ = ["Pair", "Columns", "Extents", "WorkRequest", "Plan", "coalesce", "slice_pairs", "pack",
           "iovec_array", "assign_rails", "plan_transfer", "plan_columns", "coalesce_columns",
           "slice_columns", "pack_columns"]

ExtentRow = tuple[int, int, int]  # (segment, offset, length): an Extent or a plain tuple
# Plain tuples on the hot path: building a NamedTuple costs ten times more.
Pair = tuple[ExtentRow, ExtentRow]  # (local, remote)


class Extents(Sequence[ExtentRow]):
    """``(segment, offset, length)`` rows kept as three int64 arrays.

    Reads as a list of tuples, made on first use: a transport that takes the arrays
    (the stream transports put them on the wire as they are) never pays for the tuples.
    ``uniform`` is ``(segment, length)`` when every row is known to share both, so that
    a transport may send the offsets alone.
    """

    __slots__ = ("segment", "offset", "length", "uniform", "_rows")

    def __init__(self, segment: np.ndarray, offset: np.ndarray, length: np.ndarray,
                 uniform: tuple[int, int] | None = None) -> None:
        self.segment = segment
        self.offset = offset
        self.length = length
        self.uniform = uniform
        self._rows: list[ExtentRow] | None = None

    def rows(self) -> list[ExtentRow]:
        if self._rows is None:
            self._rows = list(zip(self.segment.tolist(), self.offset.tolist(),
                                  self.length.tolist(), strict=True))
        return self._rows

    def __len__(self) -> int:
        return len(self.length)

    @overload
    def __getitem__(self, index: int) -> ExtentRow: ...

    @overload
    def __getitem__(self, index: slice) -> list[ExtentRow]: ...

    def __getitem__(self, index: int | slice) -> ExtentRow | list[ExtentRow]:
        return self.rows()[index]

    def __iter__(self) -> Iterator[ExtentRow]:
        return iter(self.rows())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Sequence):
            return self.rows() == list(other)
        return NotImplemented

    __hash__: Any = None

    def __repr__(self) -> str:
        return repr(self.rows())



def iovec_array(addresses: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """An ``(n, 2)`` uint64 iovec array of ``addresses`` and ``lengths``: the rows of
    host memory a request's extents occupy, as the stream transports hand them to
    ``sendmsg``/``recvmsg``."""
    iov = np.empty((len(lengths), 2), dtype=np.uint64)
    iov[:, 0] = addresses
    iov[:, 1] = lengths
    return iov


@dataclass(slots=True)
class WorkRequest:
    """One unit a rail posts: gather ``local`` extents into ``remote`` ranges.

    Extents are ``(segment id, offset, length)`` tuples (plain or :class:`Extent`).
    ``sum(local lengths) == sum(remote lengths) == nbytes``; the bytes are laid out in
    order, so the k-th byte of the local gather lands at the k-th byte of the remote
    scatter.
    """

    local: Sequence[ExtentRow]
    remote: Sequence[ExtentRow]
    nbytes: int
    rail: int = 0
    imm: bool = False  # carries the transfer's immediate (last request on its rail)
    # the same extents as columns (set by pack_columns)
    columns: Columns | None = field(default=None, compare=False, repr=False)


@dataclass(slots=True)
class Plan:
    requests: list[WorkRequest] = field(default_factory=list)
    rails_used: int = 0  # = number of immediates the target must count
    nbytes: int = 0

    def by_rail(self) -> dict[int, list[WorkRequest]]:
        out: dict[int, list[WorkRequest]] = {}
        for wr in self.requests:
            out.setdefault(wr.rail, []).append(wr)
        return out


def _i64(values: object) -> np.ndarray:
    return np.asarray(values, dtype=np.int64)


class Columns:
    """Pairs as five int64 arrays of one length: row k is the pair
    ``((lseg[k], loff[k], length[k]), (rseg[k], roff[k], length[k]))``.

    ``single`` records that every row has the same local and the same remote segment
    (the common case), which spares the planner the checks for mixed segments; ``block``
    that every row has that one length (0: not known); ``nbytes`` may be given when the
    caller already knows it. ``iov``, when known, holds each row's local memory as an
    ``(address, length)`` uint64 row (host memory only); slices keep their part of it,
    and any other reshaping drops it.
    """

    __slots__ = ("lseg", "loff", "rseg", "roff", "length", "single", "block", "iov",
                 "_nbytes")

    def __init__(self, lseg: np.ndarray, loff: np.ndarray, rseg: np.ndarray,
                 roff: np.ndarray, length: np.ndarray, *, single: bool = False,
                 nbytes: int | None = None, block: int = 0,
                 iov: np.ndarray | None = None) -> None:
        self.lseg = lseg
        self.loff = loff
        self.rseg = rseg
        self.roff = roff
        self.length = length
        self.single = single
        self.block = block
        self.iov = iov
        self._nbytes = nbytes

    @classmethod
    def from_pairs(cls, pairs: Sequence[Pair]) -> Columns:
        """Columns of ``(local, remote)`` span pairs (the local length is taken)."""
        rows = np.array([(loc[0], loc[1], rem[0], rem[1], loc[2]) for loc, rem in pairs],
                        dtype=np.int64).reshape(-1, 5)
        return cls(*(np.ascontiguousarray(rows[:, i]) for i in range(5)))

    @classmethod
    def uniform(cls, lseg: int, loff: np.ndarray, rseg: int, roff: np.ndarray,
                length: np.ndarray, nbytes: int | None = None, block: int = 0,
                frozen: bool = False) -> Columns:
        """Columns whose pairs all go from one local to one remote segment (``block``:
        the one length of every pair, if known). ``frozen`` makes the segment columns
        read-only too, for columns kept and planned again."""
        n = len(length)
        lcol, rcol = np.full(n, lseg, dtype=np.int64), np.full(n, rseg, dtype=np.int64)
        if frozen:
            lcol.flags.writeable = rcol.flags.writeable = False
        return cls(lcol, _i64(loff), rcol, _i64(roff), _i64(length), single=True,
                   nbytes=nbytes, block=block)

    def __len__(self) -> int:
        return len(self.length)

    @property
    def nbytes(self) -> int:
        if self._nbytes is None:
            self._nbytes = int(self.length.sum())
        return self._nbytes

    def remote_ids(self) -> list[int]:
        """The peer's segments these rows touch."""
        if self.single or len(self.rseg) <= 1:
            return [int(self.rseg[0])] if len(self.rseg) else []
        return [int(v) for v in np.unique(self.rseg)]

    def slice(self, start: int, end: int) -> Columns:
        iov = self.iov
        return Columns(self.lseg[start:end], self.loff[start:end], self.rseg[start:end],
                       self.roff[start:end], self.length[start:end], single=self.single,
                       block=self.block, iov=None if iov is None else iov[start:end])

    def take(self, index: np.ndarray) -> Columns:
        iov = self.iov
        return Columns(self.lseg[index], self.loff[index], self.rseg[index],
                       self.roff[index], self.length[index], single=self.single,
                       block=self.block, iov=None if iov is None else iov[index])

    def to_pairs(self) -> list[Pair]:
        ls, lo, rs, ro, n = (c.tolist() for c in (self.lseg, self.loff, self.rseg,
                                                  self.roff, self.length))
        return list(zip(zip(ls, lo, n, strict=True), zip(rs, ro, n, strict=True),
                        strict=True))


# --- coalesce ------------------------------------------------------------------------

def coalesce_columns(cols: Columns) -> Columns:
    """Sorts by remote address and merges rows contiguous on both sides.

    Sorting is safe: destinations of one transfer must not overlap (the result of
    overlapping writes is undefined on every transport), so order does not matter.
    """
    if len(cols) < 2:
        return cols
    single = cols.single
    if single and cols.block:
        # Rows of one length merge only where two remote offsets are that far apart;
        # scattered blocks (the usual case) have none, and then no reordering is needed.
        ro_sorted = np.sort(cols.roff)
        if not bool(((ro_sorted[1:] - ro_sorted[:-1]) == cols.block).any()):
            return cols
    if single or cols.rseg.min() == cols.rseg.max():
        order = np.argsort(cols.roff, kind="stable")
    else:
        order = np.lexsort((cols.length, cols.roff, cols.rseg))
    ro, n = cols.roff[order], cols.length[order]
    head = n[:-1]
    joins = (ro[1:] - ro[:-1]) == head  # remote neighbours: the only candidates
    lo = cols.loff[order]
    if joins.any():
        joins &= (lo[1:] - lo[:-1]) == head
    if single:  # one segment on each side: the segment columns need no reordering
        ls, rs = cols.lseg, cols.rseg
    else:
        ls, rs = cols.lseg[order], cols.rseg[order]
        joins &= (ls[1:] == ls[:-1]) & (rs[1:] == rs[:-1])
    if not joins.any():
        return Columns(ls, lo, rs, ro, n, single=single, nbytes=cols._nbytes,
                       block=cols.block, iov=None if cols.iov is None else cols.iov[order])
    starts = np.flatnonzero(np.concatenate(([True], ~joins)))
    return Columns(ls[starts], lo[starts], rs[starts], ro[starts],
                   np.add.reduceat(n, starts), single=single, nbytes=cols._nbytes)


def coalesce(pairs: Sequence[Pair]) -> list[Pair]:
    """Merges pairs that are contiguous on both sides, after sorting by remote address
    (see :func:`coalesce_columns`)."""
    if not pairs:
        return []
    return coalesce_columns(Columns.from_pairs(pairs)).to_pairs()


# --- slice ---------------------------------------------------------------------------

def slice_columns(cols: Columns, slice_size: int) -> Columns:
    """Cuts every row into extents of at most ``slice_size`` bytes (the last may be less).

    Extents of one row are cut evenly, so striping does not leave a small tail alone.
    """
    if slice_size <= 0:
        raise ValueError("slice_size must be positive")
    n = cols.length
    if len(n) == 0 or 0 < cols.block <= slice_size or int(n.max()) <= slice_size:
        return cols
    count = -(-n // slice_size)
    step = -(-n // count)
    row = np.repeat(np.arange(len(n)), count)
    first = np.repeat(np.cumsum(count) - count, count)
    start = (np.arange(len(row)) - first) * step[row]
    size = np.minimum(step[row], n[row] - start)
    return Columns(cols.lseg[row], cols.loff[row] + start, cols.rseg[row],
                   cols.roff[row] + start, size, single=cols.single, nbytes=cols._nbytes)


def slice_pairs(pairs: Sequence[Pair], slice_size: int) -> list[Pair]:
    """Cuts every pair into extents of at most ``slice_size`` bytes (see
    :func:`slice_columns`)."""
    if slice_size <= 0:
        raise ValueError("slice_size must be positive")
    if all(loc[2] <= slice_size for loc, _ in pairs):
        return list(pairs)
    return slice_columns(Columns.from_pairs(pairs), slice_size).to_pairs()


# --- pack ----------------------------------------------------------------------------

def pack_columns(extents: Columns, *, max_sge: int, max_wr_bytes: int,
                 remote_scatter: bool) -> list[WorkRequest]:
    """Packs extents, in order, into work requests within the transport's bounds.

    With ``remote_scatter`` False (RDMA WRITE/READ: one remote address per request) a
    request only grows while the remote side stays contiguous, and remote extents that
    touch are merged into one range; local extents may be anywhere (that is what the
    scatter-gather list is for). With ``remote_scatter`` True every extent keeps its own
    remote entry. A extent larger than ``max_wr_bytes`` makes a request of its own.
    """
    if max_sge < 1 or max_wr_bytes < 1:
        raise ValueError("max_sge and max_wr_bytes must be positive")
    count = len(extents)
    if count == 0:
        return []
    ls, lo, rs, ro, n = extents.lseg, extents.loff, extents.rseg, extents.roff, extents.length
    total = extents.nbytes
    block = extents.block
    uniform = (int(rs[0]), block) if extents.single and block > 0 else None
    luniform = (int(ls[0]), block) if uniform is not None else None
    if remote_scatter and count <= max_sge and total <= max_wr_bytes:  # one request
        return [WorkRequest(Extents(ls, lo, n, luniform), Extents(rs, ro, n, uniform),
                            total, columns=extents)]
    if remote_scatter and 0 < block <= max_wr_bytes:  # as many blocks as fit, in order
        per = min(max_sge, max_wr_bytes // block)
        parts = [extents.slice(i, i + per) for i in range(0, count, per)]
        return [WorkRequest(Extents(part.lseg, part.loff, part.length, luniform),
                            Extents(part.rseg, part.roff, part.length, uniform),
                            len(part) * block, columns=part) for part in parts]
    ends = np.cumsum(n)  # ends[k]: bytes of extents 0..k
    starts = [0]  # extents that start a new remote extent
    if not remote_scatter:
        jumps = (rs[1:] != rs[:-1]) | (ro[1:] != ro[:-1] + n[:-1])
        starts = [0, *(np.flatnonzero(jumps) + 1).tolist()]
    breaks = [*starts[1:], count]
    out: list[WorkRequest] = []
    i = r = done = 0  # extent, remote extent, bytes before extent i
    while i < count:
        while breaks[r] <= i:
            r += 1
        fits = int(np.searchsorted(ends, done + max_wr_bytes, side="right"))
        end = max(i + 1, min(i + max_sge, fits, breaks[r]))
        nbytes = int(ends[end - 1]) - done
        part = extents.slice(i, end)
        local = Extents(part.lseg, part.loff, part.length, luniform)
        if remote_scatter:
            remote: Sequence[ExtentRow] = Extents(part.rseg, part.roff, part.length, uniform)
        else:
            remote = [(int(rs[i]), int(ro[i]), nbytes)]
        out.append(WorkRequest(local, remote, nbytes, columns=part))
        done += nbytes
        i = end
    return out


def pack(extents: Sequence[Pair], *, max_sge: int, max_wr_bytes: int,
         remote_scatter: bool) -> list[WorkRequest]:
    """Packs extents, in order, into work requests (see :func:`pack_columns`)."""
    if max_sge < 1 or max_wr_bytes < 1:
        raise ValueError("max_sge and max_wr_bytes must be positive")
    if not extents:
        return []
    return pack_columns(Columns.from_pairs(extents), max_sge=max_sge,
                        max_wr_bytes=max_wr_bytes, remote_scatter=remote_scatter)


# --- assign --------------------------------------------------------------------------

def assign_rails(requests: Sequence[WorkRequest], num_rails: int,
                 weights: Sequence[float] | None = None) -> int:
    """Assigns each request to the rail with the least weighted load; returns rails used.

    Requests keep their relative order on each rail. Marks the last request of every
    used rail with ``imm``.
    """
    if num_rails < 1:
        raise ValueError("num_rails must be >= 1")
    if weights is None:
        weights = [1.0] * num_rails
    if len(weights) != num_rails or any(w <= 0 for w in weights):
        raise ValueError("need one positive weight per rail")
    if num_rails == 1 or len(requests) <= 1:  # all on one rail: the heaviest
        rail = 0 if num_rails == 1 else weights.index(max(weights))
        for wr in requests:
            wr.rail = rail
            wr.imm = False
        if requests:
            requests[-1].imm = True
        return 1 if requests else 0
    load = [0.0] * num_rails
    last: dict[int, WorkRequest] = {}
    for wr in requests:
        # least finishing time if this request went there
        rail = min(range(num_rails), key=lambda r: (load[r] + wr.nbytes) / weights[r])
        load[rail] += wr.nbytes
        wr.rail = rail
        wr.imm = False
        last[rail] = wr
    for wr in last.values():
        wr.imm = True
    return len(last)


# --- the whole plan ------------------------------------------------------------------

def plan_columns(cols: Columns, *, num_rails: int, slice_size: int, max_sge: int,
                 max_wr_bytes: int, remote_scatter: bool,
                 weights: Sequence[float] | None = None, min_split: int = 64 * 1024,
                 merge: bool = True) -> Plan:
    """The whole pipeline. Rows must already be validated (positive lengths).

    A request holds at most ``slice_size`` bytes; a transfer smaller than
    ``num_rails * slice_size`` is cut finer (down to ``min_split`` bytes per rail) so
    that every rail gets a share. Rows are merged (``merge``) unless that cannot save
    a request (see the comment below).
    """
    if num_rails < 1:
        raise ValueError("num_rails must be >= 1")
    total = cols.nbytes
    cap = min(slice_size, max_wr_bytes, max(min_split, -(-total // num_rails)))
    # On a transport that scatters remotely, merging cannot cut the request count of a
    # transfer that is one request anyway, or of blocks of one length whose requests
    # are bounded by bytes rather than by entries: it would only shorten iovec lists,
    # which the kernel walks faster than NumPy sorts them.
    as_is = remote_scatter and (
        (len(cols) <= max_sge and total <= cap)
        or (cols.single and 0 < cols.block <= cap and cols.block * max_sge >= cap))
    if merge and not as_is:
        cols = coalesce_columns(cols)
    extents = slice_columns(cols, cap)
    requests = pack_columns(extents, max_sge=max_sge, max_wr_bytes=cap,
                            remote_scatter=remote_scatter)
    rails = assign_rails(requests, num_rails, weights)
    return Plan(requests, rails, total)


def plan_transfer(pairs: Sequence[Pair], *, num_rails: int, slice_size: int,
                  max_sge: int, max_wr_bytes: int, remote_scatter: bool,
                  weights: Sequence[float] | None = None,
                  min_split: int = 64 * 1024, merge: bool = True) -> Plan:
    """:func:`plan_columns` for ``(local, remote)`` span pairs."""
    return plan_columns(Columns.from_pairs(pairs), num_rails=num_rails,
                        slice_size=slice_size, max_sge=max_sge,
                        max_wr_bytes=max_wr_bytes, remote_scatter=remote_scatter,
                        weights=weights, min_split=min_split, merge=merge)
