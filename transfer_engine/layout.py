"""Paged-KV layouts: (layer, block id, K/V) -> descriptors, with runs coalesced.

A :class:`BlockLayout` says where block ``b`` of one registered layer tensor lies in its
segment: for each part ``p`` (K and V in vLLM's GPU layout, one part in block-major
layouts) the bytes ``[start, start + block_bytes)`` with
``start = segment_offset + parts[p] + b * block_stride``. It is derived from the
tensor's own strides, never from an assumed shape, so the same code serves

- vLLM's GPU per-layer ``[2, num_blocks, block_size, kv_heads, head_dim]`` (also when
  it is a permuted view of a ``[num_blocks, 2, ...]`` allocation),
- block-major layouts such as vLLM's CPU ``[num_blocks, kv_heads, block_size,
  2*head_dim]`` or FlashInfer's ``[num_blocks, 2, block_size, kv_heads, head_dim]``.

:func:`pairs_for_blocks` maps local block ids to remote block ids for every layer and
merges blocks into one descriptor where they are adjacent on both sides.

Pure: no I/O, and torch is never imported (tensors are read through ``.shape``,
``.stride()``/``.strides`` and their element size).
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from transfer_engine.descriptor import Blocks, Descriptor
from transfer_engine.errors import InvalidDescriptorError

if TYPE_CHECKING:
    from transfer_engine.segment import RemoteSegment, Segment

__all__ = ["BlockLayout", "head_split", "head_pieces", "vllm_gpu_layout",
           "block_major_layout", "vllm_cpu_layout", "block_runs", "block_extents",
           "pair_runs", "pairs_for_blocks", "kv_blocks"]

# (logical rank among the block's interior dims, size), in memory order (outer first)
PartShape = tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class BlockLayout:
    """Where the blocks of one layer tensor lie in its segment, in bytes.

    :param num_blocks: blocks in the tensor; valid ids are ``0 .. num_blocks - 1``.
    :param block_stride: bytes from block ``b`` to block ``b + 1`` (of the same part).
    :param block_bytes: contiguous bytes of one part of one block.
    :param parts: byte offset of each part of block 0 from the tensor's start, in
        logical order (K before V); local part ``i`` pairs with remote part ``i``.
    :param segment_offset: byte offset of the tensor in its segment (0 when the tensor
        is the registered memory itself).
    :param part_shape: memory-order shape of one part, checked between peers when both
        know it (``None``: not checked).
    :param dtype: element type name, checked between peers when both know it.
    :param heads: ``(outer, count, unit)`` where a part's bytes are ``outer`` runs of
        ``count`` attention heads of ``unit`` contiguous bytes each (``outer`` 1 when the
        heads are the part's outermost dimension, as in vLLM's CPU layout; the block's
        tokens in its GPU layout): what lets a peer holding other heads of the same
        model take a slice of them (:func:`head_pieces`). None: not known.

    Blocks never overlap each other or another part (checked here).
    """

    num_blocks: int
    block_stride: int
    block_bytes: int
    parts: tuple[int, ...] = (0,)
    segment_offset: int = 0
    part_shape: PartShape | None = None
    dtype: str | None = None
    heads: tuple[int, int, int] | None = None

    def __post_init__(self) -> None:
        if self.heads is not None and (
                min(self.heads) < 1
                or self.heads[0] * self.heads[1] * self.heads[2] != self.block_bytes):
            raise ValueError(f"heads {self.heads} (outer, count, unit bytes) do not make "
                             f"a part of {self.block_bytes} bytes")
        if self.num_blocks < 1:
            raise ValueError(f"a layout needs at least one block, got {self.num_blocks}")
        if self.block_bytes < 1:
            raise ValueError(f"block_bytes must be positive, got {self.block_bytes}")
        if self.segment_offset < 0:
            raise ValueError(f"segment_offset must be >= 0, got {self.segment_offset}")
        if not self.parts or any(p < 0 for p in self.parts):
            raise ValueError(f"parts must be non-empty offsets >= 0, got {self.parts}")
        if self.num_blocks > 1 and self.block_stride < self.block_bytes:
            raise ValueError(f"blocks overlap: block_stride {self.block_stride} < "
                             f"block_bytes {self.block_bytes}")
        ordered = sorted(self.parts)
        for i, p in enumerate(ordered):
            for q in ordered[i + 1:]:
                if self._gap(q - p) < self.block_bytes:
                    raise ValueError(f"parts at {p} and {q} overlap for some blocks "
                                     f"(block_stride {self.block_stride}, block_bytes "
                                     f"{self.block_bytes}, {self.num_blocks} blocks)")

    def _gap(self, d: int) -> int:
        """Least ``|d + k * block_stride|`` over block distances ``k``: how close a
        part ``d`` bytes later comes to the first part of any block."""
        n, s = self.num_blocks, self.block_stride
        if n == 1 or s == 0:
            return d
        lo, hi = -(n - 1), n - 1
        k = -d // s  # floor(-d / s); the closest block is k or k + 1
        return min(abs(d + max(lo, min(hi, c)) * s) for c in (k, k + 1))

    @property
    def contiguous(self) -> bool:
        """Whether consecutive blocks of a part are adjacent (runs coalesce)."""
        return self.block_stride == self.block_bytes

    @property
    def nbytes(self) -> int:
        """Bytes of one block over all parts."""
        return self.block_bytes * len(self.parts)

    @property
    def extent(self) -> int:
        """Bytes from the tensor's start to one past its last block byte."""
        return max(self.parts) + (self.num_blocks - 1) * self.block_stride + self.block_bytes

    def offset(self, block: int, part: int = 0) -> int:
        """Byte offset in the segment of ``part`` of ``block``."""
        if not 0 <= block < self.num_blocks:
            raise ValueError(f"block id {block} out of range [0, {self.num_blocks})")
        return self.segment_offset + self.parts[part] + block * self.block_stride

    def compatible(self, other: BlockLayout) -> str | None:
        """Why blocks of ``self`` cannot be copied byte for byte into ``other``, or None."""
        if self.block_bytes != other.block_bytes:
            return f"block_bytes {self.block_bytes} != {other.block_bytes}"
        if len(self.parts) != len(other.parts):
            return f"{len(self.parts)} parts != {len(other.parts)} parts"
        if self.part_shape is not None and other.part_shape is not None \
                and self.part_shape != other.part_shape:
            return f"part shape {self.part_shape} != {other.part_shape}"
        if self.dtype is not None and other.dtype is not None and self.dtype != other.dtype:
            return f"dtype {self.dtype} != {other.dtype}"
        return None

    def to_wire(self) -> dict[str, Any]:
        return {"num_blocks": self.num_blocks, "block_stride": self.block_stride,
                "block_bytes": self.block_bytes, "parts": list(self.parts),
                "segment_offset": self.segment_offset,
                "part_shape": None if self.part_shape is None
                else [list(d) for d in self.part_shape],
                "dtype": self.dtype,
                "heads": None if self.heads is None else list(self.heads)}

    @classmethod
    def from_wire(cls, data: dict[str, Any]) -> BlockLayout:
        shape = data.get("part_shape")
        dtype = data.get("dtype")
        heads = data.get("heads")
        if heads is not None and (not isinstance(heads, list | tuple) or len(heads) != 3):
            raise ValueError(f"heads must be (outer, count, unit), got {heads!r:.40}")
        return cls(int(data["num_blocks"]), int(data["block_stride"]),
                   int(data["block_bytes"]), tuple(int(p) for p in data["parts"]),
                   int(data.get("segment_offset", 0)),
                   None if shape is None else tuple((int(r), int(n)) for r, n in shape),
                   None if dtype is None else str(dtype),
                   None if heads is None else (int(heads[0]), int(heads[1]), int(heads[2])))

    @classmethod
    def from_strides(cls, shape: Sequence[int], strides: Sequence[int], itemsize: int, *,
                     block_dim: int, kv_dim: int | None = None, segment_offset: int = 0,
                     dtype: str | None = None) -> BlockLayout:
        """The layout of a tensor of ``shape`` with ``strides`` **in bytes**.

        ``block_dim`` indexes blocks; ``kv_dim`` (if any) indexes parts (K, V). Every
        other dimension is the block's interior, which must be dense in memory (in any
        dimension order; the order is recorded in ``part_shape``), else ``ValueError``.
        """
        shape = [int(n) for n in shape]
        strides = [int(s) for s in strides]
        ndim = len(shape)
        if len(strides) != ndim:
            raise ValueError(f"shape {tuple(shape)} and strides {tuple(strides)} differ "
                             "in length")
        if itemsize < 1:
            raise ValueError(f"itemsize must be positive, got {itemsize}")
        block_dim = _dim(block_dim, ndim, "block_dim")
        if kv_dim is not None:
            kv_dim = _dim(kv_dim, ndim, "kv_dim")
            if kv_dim == block_dim:
                raise ValueError("kv_dim and block_dim are the same dimension")
        if any(n == 0 for n in shape):
            raise ValueError(f"tensor of shape {tuple(shape)} is empty")
        if any(s < 0 for s, n in zip(strides, shape, strict=True) if n > 1):
            raise ValueError(f"negative strides {tuple(strides)} are not supported")
        interior = [d for d in range(ndim) if d not in (block_dim, kv_dim) and shape[d] > 1]
        # memory order: largest stride first; a dense interior has strides that are the
        # running products of the sizes after it, ending in the element size
        by_stride = sorted(interior, key=lambda d: strides[d], reverse=True)
        expected = itemsize
        for d in reversed(by_stride):
            if strides[d] != expected:
                raise ValueError(
                    f"a block's part is not contiguous in memory: shape {tuple(shape)}, "
                    f"byte strides {tuple(strides)} (dimension {d} has stride "
                    f"{strides[d]}, a dense part needs {expected}); register a tensor "
                    "whose dimensions other than the block and K/V ones are dense")
            expected *= shape[d]
        block_bytes = expected
        num_blocks = shape[block_dim]
        block_stride = strides[block_dim] if num_blocks > 1 else block_bytes
        if kv_dim is None or shape[kv_dim] == 1:
            parts: tuple[int, ...] = (0,)
        else:
            parts = tuple(i * strides[kv_dim] for i in range(shape[kv_dim]))
        rank = {d: r for r, d in enumerate(interior)}
        part_shape = tuple((rank[d], shape[d]) for d in by_stride)
        return cls(num_blocks, block_stride, block_bytes, parts, segment_offset,
                   part_shape, dtype)

    @classmethod
    def from_tensor(cls, t: Any, *, block_dim: int, kv_dim: int | None = None,
                    segment_offset: int | None = None,
                    base_address: int | None = None) -> BlockLayout:
        """The layout of a torch tensor, numpy array or CUDA array ``t``.

        Strides come from ``t.stride()`` (elements, torch) or ``t.strides`` (bytes,
        numpy and cupy). The tensor's offset in its segment is ``segment_offset``, or
        ``address(t) - base_address`` when the segment's base address is given, else 0.
        """
        itemsize, strides = _strides(t)
        shape = tuple(int(n) for n in t.shape)
        if segment_offset is None:
            segment_offset = 0 if base_address is None else _address(t) - base_address
            if segment_offset < 0:
                raise ValueError(f"tensor lies {-segment_offset} bytes before the segment "
                                 "base address")
        return cls.from_strides(shape, strides, itemsize, block_dim=block_dim,
                                kv_dim=kv_dim, segment_offset=segment_offset,
                                dtype=_dtype_name(t))


def head_split(shape: Sequence[int], strides: Sequence[int], itemsize: int,
               heads_dim: int, block_bytes: int) -> tuple[int, int, int] | None:
    """``(outer, count, unit)`` of a dense block part whose heads are dimension
    ``heads_dim`` of a tensor of ``shape``/``strides`` (bytes): the dims of the part
    with a larger stride multiply into ``outer``, those with a smaller one into
    ``unit``. None where the dims do not make such a part (a block or K/V dimension
    given as the heads one, say)."""
    count = int(shape[heads_dim])
    if count > 1:
        unit = int(strides[heads_dim])
    else:  # a lone head's stride says nothing; the dense dims after it do
        unit = itemsize
        for d, n in enumerate(shape):
            if d > heads_dim and n > 1 and strides[d] < block_bytes:
                unit *= int(n)
    if unit < 1 or block_bytes % (count * unit):
        return None
    return block_bytes // (count * unit), count, unit


def head_pieces(local: BlockLayout, remote: BlockLayout, local_first: int,
                remote_first: int, count: int) -> tuple[np.ndarray, np.ndarray, int]:
    """Where heads ``local_first .. +count`` of a local block part and heads
    ``remote_first .. +count`` of a remote one lie, relative to the part's start: the
    pieces' local offsets, remote offsets and their common length. Raises
    ``ValueError`` saying why the two layouts cannot trade heads."""
    if local.heads is None or remote.heads is None:
        raise ValueError("the heads of a block are not known on both sides")
    (lo, lc, lu), (ro, rc, ru) = local.heads, remote.heads
    if (lo, lu) != (ro, ru) or len(local.parts) != len(remote.parts) or (
            local.dtype is not None and remote.dtype is not None
            and local.dtype != remote.dtype):
        raise ValueError(f"heads laid out differently: {lo} x heads x {lu} bytes, "
                         f"{len(local.parts)} parts, {local.dtype} here; {ro} x heads x "
                         f"{ru} bytes, {len(remote.parts)} parts, {remote.dtype} there")
    if count < 1 or local_first < 0 or remote_first < 0 or local_first + count > lc \
            or remote_first + count > rc:
        raise ValueError(f"heads {local_first}..{local_first + count} of {lc} here, "
                         f"{remote_first}..{remote_first + count} of {rc} there")
    outer = np.arange(lo, dtype=np.int64)
    return (outer * (lc * lu) + local_first * lu, outer * (rc * ru) + remote_first * ru,
            count * lu)


def _dim(d: int, ndim: int, what: str) -> int:
    if not -ndim <= d < ndim:
        raise ValueError(f"{what}={d} out of range for a {ndim}-d tensor")
    return d % ndim


def _strides(t: Any) -> tuple[int, list[int]]:
    """(element size, strides in bytes) of a torch tensor or an array with ``.strides``."""
    if not hasattr(t, "shape"):
        raise ValueError(f"cannot read strides of {type(t).__name__}: need a torch "
                         "tensor or an array with .shape")
    stride = getattr(t, "stride", None)
    if callable(stride) and hasattr(t, "element_size"):
        item = int(t.element_size())
        return item, [int(s) * item for s in stride()]
    strides = getattr(t, "strides", None)
    itemsize = getattr(t, "itemsize", None)
    if itemsize is None and hasattr(t, "dtype"):
        itemsize = getattr(t.dtype, "itemsize", None)
    if strides is None or itemsize is None:
        raise ValueError(f"cannot read strides of {type(t).__name__}: need a torch "
                         "tensor or an array with .strides and .itemsize")
    return int(itemsize), [int(s) for s in strides]


def _address(t: Any) -> int:
    if callable(getattr(t, "data_ptr", None)):
        return int(t.data_ptr())
    for attr in ("__array_interface__", "__cuda_array_interface__"):
        iface = getattr(t, attr, None)
        if iface is not None:
            return int(iface["data"][0])
    raise ValueError(f"cannot find the address of {type(t).__name__}")


def _dtype_name(t: Any) -> str | None:
    dtype = getattr(t, "dtype", None)
    if dtype is None:
        return None
    return str(dtype).removeprefix("torch.")


def vllm_gpu_layout(t: Any, *, segment_offset: int | None = None,
                    base_address: int | None = None) -> BlockLayout:
    """vLLM's GPU per-layer ``[2, num_blocks, block_size, kv_heads, head_dim]``: K and V
    are two parts."""
    if len(t.shape) < 3 or int(t.shape[0]) != 2:
        raise ValueError(f"vLLM's GPU layout is [2, num_blocks, ...], got shape "
                         f"{tuple(t.shape)}")
    return BlockLayout.from_tensor(t, block_dim=1, kv_dim=0, segment_offset=segment_offset,
                                   base_address=base_address)


def block_major_layout(t: Any, *, segment_offset: int | None = None,
                       base_address: int | None = None) -> BlockLayout:
    """``[num_blocks, ...]`` with the rest dense: one part holds all of a block."""
    if len(t.shape) < 1:
        raise ValueError("a block-major tensor needs a block dimension")
    return BlockLayout.from_tensor(t, block_dim=0, kv_dim=None,
                                   segment_offset=segment_offset, base_address=base_address)


def vllm_cpu_layout(t: Any, *, segment_offset: int | None = None,
                    base_address: int | None = None) -> BlockLayout:
    """vLLM's CPU ``[num_blocks, kv_heads, block_size, 2*head_dim]`` (block-major)."""
    return block_major_layout(t, segment_offset=segment_offset, base_address=base_address)


def _ids(block_ids: Sequence[int], what: str) -> list[int]:
    try:
        return [operator.index(b) for b in block_ids]
    except TypeError as exc:
        raise ValueError(f"{what} must be integers") from exc


def _check_range(ids: Sequence[int], num_blocks: int, what: str) -> None:
    if ids and (min(ids) < 0 or max(ids) >= num_blocks):
        bad = next(b for b in ids if not 0 <= b < num_blocks)
        raise ValueError(f"{what}: block id {bad} out of range [0, {num_blocks})")


def block_runs(block_ids: Sequence[int]) -> list[tuple[int, int]]:
    """``(first id, count)`` for each run of ids that go up by one, in order."""
    runs: list[tuple[int, int]] = []
    for b in block_ids:
        if runs and b == runs[-1][0] + runs[-1][1]:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((b, 1))
    return runs


def block_extents(layout: BlockLayout, block_ids: Sequence[int]) -> list[tuple[int, int]]:
    """``(segment offset, length)`` of the given blocks, part by part (all K extents,
    then all V extents), in the order of ``block_ids``. Runs of consecutive ids merge
    into one extent when blocks of a part are adjacent in memory."""
    ids = _ids(block_ids, "block ids")
    _check_range(ids, layout.num_blocks, "block ids")
    runs = block_runs(ids) if layout.contiguous else [(b, 1) for b in ids]
    base, stride, size = layout.segment_offset, layout.block_stride, layout.block_bytes
    return [(base + part + first * stride, count * size)
            for part in layout.parts for first, count in runs]


def pair_runs(local: Sequence[int], remote: Sequence[int]) -> list[tuple[int, int, int]]:
    """``(local first, remote first, count)`` where both id lists go up by one."""
    runs: list[tuple[int, int, int]] = []
    for lb, rb in zip(local, remote, strict=True):
        if runs:
            ls, rs, n = runs[-1]
            if lb == ls + n and rb == rs + n:
                runs[-1] = (ls, rs, n + 1)
                continue
        runs.append((lb, rb, 1))
    return runs


def _per_layer(value: Any, layers: int, what: str) -> list[Any]:
    if isinstance(value, list | tuple):
        if len(value) != layers:
            raise InvalidDescriptorError(f"{len(value)} {what} for {layers} layers")
        return list(value)
    return [value] * layers


def pairs_for_blocks(local_layouts: Sequence[BlockLayout],
                     remote_layouts: Sequence[BlockLayout],
                     local_segments: Segment | Sequence[Segment],
                     remote_segments: RemoteSegment | Sequence[RemoteSegment],
                     local_block_ids: Sequence[int],
                     remote_block_ids: Sequence[int],
                     ) -> list[tuple[Descriptor, Descriptor]]:
    """(local, remote) descriptor pairs moving local block ``local_block_ids[i]`` to (or
    from) remote block ``remote_block_ids[i]`` in every layer, ready for
    :meth:`Engine.write` / :meth:`Engine.read`.

    Layer ``l`` uses ``local_layouts[l]`` in ``local_segments[l]`` and
    ``remote_layouts[l]`` in ``remote_segments[l]`` (one segment instead of a list serves
    every layer). Blocks merge into one descriptor where they are adjacent on both
    sides. The destination's ids must be distinct (overlapping writes are undefined).

    Raises :class:`InvalidDescriptorError` (nothing built) when list lengths differ, an
    id is out of range, a layout does not fit its segment or the two layouts of a layer
    differ in block size, part count, part shape or dtype.
    """
    lsegs, rsegs, lids, rids = _checked(local_layouts, remote_layouts, local_segments,
                                        remote_segments, local_block_ids, remote_block_ids)
    if not lids:
        return []
    both = pair_runs(lids, rids)
    single = [(lb, rb, 1) for lb, rb in zip(lids, rids, strict=True)]
    out: list[tuple[Descriptor, Descriptor]] = []
    for layer, (lay, ray, lseg, rseg) in enumerate(
            zip(local_layouts, remote_layouts, lsegs, rsegs, strict=True)):
        _check_layer(layer, lay, ray, lseg, rseg, lids, rids)
        runs = both if lay.contiguous and ray.contiguous else single
        size = lay.block_bytes
        lbase, lstride = lay.segment_offset, lay.block_stride
        rbase, rstride = ray.segment_offset, ray.block_stride
        prev: tuple[Descriptor, Descriptor] | None = None
        for lb, rb, count in runs:
            for lpart, rpart in zip(lay.parts, ray.parts, strict=True):
                lo = lbase + lpart + lb * lstride
                ro = rbase + rpart + rb * rstride
                n = count * size
                # parts or blocks that happen to touch on both sides (e.g. K and V of
                # one block in [num_blocks, 2, ...]) become one descriptor
                if prev is not None and lo == prev[0].offset + prev[0].length \
                        and ro == prev[1].offset + prev[1].length:
                    n += prev[0].length
                    prev = (Descriptor(lseg, prev[0].offset, n),
                            Descriptor(rseg, prev[1].offset, n))
                    out[-1] = prev
                    continue
                prev = (Descriptor(lseg, lo, n), Descriptor(rseg, ro, n))
                out.append(prev)
    return out


def kv_blocks(local_layouts: Sequence[BlockLayout],
              remote_layouts: Sequence[BlockLayout],
              local_segments: Segment | Sequence[Segment],
              remote_segments: RemoteSegment | Sequence[RemoteSegment],
              local_block_ids: Sequence[int],
              remote_block_ids: Sequence[int]) -> list[Blocks]:
    """The pairs of :func:`pairs_for_blocks` as arrays: one :class:`Blocks` per layer and
    part (K, V), runs of blocks adjacent on both sides merged. The cheap way for many
    blocks; parts that touch (K and V of a block-major layout) are merged by the planner
    instead. Same arguments and errors as :func:`pairs_for_blocks`."""
    lsegs, rsegs, lids, rids = _checked(local_layouts, remote_layouts, local_segments,
                                        remote_segments, local_block_ids, remote_block_ids)
    if not lids:
        return []
    runs = np.array(pair_runs(lids, rids), dtype=np.int64).reshape(-1, 3)
    single = np.array([lids, rids, [1] * len(lids)], dtype=np.int64).T
    out: list[Blocks] = []
    for layer, (lay, ray, lseg, rseg) in enumerate(
            zip(local_layouts, remote_layouts, lsegs, rsegs, strict=True)):
        _check_layer(layer, lay, ray, lseg, rseg, lids, rids)
        rows = runs if lay.contiguous and ray.contiguous else single
        lb, rb, count = rows[:, 0], rows[:, 1], rows[:, 2]
        for lpart, rpart in zip(lay.parts, ray.parts, strict=True):
            out.append(Blocks(lseg, rseg, lay.segment_offset + lpart + lb * lay.block_stride,
                              ray.segment_offset + rpart + rb * ray.block_stride,
                              count * lay.block_bytes))
    return out


def _checked(local_layouts: Sequence[BlockLayout], remote_layouts: Sequence[BlockLayout],
             local_segments: Any, remote_segments: Any, local_block_ids: Sequence[int],
             remote_block_ids: Sequence[int]
             ) -> tuple[list[Any], list[Any], list[int], list[int]]:
    """Per-layer segments and the id lists, checked for matching lengths and types."""
    layers = len(local_layouts)
    if len(remote_layouts) != layers:
        raise InvalidDescriptorError(f"{layers} local layouts but {len(remote_layouts)} "
                                     "remote layouts")
    lsegs = _per_layer(local_segments, layers, "local segments")
    rsegs = _per_layer(remote_segments, layers, "remote segments")
    try:
        lids = _ids(local_block_ids, "local block ids")
        rids = _ids(remote_block_ids, "remote block ids")
    except ValueError as exc:
        raise InvalidDescriptorError(str(exc)) from exc
    if len(lids) != len(rids):
        raise InvalidDescriptorError(f"{len(lids)} local block ids but {len(rids)} remote "
                                     "block ids")
    return lsegs, rsegs, lids, rids


def _check_layer(layer: int, lay: BlockLayout, ray: BlockLayout, lseg: Any, rseg: Any,
                 lids: list[int], rids: list[int]) -> None:
    why = lay.compatible(ray)
    if why is not None:
        raise InvalidDescriptorError(f"layer {layer}: local and remote layouts differ: {why}",
                                     segment=getattr(rseg, "name", None))
    for side, layout, seg, ids in (("local", lay, lseg, lids), ("remote", ray, rseg, rids)):
        name = getattr(seg, "name", None)
        try:
            _check_range(ids, layout.num_blocks, f"layer {layer} {side}")
        except ValueError as exc:
            raise InvalidDescriptorError(str(exc), segment=name) from exc
        end = layout.segment_offset + layout.extent
        if end > seg.length:
            raise InvalidDescriptorError(
                f"layer {layer} {side}: layout ends at byte {end}, past the segment of "
                f"{seg.length} bytes", segment=name, offset=layout.segment_offset,
                length=layout.extent)
