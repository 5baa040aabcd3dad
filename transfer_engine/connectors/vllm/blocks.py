"""Where a layer tensor's blocks lie, from its strides; runs of adjacent blocks."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class BlockLayout:
    """Where block ``b`` of one layer tensor lies, in bytes from the tensor's start:
    ``part_offsets[i] + b * block_stride`` for ``part_len`` bytes, for each part i (K
    and V are two parts in vLLM's GPU layout, one part in block-major layouts)."""

    block_stride: int
    part_offsets: tuple[int, ...]
    part_len: int
    extent: int  # bytes from the first to one past the last byte of the tensor
    signature: str  # what must match between peers (shape without the block count)

    @property
    def contiguous_blocks(self) -> bool:
        """Whether consecutive blocks of a part are adjacent (runs coalesce)."""
        return self.part_len == self.block_stride

    def spans(self, blocks: Sequence[int]) -> list[tuple[int, int]]:
        return [(off + b * self.block_stride, self.part_len)
                for off in self.part_offsets for b in blocks]

    def to_wire(self) -> list[Any]:
        return [self.block_stride, list(self.part_offsets), self.part_len, self.extent,
                self.signature]

    @classmethod
    def from_wire(cls, data: list[Any]) -> BlockLayout:
        stride, offsets, part_len, extent, signature = data
        return cls(int(stride), tuple(int(o) for o in offsets), int(part_len), int(extent),
                   str(signature))


def block_layout(shape: Sequence[int], strides: Sequence[int], itemsize: int,
                 num_blocks: int, dtype: str = "") -> BlockLayout:
    """The block layout of a KV tensor of ``shape``/``strides`` (in elements) holding
    ``num_blocks`` blocks, derived from the strides alone.

    The block dimension is the one of size ``num_blocks`` (when a leading dimension of
    size 2 is K/V and ``num_blocks`` is 2 too, the later one). Dimensions with a larger
    stride give parts (K and V); smaller ones are the block's interior.
    """
    if len(shape) != len(strides):
        raise ValueError("shape and strides differ in length")
    if any(s < 0 for s in strides):
        raise ValueError(f"negative strides {tuple(strides)} are not supported")
    candidates = [d for d, n in enumerate(shape) if n == num_blocks]
    if not candidates:
        raise ValueError(f"no dimension of {tuple(shape)} has {num_blocks} blocks")
    bd = candidates[-1] if len(candidates) > 1 and shape[0] == 2 else candidates[0]
    bstride = strides[bd]
    inner = [d for d in range(len(shape)) if d != bd and shape[d] > 1
             and strides[d] < bstride]
    outer = [d for d in range(len(shape)) if d != bd and shape[d] > 1
             and strides[d] >= bstride]
    interior = 1 + sum((shape[d] - 1) * strides[d] for d in inner)
    if interior > bstride and num_blocks > 1:
        raise ValueError(f"blocks overlap: interior {interior} > block stride {bstride}")
    offsets = [0]
    for d in outer:
        offsets = [o + i * strides[d] for o in offsets for i in range(shape[d])]
    extent = 1 + sum((n - 1) * s for n, s in zip(shape, strides, strict=True))
    sig_shape = ["B" if d == bd else str(n) for d, n in enumerate(shape)]
    signature = f"{dtype}[{','.join(sig_shape)}]parts={len(offsets)}"
    return BlockLayout(bstride * itemsize, tuple(sorted(o * itemsize for o in offsets)),
                       interior * itemsize, extent * itemsize, signature)


def coalesce(local: Sequence[int], remote: Sequence[int]) -> list[tuple[int, int, int]]:
    """Runs ``(local start, remote start, count)`` where both block lists go up by one."""
    runs: list[tuple[int, int, int]] = []
    for lb, rb in zip(local, remote, strict=True):
        if runs:
            ls, rs, n = runs[-1]
            if lb == ls + n and rb == rs + n:
                runs[-1] = (ls, rs, n + 1)
                continue
        runs.append((lb, rb, 1))
    return runs


def layer_groups(order: Sequence[str]) -> list[list[str]]:
    """Layers in forward order, cut into groups of 1, 1, 2, 4, 8... : a load read group by
    group lets the forward start after the first layer's bytes and find each later
    group landed while it computed the earlier ones, with few transfers to post."""
    groups: list[list[str]] = []
    at, size = 0, 1
    while at < len(order):
        groups.append(list(order[at:at + size]))
        at += size
        if len(groups) > 1:
            size *= 2
    return groups
