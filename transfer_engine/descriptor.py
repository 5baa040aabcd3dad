"""Descriptors and the op of a transfer.

A descriptor names bytes: ``(segment, offset, length)``. The segment is a local
:class:`~transfer_engine.segment.Segment` or a peer's
:class:`~transfer_engine.segment.RemoteSegment`. A transfer is a list of
``(local, remote)`` descriptor pairs, one op, one peer and optional notification bytes.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from transfer_engine.segment import RemoteSegment, Segment

__all__ = ["Op", "Descriptor", "Extent"]


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
