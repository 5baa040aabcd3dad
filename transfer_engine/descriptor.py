"""Descriptors and the op of a transfer.

A descriptor names bytes: ``(segment, offset, length)``. The segment is a local
:class:`~transfer_engine.segment.Segment` or a peer's
:class:`~transfer_engine.segment.RemoteSegment`. A transfer is a list of
``(local, remote)`` descriptor pairs, one op, one peer and optional notification bytes.

:class:`Blocks` says the same of many pairs at once, as arrays: the way to describe a
transfer of thousands of blocks, since a Python object per block costs more than moving
a 4 KiB block.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import numpy.typing as npt

from transfer_engine.planner import Columns, iovec_array

if TYPE_CHECKING:
    from transfer_engine.segment import RemoteSegment, Segment

__all__ = ["Op", "Descriptor", "Extent", "Blocks"]


class Op(enum.Enum):
    WRITE = "write"
    READ = "read"

    def __str__(self) -> str:
        return self.value


class Extent(NamedTuple):
    """A byte range of a segment by id: what planners and wire formats carry."""

    segment: int
    offset: int
    length: int

    @property
    def end(self) -> int:
        return self.offset + self.length


@dataclass(frozen=True, slots=True)
class Descriptor:
    """``length`` bytes at ``offset`` of ``segment`` (local or remote)."""

    segment: Segment | RemoteSegment
    offset: int
    length: int

    @property
    def extent(self) -> Extent:
        return Extent(self.segment.id, self.offset, self.length)

    def __repr__(self) -> str:
        return f"Descriptor({self.segment.name!r}, {self.offset}, {self.length})"


def _offsets(values: npt.ArrayLike, what: str) -> np.ndarray:
    arr = np.asarray(values)
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
        raise ValueError(f"{what} must be a 1-D array of integers, not "
                         f"{arr.dtype}{list(arr.shape)}")
    if arr.dtype.kind == "u" and arr.size and int(arr.max()) > np.iinfo(np.int64).max:
        raise ValueError(f"{what} exceed 2**63")
    out = np.array(arr, dtype=np.int64)  # a copy: later changes by the caller do not count
    out.flags.writeable = False
    return out


class Blocks:
    """Many ``(local, remote)`` pairs between one local and one remote segment, as arrays:
    pair ``k`` moves ``lengths[k]`` bytes between ``local_offsets[k]`` of ``local`` and
    ``remote_offsets[k]`` of ``remote``.

    :meth:`Engine.write <transfer_engine.engine.Engine.write>` and ``read`` take a Blocks
    (or a list of them, e.g. one per layer) wherever they take descriptor pairs, and check
    and plan the arrays as they are. ``lengths`` may be one int for every pair. The arrays
    are copied, so the caller may reuse its own at once. Raises ``ValueError`` for arrays
    that are not 1-D integers of one length; offsets and lengths are checked against the
    segments when a transfer is submitted.

    The array work is done here, once, while the arrays are fresh in the cache: their
    largest offsets, their planner columns and, for host memory, the local side's
    ``(address, length)`` rows that the stream transports hand to the kernel. The copies
    are read-only, so a transfer (and every later transfer of the same blocks) only
    compares those maxima with its segments' sizes, with no NumPy call; on a host busy
    copying, each such call costs several times its nominal price.
    """

    __slots__ = ("local", "remote", "local_offsets", "remote_offsets", "lengths", "block",
                 "_reach", "_columns")

    def __init__(self, local: Segment, remote: RemoteSegment, local_offsets: npt.ArrayLike,
                 remote_offsets: npt.ArrayLike, lengths: npt.ArrayLike | int) -> None:
        self.local = local
        self.remote = remote
        self.local_offsets = _offsets(local_offsets, "local_offsets")
        self.remote_offsets = _offsets(remote_offsets, "remote_offsets")
        count = len(self.local_offsets)
        if len(self.remote_offsets) != count:
            raise ValueError(f"{count} local offsets but {len(self.remote_offsets)} remote "
                             "offsets")
        # the one length of every pair (given as an int), -1 for a bad one, 0 if varied
        self.block = 0
        if isinstance(lengths, int | np.integer):
            self.block = int(lengths) if int(lengths) > 0 else -1
            self.lengths = _offsets(np.full(count, int(lengths), dtype=np.int64), "lengths")
        else:
            self.lengths = _offsets(lengths, "lengths")
            if len(self.lengths) != count:
                raise ValueError(f"{count} offsets but {len(self.lengths)} lengths")
        # the largest local and remote offsets, seen unsigned (a negative one is huge,
        # so one maximum bounds both ends); only for blocks of one length
        self._reach: tuple[int, int] | None = None
        if self.block > 0 and count:
            self._reach = (int(self.local_offsets.view(np.uint64).max()),
                           int(self.remote_offsets.view(np.uint64).max()))
        self._columns: Columns | None = None
        lid, rid = getattr(local, "id", None), getattr(remote, "id", None)
        if isinstance(lid, int) and isinstance(rid, int):  # else refused when submitted
            self._columns = Columns.uniform(
                lid, self.local_offsets, rid, self.remote_offsets, self.lengths,
                count * self.block if self.block > 0 else None, max(self.block, 0),
                frozen=True)
            base = getattr(local, "address", None)
            if getattr(local, "device", None) == "cpu" and isinstance(base, int):
                iov = iovec_array(self.local_offsets + base, self.lengths)
                iov.flags.writeable = False
                self._columns.iov = iov

    def __len__(self) -> int:
        return len(self.lengths)

    @property
    def nbytes(self) -> int:
        return int(self.lengths.sum())

    @property
    def local_iov(self) -> np.ndarray | None:
        """The local side's read-only ``(address, length)`` rows, laid out when built
        for host memory (what the stream transports hand the kernel); else None."""
        return self._columns.iov if self._columns is not None else None

    def __iter__(self) -> Iterator[tuple[Descriptor, Descriptor]]:
        """The pairs as descriptors (one object per pair: for inspection, not speed)."""
        for lo, ro, n in zip(self.local_offsets.tolist(), self.remote_offsets.tolist(),
                             self.lengths.tolist(), strict=True):
            yield Descriptor(self.local, lo, n), Descriptor(self.remote, ro, n)

    def __repr__(self) -> str:
        return (f"<Blocks {self.local.name!r}\u2192{self.remote.name!r} {len(self)} pairs "
                f"{self.nbytes} bytes>")
