"""Where a vLLM layer tensor's blocks lie (a :class:`~transfer_engine.layout.BlockLayout`
found from the tensor's strides alone), and the order a layered load reads layers in."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from transfer_engine.layout import BlockLayout, head_split

if TYPE_CHECKING:
    from transfer_engine.engine import Engine
    from transfer_engine.segment import Segment

__all__ = ["allocation", "head_range", "layer_groups", "layout_signature",
           "register_layers", "vllm_layout"]

log = logging.getLogger(__name__)


def register_layers(engine: Engine, kv_caches: dict[str, Any], num_blocks: int,
                    kv_heads: int | None) -> dict[str, tuple[Segment, BlockLayout]]:
    """Registers vLLM's layer tensors with ``engine``: each layer's segment and block
    layout. One segment per allocation, not per layer: vLLM's layers are often views of
    one tensor, and a segment that starts where the allocation starts is one a serving
    process can share in place (an interior one it reaches through a bounce copy)."""
    seen: dict[int, Segment] = {}
    out: dict[str, tuple[Segment, BlockLayout]] = {}
    for name, tensor in kv_caches.items():
        layout = vllm_layout(tuple(tensor.shape), tuple(tensor.stride()),
                             tensor.element_size(), num_blocks, str(tensor.dtype), kv_heads)
        address, length = allocation(tensor, layout.extent)
        layout = dataclasses.replace(layout, segment_offset=int(tensor.data_ptr()) - address)
        end = layout.segment_offset + layout.extent
        seg = seen.get(address)
        if seg is None or seg.length < end:
            device = str(tensor.device)  # GPU KV: staged where a transport must
            seg = engine.register((address, max(length, end),
                                   "cpu" if device == "cpu" else device), name=f"kv/{name}")
            seen[address] = seg
        out[name] = (seg, layout)
        log.debug("layer %s: shape %s strides %s -> %s", name, tuple(tensor.shape),
                  tuple(tensor.stride()), layout)
    return out


def vllm_layout(shape: Sequence[int], strides: Sequence[int], itemsize: int,
                num_blocks: int, dtype: str | None = None,
                kv_heads: int | None = None) -> BlockLayout:
    """The block layout of a KV tensor of ``shape``/``strides`` (in elements) holding
    ``num_blocks`` blocks, whatever the attention backend put where.

    The block dimension is the one of size ``num_blocks`` (when a leading dimension of
    size 2 is K/V and ``num_blocks`` is 2 too, the later one). A dimension with a larger
    stride than a block's is K/V (its entries are the layout's parts); the others are
    the block's interior, which must be dense. Raises ``ValueError`` naming what does
    not fit. With ``kv_heads`` (this worker's), the one interior dimension of that size
    is the heads one (``BlockLayout.heads``); none or several such: heads unknown.
    """
    shape, strides = [int(n) for n in shape], [int(s) for s in strides]
    if len(shape) != len(strides):
        raise ValueError(f"shape {tuple(shape)} and strides {tuple(strides)} differ in "
                         "length")
    candidates = [d for d, n in enumerate(shape) if n == num_blocks]
    if not candidates:
        raise ValueError(f"no dimension of {tuple(shape)} has {num_blocks} blocks")
    block_dim = candidates[-1] if len(candidates) > 1 and shape[0] == 2 else candidates[0]
    outer = [d for d, n in enumerate(shape)
             if d != block_dim and n > 1 and strides[d] >= strides[block_dim]]
    if len(outer) > 1:
        raise ValueError(f"tensor of shape {tuple(shape)}, strides {tuple(strides)}: "
                         f"dimensions {outer} both lie outside a block; one (K/V) can")
    byte_strides = [s * itemsize for s in strides]
    layout = BlockLayout.from_strides(shape, byte_strides, itemsize, block_dim=block_dim,
                                      kv_dim=outer[0] if outer else None, dtype=dtype)
    if kv_heads is None:
        return layout
    inside = [d for d, n in enumerate(shape) if n == kv_heads and d != block_dim
              and d not in outer and (n > 1 or d > block_dim)]
    split = (head_split(shape, byte_strides, itemsize, inside[0], layout.block_bytes)
             if len(inside) == 1 else None)
    return dataclasses.replace(layout, heads=split) if split else layout


def head_range(rank: int, tp_size: int, local: int, total: int) -> tuple[int, int] | None:
    """The model's KV heads ``(first, count)`` that tensor-parallel ``rank`` of
    ``tp_size`` holds, ``local`` of ``total``: a slice of its own, or one head shared
    with other ranks where the model has fewer heads than ranks. None where the numbers
    fit neither."""
    if local * tp_size == total:
        return rank * local, local
    if local == 1 and total < tp_size and tp_size % total == 0:
        return rank * total // tp_size, 1
    return None


def allocation(tensor: Any, extent: int) -> tuple[int, int]:
    """Start and length of the memory ``tensor`` views (its storage), or of its own
    ``extent`` bytes where it has no storage to ask."""
    try:
        storage = tensor.untyped_storage()
        start, nbytes = int(storage.data_ptr()), int(storage.nbytes())
    except (AttributeError, RuntimeError):
        return int(tensor.data_ptr()), extent
    here = int(tensor.data_ptr())
    if not (start <= here and here + extent <= start + nbytes):
        return here, extent
    return start, nbytes


def layout_signature(layout: BlockLayout) -> str:
    """What must match between two layers for their blocks to be copied byte for byte
    (the element type, a part's shape in memory order, and the number of parts), as a
    string both sides put in their compatibility hash."""
    if layout.heads is not None:  # any count of heads: peers may hold others
        outer, _, unit = layout.heads
        return f"{layout.dtype}[{outer}xheadsx{unit}B]x{len(layout.parts)}"
    shape = "x".join(str(n) for _, n in layout.part_shape or ())
    return f"{layout.dtype}[{shape}]x{len(layout.parts)}"


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
