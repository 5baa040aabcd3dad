"""Transfer planning: pure functions from descriptor pairs to work requests on rails.

    pairs --coalesce--> fewer, longer pairs
          --slice-----> pieces of at most ``slice_size`` bytes
          --pack------> work requests of at most ``max_sge`` local pieces and
                        ``max_wr_bytes`` bytes (one contiguous remote range when the
                        transport cannot scatter remotely, as with RDMA WRITE)
          --assign----> rails, balanced by bytes (optionally weighted, e.g. by link rate)
          --mark------> the last request of each used rail carries the immediate

Everything here is deterministic and side-effect free, so it is tested exhaustively on
any machine and shared by every transport.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from operator import itemgetter

__all__ = ["Pair", "WorkRequest", "Plan", "coalesce", "slice_pairs", "pack",
           "assign_rails", "plan_transfer"]

Span = tuple[int, int, int]  # (segment, offset, length): an Extent or a plain tuple
# Plain tuples on the hot path: building a NamedTuple costs ten times more.
Pair = tuple[Span, Span]  # (local, remote)

@dataclass(slots=True)
class WorkRequest:
    """One unit a rail posts: gather ``local`` pieces into ``remote`` ranges.

    Pieces are ``(segment id, offset, length)`` tuples (plain or :class:`Extent`).
    ``sum(local lengths) == sum(remote lengths) == nbytes``; the bytes are laid out in
    order, so the k-th byte of the local gather lands at the k-th byte of the remote
    scatter.
    """

    local: list[Span]
    remote: list[Span]
    nbytes: int
    rail: int = 0
    imm: bool = False  # carries the transfer's immediate (last request on its rail)


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


def coalesce(pairs: Sequence[Pair]) -> list[Pair]:
    """Merges pairs that are contiguous on both sides, after sorting by remote address.

    Sorting is safe: destinations of one transfer must not overlap (the result of
    overlapping writes is undefined on every transport), so order does not matter.
    """
    if not pairs:
        return []
    ordered = sorted(pairs, key=itemgetter(1))
    out: list[Pair] = []
    (ls, lo, n), (rs, ro, _) = ordered[0]
    for (ls2, lo2, n2), (rs2, ro2, _) in ordered[1:]:
        if ls2 == ls and rs2 == rs and lo2 == lo + n and ro2 == ro + n:
            n += n2
            continue
        out.append(((ls, lo, n), (rs, ro, n)))
        ls, lo, n, rs, ro = ls2, lo2, n2, rs2, ro2
    out.append(((ls, lo, n), (rs, ro, n)))
    return out


def slice_pairs(pairs: Sequence[Pair], slice_size: int) -> list[Pair]:
    """Cuts every pair into pieces of at most ``slice_size`` bytes (the last may be less).

    Pieces of one pair are cut evenly, so striping does not leave a small tail alone.
    """
    if slice_size <= 0:
        raise ValueError("slice_size must be positive")
    if all(loc[2] <= slice_size for loc, _ in pairs):
        return list(pairs)
    out: list[Pair] = []
    for pair in pairs:
        (ls, lo, n), (rs, ro, _) = pair
        if n <= slice_size:
            out.append(pair)
            continue
        count = -(-n // slice_size)
        step = -(-n // count)
        for start in range(0, n, step):
            size = min(step, n - start)
            out.append(((ls, lo + start, size), (rs, ro + start, size)))
    return out


def pack(pieces: Sequence[Pair], *, max_sge: int, max_wr_bytes: int,
         remote_scatter: bool) -> list[WorkRequest]:
    """Packs pieces, in order, into work requests within the transport's bounds.

    With ``remote_scatter`` False (RDMA WRITE/READ: one remote address per request) a
    request only grows while the remote side stays contiguous, and remote pieces that
    touch are merged into one range; local pieces may be anywhere (that is what the
    scatter-gather list is for). With ``remote_scatter`` True every piece keeps its own
    remote entry.
    """
    if max_sge < 1 or max_wr_bytes < 1:
        raise ValueError("max_sge and max_wr_bytes must be positive")
    out: list[WorkRequest] = []
    start = count = nbytes = 0
    last_seg = last_end = -1
    for i, (loc, rem) in enumerate(pieces):
        n = loc[2]
        if count and count < max_sge and nbytes + n <= max_wr_bytes and (
                remote_scatter or (rem[0] == last_seg and rem[1] == last_end)):
            count += 1
            nbytes += n
        else:
            if count:
                out.append(_request(pieces[start:i], nbytes, remote_scatter))
            start, count, nbytes = i, 1, n
        last_seg, last_end = rem[0], rem[1] + n
    if count:
        out.append(_request(pieces[start:], nbytes, remote_scatter))
    return out


def _request(group: Sequence[Pair], nbytes: int, remote_scatter: bool) -> WorkRequest:
    local = [p[0] for p in group]
    if remote_scatter:
        return WorkRequest(local, [p[1] for p in group], nbytes)
    seg, off = group[0][1][0], group[0][1][1]
    return WorkRequest(local, [(seg, off, nbytes)], nbytes)


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


def plan_transfer(pairs: Sequence[Pair], *, num_rails: int, slice_size: int,
                  max_sge: int, max_wr_bytes: int, remote_scatter: bool,
                  weights: Sequence[float] | None = None,
                  min_split: int = 64 * 1024, merge: bool = True) -> Plan:
    """The whole pipeline. Pairs must already be validated (equal, positive lengths).

    A request holds at most ``slice_size`` bytes; a transfer smaller than
    ``num_rails * slice_size`` is cut finer (down to ``min_split``) so that every rail
    gets a share.
    """
    merged = coalesce(pairs) if merge else list(pairs)
    total = sum(loc[2] for loc, _ in merged)
    cap = min(slice_size, max_wr_bytes, max(min_split, -(-total // num_rails)))
    pieces = slice_pairs(merged, cap)
    requests = pack(pieces, max_sge=max_sge, max_wr_bytes=cap,
                    remote_scatter=remote_scatter)
    rails = assign_rails(requests, num_rails, weights)
    return Plan(requests, rails, total)
