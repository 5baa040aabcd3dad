"""Paged-KV layouts: descriptors checked by gathering real bytes through them."""

from __future__ import annotations

import ctypes
import dataclasses
import random
from typing import Any

import msgpack
import numpy as np
import pytest

from transfer_engine.descriptor import Descriptor
from transfer_engine.errors import InvalidDescriptorError
from transfer_engine.layout import (
    BlockLayout,
    block_extents,
    block_major_layout,
    block_runs,
    head_pieces,
    head_split,
    kv_blocks,
    pair_runs,
    pairs_for_blocks,
    vllm_cpu_layout,
    vllm_gpu_layout,
)
from transfer_engine.planner import coalesce
from transfer_engine.segment import RemoteSegment, Segment, describe_memory

torch = pytest.importorskip("torch")

BS, HEADS, DIM = 4, 2, 8  # block_size, kv_heads, head_dim: small, so tests stay fast


def address(t: Any) -> int:
    return int(t.data_ptr()) if hasattr(t, "data_ptr") else int(t.ctypes.data)


def raw(t: Any) -> bytes:
    """The bytes of a tensor's elements in C order (a copy)."""
    if isinstance(t, np.ndarray):
        return np.ascontiguousarray(t).tobytes()
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def gather(base: int, extents: list[tuple[int, int]]) -> bytes:
    return b"".join(ctypes.string_at(base + off, n) for off, n in extents)


def filled_torch(*shape: int, dtype: Any = torch.bfloat16, seed: int = 0) -> Any:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen).to(dtype)


def filled_numpy(*shape: int, dtype: Any = np.float16, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


# --- layouts from tensors ------------------------------------------------------------


def test_vllm_gpu_layout_of_a_torch_tensor_gathers_each_block() -> None:
    t = filled_torch(2, 10, BS, HEADS, DIM)
    lay = vllm_gpu_layout(t)
    part = BS * HEADS * DIM * 2
    assert lay == BlockLayout(10, part, part, (0, 10 * part), 0,
                              ((0, BS), (1, HEADS), (2, DIM)), "bfloat16")
    assert lay.contiguous and lay.nbytes == 2 * part and lay.extent == t.nbytes
    for b in range(10):
        assert gather(address(t), block_extents(lay, [b])) == raw(t[0, b]) + raw(t[1, b])
        assert lay.offset(b, 1) == 10 * part + b * part


def test_vllm_gpu_layout_of_a_numpy_array() -> None:
    a = filled_numpy(2, 7, BS, HEADS, DIM)
    lay = vllm_gpu_layout(a)
    assert lay.dtype == "float16" and lay.parts == (0, 7 * BS * HEADS * DIM * 2)
    for b in range(7):
        assert gather(address(a), block_extents(lay, [b])) == raw(a[0, b]) + raw(a[1, b])


@pytest.mark.parametrize("lib", ["torch", "numpy"])
def test_vllm_cpu_layout_is_one_part_per_block(lib: str) -> None:
    shape = (9, HEADS, BS, 2 * DIM)
    t = filled_torch(*shape, dtype=torch.float32) if lib == "torch" else filled_numpy(*shape)
    lay = vllm_cpu_layout(t)
    assert len(lay.parts) == 1 and lay.block_bytes == t[0].nbytes == lay.block_stride
    for b in range(9):
        assert gather(address(t), block_extents(lay, [b])) == raw(t[b])


def test_gpu_view_of_a_block_major_allocation_takes_strides_from_the_tensor() -> None:
    # vLLM may allocate [num_blocks, 2, ...] and hand out a [2, num_blocks, ...] view
    base = filled_torch(6, 2, BS, HEADS, DIM)
    t = base.permute(1, 0, 2, 3, 4)
    lay = vllm_gpu_layout(t)
    part = BS * HEADS * DIM * 2
    assert (lay.block_stride, lay.block_bytes, lay.parts) == (2 * part, part, (0, part))
    assert not lay.contiguous
    assert len(block_extents(lay, [1, 2, 3])) == 6  # blocks of a part are not adjacent
    for b in range(6):
        assert gather(address(t), block_extents(lay, [b])) == raw(t[0, b]) + raw(t[1, b])


def test_interior_dims_may_be_permuted_when_dense_and_the_order_is_recorded() -> None:
    base = filled_torch(2, 5, HEADS, BS, DIM)  # HND in memory
    t = base.permute(0, 1, 3, 2, 4)  # logical [2, N, block_size, heads, dim]
    lay = vllm_gpu_layout(t)
    assert lay.part_shape == ((1, HEADS), (0, BS), (2, DIM))
    assert lay.compatible(vllm_gpu_layout(filled_torch(2, 5, BS, HEADS, DIM))) is not None
    for b in range(5):  # memory holds the HND order
        got = gather(address(t), block_extents(lay, [b]))
        assert got == raw(base[0, b]) + raw(base[1, b])


def test_base_address_gives_the_offset_of_a_layer_in_a_shared_buffer() -> None:
    big = filled_torch(3, 2, 4, BS, HEADS, DIM)  # [layers, 2, N, ...] in one buffer
    for layer in range(3):
        lay = vllm_gpu_layout(big[layer], base_address=address(big))
        assert lay.segment_offset == layer * big[0].nbytes
        for b in range(4):
            ext = block_extents(lay, [b])
            assert gather(address(big), ext) == raw(big[layer, 0, b]) + raw(big[layer, 1, b])
    with pytest.raises(ValueError, match="before the segment"):
        vllm_gpu_layout(big[0], base_address=address(big[1]))
    assert vllm_gpu_layout(big[2], segment_offset=5).segment_offset == 5


def test_flashinfer_layout_has_interleaved_parts() -> None:
    t = filled_torch(5, 2, BS, HEADS, DIM)
    lay = BlockLayout.from_tensor(t, block_dim=0, kv_dim=1)
    part = BS * HEADS * DIM * 2
    assert (lay.block_stride, lay.parts) == (2 * part, (0, part))
    for b in range(5):
        assert gather(address(t), block_extents(lay, [b])) == raw(t[b, 0]) + raw(t[b, 1])


def test_single_block_tensor_and_size_one_dims() -> None:
    t = filled_torch(2, 1, BS, 1, DIM)
    lay = vllm_gpu_layout(t)
    assert lay.num_blocks == 1 and lay.block_stride == lay.block_bytes == BS * DIM * 2
    assert gather(address(t), block_extents(lay, [0])) == raw(t[0, 0]) + raw(t[1, 0])
    one = BlockLayout.from_tensor(filled_torch(1, 4, BS, DIM), block_dim=1, kv_dim=0)
    assert one.parts == (0,)


@pytest.mark.parametrize("make", [
    lambda t: t.permute(0, 2, 1, 3, 4),  # the block dim moved inside a block
    lambda t: t[..., :4],  # head_dim sliced: rows have gaps
    lambda t: t[:, :, ::2],  # every other token
], ids=["block-inside", "sliced-dim", "strided-tokens"])
def test_non_contiguous_parts_are_rejected(make: Any) -> None:
    t = make(filled_torch(2, 6, BS, HEADS, DIM))
    with pytest.raises(ValueError, match="not contiguous"):
        BlockLayout.from_tensor(t, block_dim=1, kv_dim=0)


def test_bad_tensors_and_dims_are_rejected() -> None:
    t = filled_torch(2, 6, BS, HEADS, DIM)
    with pytest.raises(ValueError, match="negative strides"):
        vllm_gpu_layout(filled_numpy(2, 6, BS, HEADS, DIM)[:, ::-1])
    with pytest.raises(ValueError, match="overlap"):  # broadcast: every block is block 0
        vllm_gpu_layout(t[:, :1].expand(2, 6, BS, HEADS, DIM))
    with pytest.raises(ValueError, match=r"\[2, num_blocks"):
        vllm_gpu_layout(filled_torch(3, 6, BS))
    with pytest.raises(ValueError, match="empty"):
        vllm_gpu_layout(filled_torch(2, 0, BS, HEADS, DIM))
    with pytest.raises(ValueError, match="same dimension"):
        BlockLayout.from_tensor(t, block_dim=1, kv_dim=1)
    with pytest.raises(ValueError, match="out of range"):
        BlockLayout.from_tensor(t, block_dim=5, kv_dim=0)
    with pytest.raises(ValueError, match="cannot read strides"):
        BlockLayout.from_tensor(object(), block_dim=0)
    with pytest.raises(ValueError, match="block dimension"):
        block_major_layout(np.float32(1.0))
    with pytest.raises(ValueError, match="differ in length"):
        BlockLayout.from_strides((2, 3), (4,), 4, block_dim=0)
    assert BlockLayout.from_tensor(t, block_dim=-4, kv_dim=-5) == vllm_gpu_layout(t)


# --- explicit layouts ----------------------------------------------------------------


def test_explicit_layouts_are_validated() -> None:
    with pytest.raises(ValueError, match="at least one block"):
        BlockLayout(0, 64, 64)
    with pytest.raises(ValueError, match="block_bytes"):
        BlockLayout(4, 64, 0)
    with pytest.raises(ValueError, match="blocks overlap"):
        BlockLayout(4, 32, 64)
    with pytest.raises(ValueError, match="parts"):
        BlockLayout(4, 64, 64, ())
    with pytest.raises(ValueError, match="segment_offset"):
        BlockLayout(4, 64, 64, (0,), -1)
    with pytest.raises(ValueError, match="overlap"):
        BlockLayout(4, 64, 64, (0, 4 * 64 - 1))  # V of block 0 inside K of block 3
    with pytest.raises(ValueError, match="overlap"):
        BlockLayout(4, 64, 64, (0, 0))
    BlockLayout(4, 64, 64, (0, 4 * 64))  # V right after the last K
    BlockLayout(4, 128, 64, (0, 64))  # interleaved K and V
    BlockLayout(1, 0, 64, (0, 64))


def test_part_overlap_check_matches_brute_force() -> None:
    rng = random.Random(7)
    for _ in range(2000):
        n, size = rng.randint(1, 6), rng.randint(1, 8)
        stride = rng.randint(size if n > 1 else 0, 3 * size)
        parts = tuple(rng.randint(0, n * stride + 2 * size) for _ in range(rng.randint(1, 3)))
        cells: set[int] = set()
        clash = False
        for p in parts:
            for b in range(n):
                span = set(range(p + b * stride, p + b * stride + size))
                clash |= bool(cells & span)
                cells |= span
        if clash:
            with pytest.raises(ValueError, match="overlap"):
                BlockLayout(n, stride, size, parts)
        else:
            BlockLayout(n, stride, size, parts)


def test_wire_round_trip() -> None:
    for lay in (vllm_gpu_layout(filled_torch(2, 6, BS, HEADS, DIM)),
                BlockLayout(4, 64, 64, (0, 256), 128)):
        assert BlockLayout.from_wire(msgpack.unpackb(msgpack.packb(lay.to_wire()))) == lay


# --- block extents -------------------------------------------------------------------


def test_block_runs() -> None:
    assert block_runs([]) == []
    assert block_runs([3, 4, 5, 9, 10, 2, 3]) == [(3, 3), (9, 2), (2, 2)]
    assert block_runs([5, 4]) == [(5, 1), (4, 1)]


def test_extents_coalesce_runs_of_consecutive_blocks() -> None:
    t = filled_torch(2, 12, BS, HEADS, DIM)
    lay = vllm_gpu_layout(t)
    part = lay.block_bytes
    ext = block_extents(lay, [3, 4, 5, 9])
    assert ext == [(3 * part, 3 * part), (9 * part, part),
                   (12 * part + 3 * part, 3 * part), (12 * part + 9 * part, part)]
    want = b"".join(raw(t[kv, b]) for kv in (0, 1) for b in (3, 4, 5, 9))
    assert gather(address(t), ext) == want
    assert block_extents(lay, []) == []
    assert len(block_extents(lay, [5, 4, 3])) == 6  # descending ids do not merge


def test_extents_reject_bad_ids() -> None:
    lay = BlockLayout(4, 64, 64)
    with pytest.raises(ValueError, match="block id 4 out of range"):
        block_extents(lay, [0, 4])
    with pytest.raises(ValueError, match="block id -1"):
        block_extents(lay, [-1])
    with pytest.raises(ValueError, match="integers"):
        block_extents(lay, [1.0])  # type: ignore[list-item]
    assert block_extents(lay, [np.int64(2)]) == [(128, 64)]


# --- pairs for a transfer ------------------------------------------------------------


class Memory:
    """Tensors as local segments and as a peer's remote segments, and a copy that does
    what ``Engine.write`` would with the pairs."""

    def __init__(self) -> None:
        self.bases: dict[int, int] = {}
        self.segments: list[Segment] = []

    def local(self, t: Any) -> Segment:
        seg = Segment(len(self.bases) + 1, f"l{len(self.bases)}", describe_memory(t))
        self.segments.append(seg)
        self.bases[id(seg)] = seg.address
        return seg

    def remote(self, t: Any) -> RemoteSegment:
        seg = RemoteSegment("peer", len(self.bases) + 1, f"r{len(self.bases)}", t.nbytes)
        self.bases[id(seg)] = address(t)
        return seg

    def write(self, pairs: list[tuple[Descriptor, Descriptor]]) -> None:
        for loc, rem in pairs:
            assert loc.length == rem.length > 0
            assert 0 <= loc.offset and loc.offset + loc.length <= loc.segment.length
            assert 0 <= rem.offset and rem.offset + rem.length <= rem.segment.length
            ctypes.memmove(self.bases[id(rem.segment)] + rem.offset,
                           self.bases[id(loc.segment)] + loc.offset, loc.length)

    def close(self) -> None:
        for seg in self.segments:
            seg.close()


@pytest.fixture
def memory() -> Any:
    mem = Memory()
    yield mem
    mem.close()


def test_pairs_move_blocks_between_layouts_of_different_sizes(memory: Memory) -> None:
    layers = 3
    src = [filled_torch(2, 12, BS, HEADS, DIM, seed=i) for i in range(layers)]
    dst = [torch.zeros(2, 20, BS, HEADS, DIM, dtype=torch.bfloat16) for _ in range(layers)]
    lids, rids = [0, 1, 2, 7, 9], [5, 6, 7, 8, 3]
    pairs = pairs_for_blocks([vllm_gpu_layout(t) for t in src],
                             [vllm_gpu_layout(t) for t in dst],
                             [memory.local(t) for t in src],
                             [memory.remote(t) for t in dst], lids, rids)
    # runs (0->5, 3 blocks), (7->8), (9->3); two parts each, every layer
    assert len(pairs) == layers * 3 * 2
    part = BS * HEADS * DIM * 2
    assert [p[0].length for p in pairs[:6]] == [3 * part, 3 * part, part, part, part, part]
    memory.write(pairs)
    for s, d in zip(src, dst, strict=True):
        for lb, rb in zip(lids, rids, strict=True):
            assert torch.equal(d[:, rb], s[:, lb])
        untouched = [b for b in range(20) if b not in rids]
        assert not d[:, untouched].any()


def test_runs_merge_only_when_consecutive_on_both_sides(memory: Memory) -> None:
    lay = BlockLayout(10, 64, 64)
    src, dst = torch.zeros(640, dtype=torch.uint8), torch.zeros(640, dtype=torch.uint8)
    pairs = pairs_for_blocks([lay], [lay], memory.local(src), memory.remote(dst),
                             [1, 2, 3, 5], [4, 6, 7, 8])
    assert [(p[0].offset, p[1].offset, p[0].length) for p in pairs] == [
        (64, 256, 64), (128, 384, 128), (320, 512, 64)]


def test_flashinfer_blocks_become_one_descriptor_per_run(memory: Memory) -> None:
    src = filled_torch(8, 2, BS, HEADS, DIM)
    dst = torch.zeros(8, 2, BS, HEADS, DIM, dtype=torch.bfloat16)
    lay = BlockLayout.from_tensor(src, block_dim=0, kv_dim=1)
    pairs = pairs_for_blocks([lay], [lay], memory.local(src), memory.remote(dst),
                             [3, 4, 5, 0], [1, 2, 3, 7])
    assert [(p[0].offset, p[1].offset, p[0].length) for p in pairs] == [
        (3 * lay.nbytes, lay.nbytes, 3 * lay.nbytes), (0, 7 * lay.nbytes, lay.nbytes)]
    memory.write(pairs)
    for lb, rb in ((3, 1), (4, 2), (5, 3), (0, 7)):
        assert torch.equal(dst[rb], src[lb])


def test_mixed_layouts_pair_k_with_k_and_v_with_v(memory: Memory) -> None:
    src = filled_torch(6, 2, BS, HEADS, DIM)  # block-major, K and V interleaved
    dst_alloc = torch.zeros(2, 9, BS, HEADS, DIM, dtype=torch.bfloat16)
    pairs = pairs_for_blocks([BlockLayout.from_tensor(src, block_dim=0, kv_dim=1)],
                             [vllm_gpu_layout(dst_alloc)], [memory.local(src)],
                             [memory.remote(dst_alloc)], [0, 1, 5], [8, 2, 3])
    memory.write(pairs)
    for lb, rb in ((0, 8), (1, 2), (5, 3)):
        assert torch.equal(dst_alloc[:, rb], src[lb])


def test_layers_in_one_shared_segment(memory: Memory) -> None:
    src = filled_torch(4, 2, 6, BS, HEADS, DIM)
    dst = torch.zeros(4, 2, 6, BS, HEADS, DIM, dtype=torch.bfloat16)
    llays = [vllm_gpu_layout(src[i], base_address=address(src)) for i in range(4)]
    rlays = [vllm_gpu_layout(dst[i], base_address=address(dst)) for i in range(4)]
    pairs = pairs_for_blocks(llays, rlays, memory.local(src), memory.remote(dst),
                             [2, 3], [4, 5])
    assert len(pairs) == 4 * 2
    memory.write(pairs)
    assert torch.equal(dst[:, :, 4:6], src[:, :, 2:4])
    assert not dst[:, :, :4].any()


def test_numpy_layouts_round_trip(memory: Memory) -> None:
    src = filled_numpy(12, HEADS, BS, 2 * DIM, seed=3)
    dst = np.zeros_like(src)
    ids = [11, 0, 1, 2, 6]
    pairs = pairs_for_blocks([vllm_cpu_layout(src)], [vllm_cpu_layout(dst)],
                             [memory.local(src)], [memory.remote(dst)], ids, ids)
    assert len(pairs) == 3
    memory.write(pairs)
    assert np.array_equal(dst[ids], src[ids])
    assert not dst[[3, 4, 5, 7, 8, 9, 10]].any()


def test_random_layouts_and_ids_move_exactly_the_chosen_blocks(memory: Memory) -> None:
    rng = random.Random(11)
    kinds = ["gpu", "gpu-view", "flashinfer"]  # all: 2 parts of [BS, HEADS, DIM]

    def make(kind: str, n: int, fill: bool, seed: int) -> tuple[Any, BlockLayout]:
        alloc = (filled_torch if fill else lambda *s, **_: torch.zeros(
            *s, dtype=torch.bfloat16))
        if kind == "gpu":
            t = alloc(2, n, BS, HEADS, DIM, seed=seed)
            return t, vllm_gpu_layout(t)
        t = alloc(n, 2, BS, HEADS, DIM, seed=seed)
        if kind == "gpu-view":
            return t, vllm_gpu_layout(t.permute(1, 0, 2, 3, 4))
        return t, BlockLayout.from_tensor(t, block_dim=0, kv_dim=1)

    def block(t: Any, lay: BlockLayout, b: int) -> bytes:
        return gather(address(t), [(lay.offset(b, p), lay.block_bytes)
                                   for p in range(len(lay.parts))])

    for trial in range(60):
        nl, nr = rng.randint(1, 24), rng.randint(1, 24)
        count = rng.randint(0, min(nl, nr))
        lids = [rng.randrange(nl) for _ in range(count)]  # sources may repeat
        if rng.random() < 0.5:
            start = rng.randrange(nr - count + 1)
            rids = list(range(start, start + count))
        else:
            rids = rng.sample(range(nr), count)
        src, lay_l = make(rng.choice(kinds), nl, True, trial)
        dst, lay_r = make(rng.choice(kinds), nr, False, trial)
        lseg, rseg = memory.local(src), memory.remote(dst)
        pairs = pairs_for_blocks([lay_l], [lay_r], lseg, rseg, lids, rids)
        assert sum(p[0].length for p in pairs) == count * lay_l.nbytes
        # the same pairs as arrays: once merged where they touch, equal
        as_blocks = [p for b in kv_blocks([lay_l], [lay_r], lseg, rseg, lids, rids)
                     for p in b]
        assert _merged(as_blocks) == _merged(pairs)
        memory.write(pairs)
        for lb, rb in zip(lids, rids, strict=True):
            assert block(dst, lay_r, rb) == block(src, lay_l, lb)
        zero = bytes(lay_r.nbytes)
        assert all(block(dst, lay_r, b) == zero for b in range(nr) if b not in rids)


def _merged(pairs: list[tuple[Descriptor, Descriptor]]) -> list[Any]:
    return coalesce([((loc.segment.id, loc.offset, loc.length),
                      (rem.segment.id, rem.offset, rem.length)) for loc, rem in pairs])


def test_kv_blocks_move_the_blocks(memory: Memory) -> None:
    src = filled_torch(6, 2, BS, HEADS, DIM)  # block-major: K and V of a block touch
    dst = torch.zeros(2, 9, BS, HEADS, DIM, dtype=torch.bfloat16)
    blocks = kv_blocks([BlockLayout.from_tensor(src, block_dim=0, kv_dim=1)],
                       [vllm_gpu_layout(dst)], memory.local(src), memory.remote(dst),
                       [0, 1, 5], [2, 3, 8])
    assert [len(b) for b in blocks] == [3, 3]  # K, V: a part's blocks are not adjacent
    memory.write([p for b in blocks for p in b])
    for lb, rb in ((0, 2), (1, 3), (5, 8)):
        assert torch.equal(dst[:, rb], src[lb])


@pytest.mark.parametrize("build", [pairs_for_blocks, kv_blocks])
def test_pairs_reject_bad_requests_before_building_anything(memory: Memory,
                                                            build: Any) -> None:
    t = filled_torch(2, 6, BS, HEADS, DIM)
    lay = vllm_gpu_layout(t)
    lseg, rseg = memory.local(t), memory.remote(t)

    def bad(match: str, *args: Any) -> InvalidDescriptorError:
        with pytest.raises(InvalidDescriptorError, match=match) as info:
            build(*args)
        return info.value

    bad("1 local layouts but 2 remote", [lay], [lay, lay], lseg, rseg, [0], [0])
    bad("2 local segments for 1 layers", [lay], [lay], [lseg, lseg], rseg, [0], [0])
    bad("1 remote segments for 2 layers", [lay, lay], [lay, lay], lseg, [rseg], [0], [0])
    bad("2 local block ids but 1 remote", [lay], [lay], lseg, rseg, [0, 1], [0])
    bad("integers", [lay], [lay], lseg, rseg, ["0"], [0])
    err = bad("layer 0 remote: block id 6 out of range", [lay], [lay], lseg, rseg, [0], [6])
    assert err.segment == rseg.name
    short = BlockLayout(3, lay.block_stride, lay.block_bytes, lay.parts)
    err = bad("layer 1 local: block id 5 out of range", [lay, short], [lay, lay], lseg,
              rseg, [0, 5], [0, 1])
    assert err.segment == lseg.name
    err = bad("layer 0 local: block id -1", [lay], [lay], lseg, rseg, [-1], [0])
    assert err.segment == lseg.name
    cpu = vllm_cpu_layout(filled_torch(6, HEADS, BS, 2 * DIM))
    bad("block_bytes", [lay], [cpu], lseg, rseg, [0], [0])
    half = BlockLayout(6, lay.block_bytes, lay.block_bytes, (0,))
    bad("2 parts != 1 parts", [lay], [half], lseg, rseg, [0], [0])
    f16 = vllm_gpu_layout(filled_torch(2, 6, BS, HEADS, DIM, dtype=torch.float16))
    bad("dtype bfloat16 != float16", [lay], [f16], lseg, rseg, [0], [0])
    hnd = vllm_gpu_layout(filled_torch(2, 6, HEADS, BS, DIM).permute(0, 1, 3, 2, 4))
    bad("part shape", [lay], [hnd], lseg, rseg, [0], [0])
    shifted = BlockLayout(6, lay.block_stride, lay.block_bytes, lay.parts, 16)
    err = bad("past the segment", [lay], [shifted], lseg, rseg, [0], [0])
    assert (err.segment, err.offset, err.length) == (rseg.name, 16, lay.extent)
    assert build([lay], [lay], lseg, rseg, [], []) == []
    assert build([], [], [], [], [1], [2]) == []


def test_pair_runs_merge_ids_that_go_up_together() -> None:
    assert pair_runs([], []) == []
    assert pair_runs([4, 5, 6, 9], [1, 2, 3, 4]) == [(4, 1, 3), (9, 4, 1)]
    assert pair_runs([1, 2, 3], [7, 9, 10]) == [(1, 7, 1), (2, 9, 2)]  # remote jumps
    with pytest.raises(ValueError):
        pair_runs([1, 2], [1])


def _with_heads(a: np.ndarray, block_dim: int, kv_dim: int | None, heads_dim: int
                ) -> BlockLayout:
    lay = BlockLayout.from_strides(a.shape, a.strides, a.itemsize, block_dim=block_dim,
                                   kv_dim=kv_dim, dtype=str(a.dtype))
    split = head_split(a.shape, a.strides, a.itemsize, heads_dim, lay.block_bytes)
    assert split is not None
    return dataclasses.replace(lay, heads=split)


@pytest.mark.parametrize("shape,block_dim,kv_dim,heads_dim", [
    ((2, 10, 16, 4, 8), 1, 0, 3),  # vLLM's GPU layout: a head is a piece per token
    ((10, 4, 16, 16), 0, None, 1),  # its CPU layout: a head is one run per block
], ids=["gpu-layout", "cpu-layout"])
def test_head_pieces_read_a_slice_of_another_ranks_heads(
        shape: tuple[int, ...], block_dim: int, kv_dim: int | None, heads_dim: int) -> None:
    """A rank holding heads first..first+count of a block takes exactly those out of
    a peer's block holding all of them: byte-for-byte what slicing the tensor gives."""
    full = np.random.default_rng(3).standard_normal(shape).astype(np.float32)
    big = _with_heads(full, block_dim, kv_dim, heads_dim)
    src = full.view(np.uint8).reshape(-1)
    for first, count in ((0, 2), (2, 2), (1, 1), (3, 1), (0, 4)):
        want = np.ascontiguousarray(np.take(full, range(first, first + count),
                                            axis=heads_dim))
        got = np.full_like(want, np.nan)
        small = _with_heads(got, block_dim, kv_dim, heads_dim)
        loffs, roffs, n = head_pieces(small, big, 0, first, count)
        dst = got.view(np.uint8).reshape(-1)
        for b in range(small.num_blocks):
            for p in range(len(small.parts)):
                lb, rb = small.offset(b, p), big.offset(b, p)
                for lo, ro in zip(loffs.tolist(), roffs.tolist(), strict=True):
                    dst[lb + lo:lb + lo + n] = src[rb + ro:rb + ro + n]
        assert np.array_equal(got, want)


def test_head_pieces_refuse_what_does_not_line_up() -> None:
    a = np.zeros((2, 10, 16, 4, 8), dtype=np.float32)
    big = _with_heads(a, 1, 0, 3)
    small = _with_heads(np.zeros((2, 10, 16, 2, 8), dtype=np.float32), 1, 0, 3)
    with pytest.raises(ValueError, match="heads 0..2 of 2 here, 3..5 of 4 there"):
        head_pieces(small, big, 0, 3, 2)
    other_dim = _with_heads(np.zeros((2, 10, 16, 2, 4), dtype=np.float32), 1, 0, 3)
    with pytest.raises(ValueError, match="laid out differently"):
        head_pieces(other_dim, big, 0, 0, 2)
    with pytest.raises(ValueError, match="not known"):
        head_pieces(dataclasses.replace(small, heads=None), big, 0, 0, 2)
    with pytest.raises(ValueError, match="do not make a part"):
        dataclasses.replace(small, heads=(16, 3, 32))
    assert BlockLayout.from_wire(big.to_wire()) == big
