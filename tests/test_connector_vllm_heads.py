"""Tensor-parallel ranks of different sizes, through the vLLM connector's workers: decode
ranks read their own KV heads out of the blocks of a prefill rank holding more, or out
of the blocks of every prefill rank holding some of them (vLLM's GPU and CPU layouts),
prefill frees the blocks once every reader said so, and heads nobody can place are not
read. Workers in this process, real engines on loopback, KV
caches as CPU torch tensors (as in ``test_connector_vllm.py``)."""

from __future__ import annotations

import time
import warnings
from typing import Any

import pytest

from tests.helpers.clock import FakeClock
from tests.helpers.vllm_required import vllm_torch

with warnings.catch_warnings():  # vLLM and torch warn at import; not our concern here
    warnings.simplefilter("ignore")
    torch = vllm_torch()

    from tests.helpers.vllm_workers import COMPAT, NUM_BLOCKS, spec, wait_results
    from transfer_engine.connectors.vllm import RecvSpec, TEConnectorConfig, TEConnectorWorker

pytestmark = pytest.mark.filterwarnings(
    "ignore::DeprecationWarning", "ignore::FutureWarning")


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


def _heads_caches(layout: str, seed: int, heads: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)
    shape = ((2, NUM_BLOCKS, 16, heads, 8) if layout == "gpu"
             else (NUM_BLOCKS, heads, 16, 2 * 8))
    return {f"layers.{i}.attn": torch.randn(*shape, generator=gen) for i in range(3)}


def _heads_of(t: Any, b: int, first: int, count: int) -> Any:
    return (t[:, b, :, first:first + count] if t.shape[0] == 2
            else t[b, first:first + count])


@pytest.mark.parametrize("layout", ["gpu", "cpu"])
def test_decode_ranks_read_their_heads_out_of_a_prefill_rank_holding_more(
        layout: str, clock: FakeClock) -> None:
    """Prefill at tensor-parallel size 1 (all four KV heads), decode at 2 (two heads a
    rank): each decode rank reads its own heads' slice of the same prefill blocks, and
    prefill frees them only once both ranks said they had read them."""
    cfg = TEConnectorConfig(transports=("tcp",), timeout_s=2.0)
    prefill = TEConnectorWorker("p-tp1", cfg, COMPAT, clock, kv_heads=(4, 4))
    ranks = [TEConnectorWorker(f"d-tp2-{r}", cfg, COMPAT, clock, rank=r, tp_size=2,
                               kv_heads=(2, 4)) for r in (0, 1)]
    try:
        pk = _heads_caches(layout, 1, 4)
        prefill.register_kv_caches(pk, NUM_BLOCKS)
        dks = [_heads_caches(layout, 2 + r, 2) for r in (0, 1)]
        for worker, dk in zip(ranks, dks, strict=True):
            worker.register_kv_caches(dk, NUM_BLOCKS)
        assert prefill.engine is not None
        remote, local = [3, 4, 5, 20], [40, 41, 7, 8]
        prefill.hold({"r": 30.0})
        for r, worker in enumerate(ranks):
            worker.start_load([RecvSpec("r", local, remote, prefill.engine.endpoint, "p",
                                        "r", remote_endpoints=(prefill.engine.endpoint,),
                                        decode_tp=2)])
            assert not wait_results(worker, "finished_recving", "r").failed_recving
            for name in pk:
                for lb, rb in zip(local, remote, strict=True):
                    assert torch.equal(_heads_of(dks[r][name], lb, 0, 2),
                                       _heads_of(pk[name], rb, 2 * r, 2))
            time.sleep(0.2)
            freed = prefill.results().finished_sending
            assert freed == (set() if r == 0 else {"r"}), (r, freed)
    finally:
        for worker in ranks:
            worker.close()
        prefill.close()


@pytest.mark.parametrize("sync", [False, True])
@pytest.mark.parametrize("layout", ["gpu", "cpu"])
def test_a_decode_rank_reads_its_heads_from_every_prefill_rank_holding_them(
        layout: str, sync: bool, clock: FakeClock) -> None:
    """Prefill at tensor-parallel size 2 (two KV heads a rank), decode at 1 (all four):
    the decode rank reads heads 0..2 from prefill rank 0 and heads 2..4 from rank 1 into
    the same blocks, byte for byte, and each prefill rank frees its blocks once its one
    reader said so. A load naming a prefill rank that is not there fails (recomputed)
    and writes nothing; one whose second rank died fails, the first rank's blocks
    freed."""
    cfg = TEConnectorConfig(transports=("tcp",), timeout_s=2.0)
    pre = [TEConnectorWorker(f"p-tp2-{r}", cfg, COMPAT, clock, rank=r, tp_size=2,
                             kv_heads=(2, 4)) for r in (0, 1)]
    decode = TEConnectorWorker("d-tp1", cfg, COMPAT, clock, kv_heads=(4, 4))
    try:
        pks = [_heads_caches(layout, 1 + r, 2) for r in (0, 1)]
        for worker, pk in zip(pre, pks, strict=True):
            worker.register_kv_caches(pk, NUM_BLOCKS)
        dk = _heads_caches(layout, 5, 4)
        decode.register_kv_caches(dk, NUM_BLOCKS)
        ends = tuple(w.engine.endpoint for w in pre if w.engine is not None)
        remote, local = [3, 4, 5, 20], [40, 41, 7, 8]
        for w in pre:
            w.hold({"m": 30.0})
        load = RecvSpec("m", local, remote, ends[0], "p", "m", sync=sync,
                        remote_endpoints=ends, decode_tp=1)
        if sync:
            decode.load_now([load])
            assert decode.take_failed_blocks() == set()
        else:
            decode.start_load([load])
            assert not wait_results(decode, "finished_recving", "m").failed_recving
        for name in dk:
            for lb, rb in zip(local, remote, strict=True):
                for r in (0, 1):
                    assert torch.equal(_heads_of(dk[name], lb, 2 * r, 2),
                                       _heads_of(pks[r][name], rb, 0, 2))
        for w in pre:
            wait_results(w, "finished_sending", "m")
        # a load naming a dead second rank fails before it reads anything
        before = {n: t.clone() for n, t in dk.items()}
        gone = (ends[0], "tcp://127.0.0.1:9")  # nothing listens on the discard port
        pre[0].hold({"n": 30.0})
        decode.start_load([RecvSpec("n", [50], [6], ends[0], "p", "n",
                                    remote_endpoints=gone, decode_tp=1)])
        assert wait_results(decode, "finished_recving", "n").failed_recving == {"n"}
        assert all(torch.equal(_heads_of(before[n], 50, 0, 4), _heads_of(dk[n], 50, 0, 4))
                   for n in dk)
        # the second rank dies after the connections were made: its READ fails, so
        # the load does (recomputed), while the first rank's READ lands and frees its
        # blocks
        pre[0].hold({"k": 30.0})
        pre[1].close()
        decode.start_load([RecvSpec("k", [60], [9], ends[0], "p", "k",
                                    remote_endpoints=ends, decode_tp=1)])
        assert wait_results(decode, "finished_recving", "k").failed_recving == {"k"}
        wait_results(pre[0], "finished_sending", "k")
    finally:
        decode.close()
        for w in pre:
            w.close()


def test_heads_nobody_can_place_are_not_read(clock: FakeClock,
                                            caplog: pytest.LogCaptureFixture) -> None:
    """A decode rank of another tensor-parallel size whose peer does not say which KV
    heads it holds (or holds other ones) loads nothing: recomputed, saying why."""
    cfg = TEConnectorConfig(transports=("tcp",), timeout_s=2.0)
    prefill = TEConnectorWorker("p-unknown", cfg, COMPAT, clock)  # heads not known
    other = TEConnectorWorker("p-other", cfg, COMPAT, clock, rank=1, tp_size=2,
                              kv_heads=(2, 4))  # heads 2..4
    decode = TEConnectorWorker("d-r0", cfg, COMPAT, clock, rank=0, tp_size=2,
                               kv_heads=(2, 4))  # wants heads 0..2
    try:
        prefill.register_kv_caches(_heads_caches("gpu", 1, 4), NUM_BLOCKS)
        other.register_kv_caches(_heads_caches("gpu", 3, 2), NUM_BLOCKS)
        decode.register_kv_caches(_heads_caches("gpu", 2, 2), NUM_BLOCKS)
        decode.start_load([spec(prefill, "a", [1], [1])])
        assert wait_results(decode, "finished_recving", "a").failed_recving == {"a"}
        assert "incompatible KV caches" in caplog.text  # its layouts name 4 heads
        decode.start_load([spec(other, "b", [2], [2])])
        assert wait_results(decode, "finished_recving", "b").failed_recving == {"b"}
        assert "we hold KV heads 0..2, the peer 2..4" in caplog.text
        # neither says which heads: only the same rank of the same size is read
        blind = TEConnectorWorker("d-blind", cfg, COMPAT, clock, rank=0, tp_size=2)
        blind.register_kv_caches(_heads_caches("gpu", 4, 4), NUM_BLOCKS)
        try:
            blind.start_load([spec(prefill, "c", [3], [3])])
            assert wait_results(blind, "finished_recving", "c").failed_recving == {"c"}
            assert "which KV heads each holds is not known" in caplog.text
        finally:
            blind.close()
    finally:
        decode.close()
        other.close()
        prefill.close()


def test_mla_latent_blocks_are_read_whole_by_decode_ranks_of_another_size(
        clock: FakeClock) -> None:
    """An MLA latent cache is the same on every rank: decode ranks of tensor-parallel
    size 2 each read prefill's (size 1) blocks whole, and prefill frees them once both
    said so. A rank whose cache is not replicated still refuses to read it."""
    from tests.helpers.vllm_workers import mla_caches

    cfg = TEConnectorConfig(transports=("tcp",), timeout_s=2.0)
    compat = dict(COMPAT, kv_heads=None)
    prefill = TEConnectorWorker("p-mla", cfg, compat, clock, replicated=True)
    ranks = [TEConnectorWorker(f"d-mla-{i}", cfg, compat, clock, rank=min(i, 1),
                               tp_size=2, replicated=i < 2) for i in (0, 1, 2)]
    try:
        pk = mla_caches(1)
        prefill.register_kv_caches(pk, NUM_BLOCKS)
        dks = [mla_caches(2 + r) for r in (0, 1, 2)]
        for worker, dk in zip(ranks, dks, strict=True):
            worker.register_kv_caches(dk, NUM_BLOCKS)
        assert prefill.engine is not None
        remote, local = [3, 4, 20], [40, 7, 8]
        prefill.hold({"m": 30.0})
        for r, worker in enumerate(ranks):
            worker.start_load([RecvSpec("m", local, remote, prefill.engine.endpoint, "p",
                                        "m", remote_endpoints=(prefill.engine.endpoint,),
                                        decode_tp=2)])
            res = wait_results(worker, "finished_recving", "m")
            if r == 2:  # not replicated: which heads it holds is not known
                assert res.failed_recving == {"m"}
                continue
            assert not res.failed_recving
            for name in pk:
                for lb, rb in zip(local, remote, strict=True):
                    assert torch.equal(dks[r][name][lb], pk[name][rb])
            time.sleep(0.2)
            freed = prefill.results().finished_sending
            assert freed == (set() if r == 0 else {"m"}), (r, freed)
    finally:
        for worker in ranks:
            worker.close()
        prefill.close()
