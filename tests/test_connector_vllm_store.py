"""Store mode of the vLLM connector: blocks a prefill computed are put into the cluster
store when its request finishes, and any engine that later sees the same prefix loads
them instead of computing them.

Contracts first, without a vLLM engine (scheduler and worker sides driven directly, a
real master and storage node in this process, KV caches as CPU tensors): the lookup
counts only whole blocks every piece of which is stored and never the prompt's last
token; a load lands the bytes where vLLM allocated; a save holds its blocks until the
put is done and skips pieces already stored; a missing piece is a load error that vLLM
recomputes; another model's blocks never match; P/D params win over the store.

Then end to end in real vLLM on CPU (``tests/helpers/vllm_pd_worker.py``, the tiny offline
model of ``tests/test_connector_vllm_e2e.py``): two independent engines share one
store; the second loads the prefix the first computed (vLLM's own prompt-token
accounting says so) and its greedy tokens are identical to an engine without a store.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from tests.helpers.vllm_required import vllm_torch

with warnings.catch_warnings():  # vLLM and torch warn at import; not our concern here
    warnings.simplefilter("ignore")
    torch = vllm_torch()
    from vllm.v1.request import RequestStatus

    from kvstore.client import Lookup
    from kvstore.master import Master
    from kvstore.node import StorageNode
    from tests.helpers.vllm_workers import blocks
    from tests.helpers.vllm_workers import wait_results as worker_results
    from transfer_engine.connectors.vllm import (
        PROTOCOL_VERSION,
        TEConnectorConfig,
        TEConnectorScheduler,
        TEConnectorWorker,
    )
    from transfer_engine.connectors.vllm.store import piece_keys, request_block_keys

pytestmark = pytest.mark.filterwarnings(
    "ignore::DeprecationWarning", "ignore::FutureWarning")

NUM_BLOCKS, BLOCK, HEADS, DIM, LAYERS = 32, 16, 2, 32, 2
COMPAT = {"model": "tiny", "dtype": "float32", "block_size": BLOCK, "tp_size": 1}


def cpu_caches(seed: int) -> dict[str, Any]:
    """vLLM's CPU block-major layout ``[num_blocks, heads, block_size, 2 * dim]``."""
    gen = torch.Generator().manual_seed(seed)
    return {f"layers.{i}.attn": torch.randn(NUM_BLOCKS, HEADS, BLOCK, 2 * DIM, generator=gen)
            for i in range(LAYERS)}


def request(rid: str, prompt: list[int], computed: int = 0, params: Any = None,
            status: RequestStatus = RequestStatus.FINISHED_LENGTH_CAPPED) -> Any:
    return SimpleNamespace(request_id=rid, kv_transfer_params=params, prompt_token_ids=prompt,
                           num_computed_tokens=computed, num_tokens=len(prompt),
                           status=status)


def wait_results(worker: TEConnectorWorker, want: str, rid: str) -> Any:
    """The worker's results once ``rid`` is in ``want`` (store loads get 10 s)."""
    return worker_results(worker, want, rid, timeout=10.0)


class Side:
    """One engine's connector in store mode: its scheduler side and worker side."""

    def __init__(self, name: str, master: str, seed: int, compat: dict[str, Any]) -> None:
        cfg = TEConnectorConfig(transports=("tcp",), timeout_s=2.0, store=master)
        self.caches = cpu_caches(seed)
        self.worker = TEConnectorWorker(name, cfg, compat)
        self.worker.register_kv_caches(self.caches, NUM_BLOCKS)
        self.lookup = Lookup(master, timeout=2.0)
        self.sched = TEConnectorScheduler(name, BLOCK, store=self.lookup)
        self.sched.set_handshake({0: self.worker.handshake_metadata()})

    def step(self) -> Any:
        """What vLLM's worker does with the scheduler's metadata each step."""
        meta = self.sched.build_connector_meta()
        self.worker.hold(meta.reqs_to_send)
        self.worker.start_store_saves(meta.store_saves.values())
        self.worker.start_store_loads(meta.store_loads.values())
        return meta

    def block(self, b: int) -> list[Any]:
        return [t[b].clone() for t in self.caches.values()]

    def close(self) -> None:
        self.worker.close()
        self.lookup.close()


@pytest.fixture
def store() -> Iterator[Master]:
    with Master(lease_s=2.0, put_timeout_s=3.0, node_interval=0.1) as master:
        with StorageNode(master.endpoint, 8 << 20, name="n0"):
            master.wait_nodes(1)
            yield master


@pytest.fixture
def sides(store: Master) -> Iterator[tuple[Side, Side]]:
    a = Side("store-a", store.endpoint, 1, COMPAT)
    b = Side("store-b", store.endpoint, 2, COMPAT)
    try:
        yield a, b
    finally:
        b.close()
        a.close()


def _save(side: Side, rid: str, prompt: list[int], block_ids: list[int]) -> Any:
    req = request(rid, prompt, computed=len(prompt))
    held, params = side.sched.request_finished(req, block_ids)
    assert held and params is None
    meta = side.step()
    assert side.worker.held == 1
    wait_results(side.worker, "finished_sending", rid)
    assert side.worker.held == 0
    return meta.store_saves[rid]


def test_second_engine_loads_what_the_first_computed(sides: tuple[Side, Side]) -> None:
    a, b = sides
    prompt = list(range(100, 150))  # 50 tokens: three full blocks and two tokens
    assert a.sched.get_num_new_matched_tokens(request("a1", prompt), 0) == (0, False)
    saved = _save(a, "a1", prompt, [5, 9, 6, 7])
    assert saved.block_ids == [5, 9, 6]
    assert a.worker.stats["store_save_bytes"] == 3 * LAYERS * HEADS * BLOCK * 2 * DIM * 4

    # B shares the first 40 tokens: two whole blocks; its first is cached locally
    other = prompt[:40] + [7] * 20
    req = request("b1", other)
    assert b.sched.get_num_new_matched_tokens(req, 16) == (16, True)
    b.sched.update_state_after_alloc(req, blocks([3, 4, 8], cached=1), 16)
    meta = b.step()
    assert meta.store_loads["b1"].block_ids == [4]
    res = wait_results(b.worker, "finished_recving", "b1")
    assert not res.failed_recving and b.worker.take_failed_blocks() == set()
    for got, want in zip(b.block(4), a.block(9), strict=True):
        assert torch.equal(got, want)
    assert b.worker.stats["store_load_bytes"] == LAYERS * HEADS * BLOCK * 2 * DIM * 4

    # the whole prompt stored: the last token is still B's to compute (48 of 50 tokens;
    # a prompt of exactly three blocks gets two)
    assert b.sched.get_num_new_matched_tokens(request("b2", prompt), 0) == (48, True)
    assert b.sched.get_num_new_matched_tokens(request("b3", prompt[:48]), 0) == (32, True)
    # finishing B's request puts only what it computed itself, not what it loaded
    b.sched.update_state_after_alloc(request("b2", prompt), blocks([10, 11, 12, 13]), 48)
    b.step()
    wait_results(b.worker, "finished_recving", "b2")
    held, _ = b.sched.request_finished(request("b2", prompt, computed=50), [10, 11, 12, 13])
    assert not held and b.sched.build_connector_meta().store_saves == {}


def test_saves_skip_stored_pieces_and_aborts_save_nothing(sides: tuple[Side, Side]) -> None:
    a, b = sides
    prompt = list(range(200, 240))
    _save(a, "a1", prompt, [1, 2, 3])
    put = a.worker.stats["store_save_bytes"]
    _save(b, "b1", prompt, [4, 5, 6])  # same blocks from another engine: nothing moves
    assert b.worker.stats["store_save_bytes"] == 0 and b.worker.stats["store_saves"] == 0
    assert put > 0
    aborted = request("x", list(range(300, 340)), computed=40,
                      status=RequestStatus.FINISHED_ABORTED)
    assert a.sched.request_finished(aborted, [7, 8, 9]) == (False, None)


def test_missing_piece_is_a_load_error_recomputed(sides: tuple[Side, Side], store: Master
                                                  ) -> None:
    a, b = sides
    prompt = list(range(400, 440))
    saved = _save(a, "a1", prompt, [1, 2, 3])
    req = request("b1", prompt)
    assert b.sched.get_num_new_matched_tokens(req, 0) == (32, True)
    # a piece is evicted between the lookup and the load
    victim = piece_keys(saved.keys[1:], b.worker.store.labels)[-1]  # type: ignore[union-attr]
    assert a.worker.store is not None and a.worker.store.client.remove(victim)
    b.sched.update_state_after_alloc(req, blocks([6, 7, 8]), 32)
    b.step()
    res = wait_results(b.worker, "finished_recving", "b1")
    assert res.failed_recving == {"b1"}
    assert b.worker.take_failed_blocks() == {6, 7}
    assert b.worker.stats["store_load_failed"] == 1
    # blocks vLLM allocated that do not line up with the lookup: never a silent "done"
    req = request("b2", prompt)
    assert b.sched.get_num_new_matched_tokens(req, 0) == (16, True)
    b.sched.update_state_after_alloc(req, blocks([9, 10], cached=2), 16)
    b.step()
    assert wait_results(b.worker, "finished_recving", "b2").failed_recving == {"b2"}


def test_other_models_never_match_and_pd_params_win(store: Master) -> None:
    a = Side("store-a", store.endpoint, 1, COMPAT)
    other = Side("store-o", store.endpoint, 2, dict(COMPAT, model="another"))
    try:
        prompt = list(range(500, 540))
        _save(a, "a1", prompt, [1, 2, 3])
        assert a.sched.get_num_new_matched_tokens(request("a2", prompt), 0) == (32, True)
        assert other.sched.get_num_new_matched_tokens(request("o1", prompt), 0) == (0, False)
        # a request with P/D params loads from its prefill engine, not from the store
        params = {"do_remote_prefill": True, "protocol_version": PROTOCOL_VERSION,
                  "remote_endpoint": "tcp://127.0.0.1:1", "remote_engine_id": "p",
                  "remote_request_id": "p1", "remote_block_ids": [1, 2, 3],
                  "remote_num_tokens": 40, "lease_expiry": time.time() + 30}
        from transfer_engine.connectors.vllm import prompt_hash

        params["prompt_hash"] = prompt_hash(prompt, 40)
        req = request("a3", prompt, params=params)
        # loaded in the admitting step, which computes the prompt's last token
        assert a.sched.get_num_new_matched_tokens(req, 0) == (39, False)
        a.sched.update_state_after_alloc(req, blocks([4, 5, 6]), 39)
        meta = a.sched.build_connector_meta()
        assert list(meta.reqs_to_recv) == ["a3"] and meta.store_loads == {}
    finally:
        other.close()
        a.close()


def test_keys_follow_vllm_hashes_when_the_request_has_them() -> None:
    prompt = list(range(40))
    plain = request("r", prompt)
    hashed = SimpleNamespace(**vars(plain), block_hashes=[b"x" * 32, b"y" * 32])
    by_tokens = request_block_keys(plain, prompt, BLOCK, 2)
    by_vllm = request_block_keys(hashed, prompt, BLOCK, 2)
    assert by_tokens != by_vllm and len(set(by_vllm)) == 2
    assert request_block_keys(hashed, prompt, BLOCK, 2, use_vllm_hashes=False) == by_tokens
    # hashes at another granularity than the blocks are not used
    coarse = SimpleNamespace(**vars(plain), block_hashes=[b"x" * 32])
    assert request_block_keys(coarse, prompt, BLOCK, 1) == by_tokens[:1]


def test_a_dead_store_loads_nothing_and_fails_no_request(tmp_path: Path) -> None:
    from bench.fleet import free_port

    dead = f"tcp://127.0.0.1:{free_port()}"
    side = Side("store-dead", dead, 1, COMPAT)
    try:
        side.lookup.timeout = 0.2
        side.worker.store.client.timeout = 0.2  # type: ignore[union-attr]
        prompt = list(range(40))
        assert side.sched.get_num_new_matched_tokens(request("d1", prompt), 0) == (0, False)
        assert side.sched.store_errors == 1
        # no lookup (and no wait on the master) for a while after one failed
        started = time.monotonic()
        assert side.sched.get_num_new_matched_tokens(request("d2", prompt), 0) == (0, False)
        assert side.sched.store_errors == 1 and time.monotonic() - started < 0.1
        side.sched.request_finished(request("d1", prompt, computed=40), [1, 2, 3])
        side.step()
        wait_results(side.worker, "finished_sending", "d1")  # freed all the same
        assert side.worker.stats["store_save_failed"] == 1
    finally:
        side.close()


def test_store_config_validation(tmp_path: Path) -> None:
    cfg = TEConnectorConfig.from_extra_config({"store": "tcp://10.0.0.7:7400",
                                               "store_timeout_s": 2})
    assert cfg.store == "tcp://10.0.0.7:7400" and cfg.store_timeout_s == 2
    for bad, why in (("10.0.0.7:7400", "tcp://host:port"), ("tcp://10.0.0.7", "port"),
                     ("tcp://:7400", "host"), ("tcp://h:70000", "port"), (7400, "string")):
        with pytest.raises(ValueError, match=why):
            TEConnectorConfig.from_extra_config({"store": bad})
    with pytest.raises(ValueError, match="store_timeout_s"):
        TEConnectorConfig.from_extra_config({"store": "tcp://h:1", "store_timeout_s": 0})
    with pytest.raises(ValueError, match="secret_file"):
        TEConnectorConfig.from_extra_config({"secret_file": str(tmp_path / "none")})
    secret = tmp_path / "secret"
    secret.write_text("a-control-secret-of-some-length\n")
    cfg = TEConnectorConfig.from_extra_config({"secret_file": str(secret)})
    assert cfg.auth().key == b"a-control-secret-of-some-length"


# --- end to end: two independent vLLM engines and one store ---------------------------

SHARED = " ".join(["one two three four five six seven eight nine ten"] * 10)  # 100 tokens
PROMPT_A = SHARED + " red green blue"
PROMPT_B = SHARED + " fast slow fast slow"
PD_PROMPT = "prefill and decode transfer the memory of " * 6  # 42 tokens: one block


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_two_vllm_engines_share_a_prefix_through_the_store(tmp_path: Path) -> None:
    from bench.vllm_servers import build_model, core_halves
    from tests.helpers.vllm_engines import (
        BLOCK_BYTES,
        BLOCK_SIZE,
        MAX_TOKENS,
        EngineProcess,
    )

    model = tmp_path / "model"
    build_model(model)
    first, second = core_halves()
    # heartbeats every 0.5 s (dropped after 2 s of silence): three vLLM engines share
    # two cores with the master and the node here, and a node dropped for a slow beat
    # would fail the saves this test counts
    with Master(lease_s=5.0, node_interval=0.5) as master, \
            StorageNode(master.endpoint, 64 << 20, name="vllm-store-node"):
        master.wait_nodes(1)
        extra = {"store": master.endpoint, "timeout_s": 5.0}
        # A and B on cores of their own, as on two hosts; the plain engine on A's
        procs = {name: EngineProcess(role, model, tmp_path / f"{name}.log", cfg, cores)
                 for name, role, cfg, cores in (("a", "both", extra, first),
                                                ("b", "both", extra, second),
                                                ("plain", "single", {}, first))}
        try:
            for proc in procs.values():
                proc.recv()  # ready
            a, b, plain = procs["a"], procs["b"], procs["plain"]
            ref_a = plain.generate(PROMPT_A, MAX_TOKENS)
            ref_b = plain.generate(PROMPT_B, MAX_TOKENS)

            got_a = a.generate(PROMPT_A, MAX_TOKENS)
            assert got_a["tokens"] == ref_a["tokens"]
            drained = a.call(op="drain")  # the save runs once the request finished
            assert drained["held"] == 0 and drained["free_blocks"] == drained["total_blocks"]
            stats_a = a.call(op="stats")["connector"]
            assert stats_a["store_save_bytes"] == 3 * BLOCK_BYTES  # 103 tokens: 3 blocks
            assert stats_a["store_save_failed"] == 0

            before = b.call(op="metrics")
            got_b = b.generate(PROMPT_B, MAX_TOKENS)
            after = b.call(op="metrics")
            assert got_b["tokens"] == ref_b["tokens"]
            # vLLM's own accounting: the shared prefix's three blocks came from outside
            loaded = after.get("external_kv_transfer", 0) - before.get("external_kv_transfer",
                                                                        0)
            assert loaded == 3 * BLOCK_SIZE, (before, after)
            stats_b = b.call(op="stats")["connector"]
            assert stats_b["store_load_bytes"] == 3 * BLOCK_BYTES
            assert stats_b["store_load_failed"] == 0 and stats_b["recv_requests"] == 0

            # P/D between the same two engines: the params win over the store
            ref = plain.generate(PD_PROMPT, MAX_TOKENS)
            pre = a.generate(PD_PROMPT, 1, {"do_remote_decode": True})
            dec = b.generate(PD_PROMPT, MAX_TOKENS, pre["params"])
            assert dec["tokens"] == ref["tokens"]
            stats_b = b.call(op="stats")["connector"]
            assert stats_b["recv_requests"] == 1 and stats_b["recv_failed"] == 0
            assert stats_b["store_loads"] == 1
            for proc in (a, b):
                drained = proc.call(op="drain")
                assert drained["held"] == 0
                assert drained["free_blocks"] == drained["total_blocks"]
        finally:
            for proc in procs.values():
                proc.close()
