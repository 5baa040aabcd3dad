"""SGLang's KV and aux buffers as the backend sees them: ``(address, length, bytes per
page or row)`` from ``KVArgs``, each a :class:`~transfer_engine.layout.BlockLayout` of
pages, and the same buffers of a peer as its remote segments."""

from __future__ import annotations

from typing import Any

from transfer_engine.layout import BlockLayout
from transfer_engine.peer import Peer
from transfer_engine.segment import RemoteSegment

__all__ = ["kv_buffers", "page_layout", "remote_buffers"]


def kv_buffers(args: Any, kind: str) -> list[tuple[int, int, int]]:
    """``(address, length, bytes per page or row)`` of SGLang's ``kind`` buffers."""
    ptrs = list(getattr(args, f"{kind}_data_ptrs", None) or [])
    lens = list(getattr(args, f"{kind}_data_lens", None) or [])
    items = list(getattr(args, f"{kind}_item_lens", None) or [])
    if not len(ptrs) == len(lens) == len(items):
        raise ValueError(f"KVArgs: {len(ptrs)} {kind}_data_ptrs, {len(lens)} "
                         f"{kind}_data_lens and {len(items)} {kind}_item_lens")
    out = []
    for i, (ptr, length, item) in enumerate(zip(ptrs, lens, items, strict=True)):
        if int(ptr) <= 0 or int(item) <= 0 or int(length) < int(item):
            raise ValueError(f"KVArgs: {kind} buffer {i} has address {ptr}, length {length} "
                             f"and item length {item}")
        out.append((int(ptr), int(length), int(item)))
    if kind == "kv" and not out:
        raise ValueError("KVArgs holds no KV buffers")
    return out


def page_layout(length: int, item: int) -> BlockLayout:
    """Page ``p`` of a buffer of ``item``-byte pages is bytes ``[p*item, (p+1)*item)``."""
    return BlockLayout(num_blocks=length // item, block_stride=item, block_bytes=item)


def remote_buffers(peer: Peer, kind: str, bufs: list[tuple[int, int, int]]
               ) -> list[tuple[RemoteSegment, BlockLayout]]:
    out = []
    for i, (_, _, item) in enumerate(bufs):
        seg = peer.segment(f"sglang/{kind}/{i}")
        out.append((seg, page_layout(seg.length, item)))
    return out
