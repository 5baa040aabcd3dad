"""Checks of a transfer's descriptors before anything moves.

One pass over the descriptors and a few array checks keep this cheap for thousands of
small blocks; any failure is re-checked pair by pair for a precise error naming peer,
op, segment, offset and length.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, cast

import numpy as np

from transfer_engine.descriptor import Blocks, Descriptor, Op
from transfer_engine.errors import (
    InvalidDescriptorError,
)
from transfer_engine.peer import Peer
from transfer_engine.planner import Columns
from transfer_engine.segment import RemoteSegment, Segment

__all__ = ["Pairs", "validate", "validate_blocks", "validate_each"]

Pairs = Sequence[tuple[Descriptor, Descriptor]] | Blocks | Sequence[Blocks]
"""What a transfer moves: descriptor pairs, or the same as :class:`Blocks` arrays."""


def _in_bounds(nums: np.ndarray, llen: int | np.ndarray, rlen: int | np.ndarray
               ) -> tuple[int, int] | None:
    """``(bytes, block)`` of the (local offset, local length, remote offset, remote
    length) columns of ``nums`` if every pair is a non-empty range inside its segments
    with equal lengths on both sides, else None; ``block`` is the one length of every
    pair, or 0 when they differ."""
    lo, ll, ro, rl = nums
    if isinstance(llen, int) and isinstance(rlen, int):
        low, high = nums.min(axis=1).tolist(), nums.max(axis=1).tolist()
        if 0 < low[1] == high[1] == low[3] == high[3]:  # one block length: the extremes
            ok = (low[0] >= 0 and low[2] >= 0 and high[0] + high[1] <= llen
                  and high[2] + high[1] <= rlen)
            return (len(ll) * high[1], high[1]) if ok else None
    # subtracting keeps every term in range: no int64 wrap-around
    ok = (ll > 0) & (lo >= 0) & (ro >= 0) & (lo <= llen - ll) & (ro <= rlen - ll)
    if bool(ok.all()) and bool(np.array_equal(ll, rl)):
        return int(ll.sum()), 0
    return None


def _blocks_in_bounds(g: Blocks, llen: int, rlen: int) -> tuple[int, int] | None:
    """:func:`_in_bounds` for one :class:`Blocks`; no NumPy call when its pairs share
    one length (the Blocks measured its largest offsets when it was built)."""
    block = g.block
    if block > 0:
        lmax, rmax = g._reach or (0, 0)  # the largest offsets, seen unsigned
        if block <= llen and block <= rlen and lmax <= llen - block and rmax <= rlen - block:
            return len(g.local_offsets) * block, block
        return None
    if block < 0:
        return None
    return _in_bounds(np.stack((g.local_offsets, g.lengths, g.remote_offsets, g.lengths)),
                      llen, rlen)


def validate(segments: dict[int, Segment], op: Op, peer: Peer, pairs: Pairs
             ) -> tuple[Columns, list[Segment]]:
    """Checks every pair before anything moves; returns the pairs as planner columns
    and the local segments they use.

    One pass over the descriptors and a few array checks keep this cheap for
    thousands of small blocks; any failure is re-checked pair by pair for a precise
    error.
    """
    if isinstance(pairs, Blocks):
        return validate_blocks(segments, op, peer, [pairs])
    if pairs and all(isinstance(g, Blocks) for g in pairs):
        return validate_blocks(segments, op, peer, pairs)  # type: ignore[arg-type]
    if not pairs:
        raise InvalidDescriptorError("a transfer needs at least one pair", peer=peer.name,
                                     op=str(op))
    descs = cast(Sequence[tuple[Descriptor, Descriptor]], pairs)
    try:
        ls, lo, ll, rs, ro, rl = zip(*[(loc.segment, loc.offset, loc.length, rem.segment,
                                        rem.offset, rem.length) for loc, rem in descs],
                                     strict=True)
    except (TypeError, ValueError, AttributeError):
        ls = ()
    if ls:
        count = len(ls)
        uniform = ls.count(ls[0]) == count and rs.count(rs[0]) == count
        lsegs = [ls[0]] if uniform else list({id(s): s for s in ls}.values())
        rsegs = [rs[0]] if uniform else list({id(s): s for s in rs}.values())
        write = op is Op.WRITE
        segs_ok = all(isinstance(seg, Segment) and segments.get(seg.id) is seg
                      and not seg.closed and (write or seg.writable)
                      for seg in lsegs) and all(
            isinstance(seg, RemoteSegment) and seg.peer == peer.name
            and (seg.writable or not write) for seg in rsegs)
        try:
            nums = np.array((lo, ll, ro, rl)) if segs_ok else None
        except (TypeError, ValueError, OverflowError):
            nums = None
        if nums is not None and nums.dtype.kind == "i":
            nlo, nll, nro, _ = nums
            if uniform:
                sized = _in_bounds(nums, lsegs[0].length, rsegs[0].length)
            else:
                sized = _in_bounds(nums, np.array([s.length for s in ls], dtype=np.int64),
                                   np.array([s.length for s in rs], dtype=np.int64))
            if sized is not None:
                nbytes, block = sized
                if uniform:
                    cols = Columns.uniform(lsegs[0].id, nlo, rsegs[0].id, nro, nll,
                                           nbytes, block)
                else:
                    cols = Columns(np.array([s.id for s in ls], dtype=np.int64), nlo,
                                   np.array([s.id for s in rs], dtype=np.int64), nro,
                                   nll, nbytes=nbytes)
                return cols, [s for s in lsegs if isinstance(s, Segment)]
    validate_each(segments, op, peer, pairs)
    raise InvalidDescriptorError("descriptors failed validation", peer=peer.name,
                                 op=str(op))


def validate_blocks(segments: dict[int, Segment], op: Op, peer: Peer, groups: Sequence[Blocks]
                     ) -> tuple[Columns, list[Segment]]:
    """:meth:`_validate` for arrays: a few array checks per segment pair (none for one
    Blocks of one length, which brings its own maxima and columns)."""
    write = op is Op.WRITE
    parts: list[tuple[Blocks, int]] = []
    for g in groups:
        lseg, rseg = g.local, g.remote
        if not len(g):
            continue
        sized = None
        if (isinstance(lseg, Segment) and segments.get(lseg.id) is lseg
                and not lseg.closed and (write or lseg.writable)
                and isinstance(rseg, RemoteSegment) and rseg.peer == peer.name
                and (rseg.writable or not write)):
            sized = _blocks_in_bounds(g, lseg.length, rseg.length)
        if sized is None:
            validate_each(segments, op, peer, g)
            raise InvalidDescriptorError("descriptors failed validation",
                                         peer=peer.name, op=str(op))
        parts.append((g, sized[0]))
    if not parts:
        raise InvalidDescriptorError("a transfer needs at least one pair", peer=peer.name,
                                     op=str(op))
    first = parts[0][0]
    if len(parts) == 1 and first._columns is not None:
        return first._columns, [first.local]
    total = sum(n for _, n in parts)
    lsegs = list({id(g.local): g.local for g, _ in parts}.values())
    counts = [len(g) for g, _ in parts]
    cols = Columns(np.repeat([g.local.id for g, _ in parts], counts),
                   np.concatenate([g.local_offsets for g, _ in parts]),
                   np.repeat([g.remote.id for g, _ in parts], counts),
                   np.concatenate([g.remote_offsets for g, _ in parts]),
                   np.concatenate([g.lengths for g, _ in parts]), nbytes=total)
    return cols, lsegs


def validate_each(segments: dict[int, Segment], op: Op, peer: Peer, pairs: Iterable[Any]) -> None:
    """Raises the precise error for the first bad pair."""
    for pair in pairs:
        try:
            local, remote = pair
        except (TypeError, ValueError) as exc:
            raise InvalidDescriptorError(f"not a (local, remote) pair: {pair!r:.80}",
                                         peer=peer.name, op=str(op)) from exc
        if not isinstance(local, Descriptor) or not isinstance(remote, Descriptor):
            raise InvalidDescriptorError("pairs hold Descriptor objects", peer=peer.name,
                                         op=str(op))
        lseg, rseg = local.segment, remote.segment
        if not isinstance(lseg, Segment) or segments.get(lseg.id) is not lseg:
            raise InvalidDescriptorError(
                "local descriptor does not name a segment registered with this engine",
                peer=peer.name, op=str(op), segment=getattr(lseg, "name", lseg),
                offset=local.offset, length=local.length)
        if not isinstance(rseg, RemoteSegment) or rseg.peer != peer.name:
            raise InvalidDescriptorError(
                "remote descriptor does not name a segment of this peer", peer=peer.name,
                op=str(op), segment=getattr(rseg, "name", rseg), offset=remote.offset,
                length=remote.length)
        if local.length != remote.length:
            raise InvalidDescriptorError(
                f"local length {local.length} != remote length {remote.length}",
                peer=peer.name, op=str(op), segment=rseg.name, offset=remote.offset,
                length=remote.length)
        lseg.check(local.offset, local.length, write=op is Op.READ, op=str(op),
                   peer=peer.name)
        if remote.offset < 0 or remote.offset + remote.length > rseg.length:
            raise InvalidDescriptorError(
                f"range out of bounds of remote segment of {rseg.length} bytes",
                peer=peer.name, op=str(op), segment=rseg.name, offset=remote.offset,
                length=remote.length)
        if op is Op.WRITE and not rseg.writable:
            raise InvalidDescriptorError("remote segment is read-only", peer=peer.name,
                                         op=str(op), segment=rseg.name,
                                         offset=remote.offset, length=remote.length)
