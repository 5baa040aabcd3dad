"""The vLLM connector's parts that need no pair of engines, driven directly:

- the scheduler side: what prefill hands over and holds, what decode loads (sync or
  not, cached prefix or not), and that hostile, stale, foreign or malformed
  ``kv_transfer_params`` load nothing and never fail a request;
- the configuration checks;
- block layouts found from a layer tensor's strides (GPU, CPU and permuted layouts);
- the engine's threads are not pinned to the core vLLM's CPU worker pins its own to.

Requests are ``SimpleNamespace`` objects carrying the attributes the scheduler side
reads (building a real ``vllm.v1.request.Request`` needs a tokenizer and a model
config); block lists are vLLM's own ``KVCacheBlocks``.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from tests.helpers.clock import FakeClock
from tests.helpers.vllm_required import vllm_torch

with warnings.catch_warnings():  # vLLM and torch warn at import; not our concern here
    warnings.simplefilter("ignore")
    torch = vllm_torch()
    from vllm.v1.request import RequestStatus

    from tests.helpers.vllm_workers import blocks
    from transfer_engine.connectors.vllm import (
        PROTOCOL_VERSION,
        TEConnectorConfig,
        TEConnectorScheduler,
        vllm_layout,
    )

pytestmark = pytest.mark.filterwarnings(
    "ignore::DeprecationWarning", "ignore::FutureWarning")

BLOCK = 16


# --- threads and CPUs ------------------------------------------------------------------

_AFFINITY = """
import os, sys, threading
from transfer_engine.connectors.vllm.config import unpinned
os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})  # as vLLM pins its compute thread
seen = []
with unpinned():
    t = threading.Thread(target=lambda: seen.append(sorted(os.sched_getaffinity(0))))
    t.start()
    t.join()
print(seen[0], sorted(os.sched_getaffinity(0)))
"""
# a server's job: a first process (vLLM's API server) and the worker it starts
_SERVER = "import subprocess, sys; subprocess.run([sys.executable, '-c', sys.argv[1]])"


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs")
def test_engine_threads_leave_the_pinned_core_but_keep_to_the_server_cpus() -> None:
    """Threads the connector starts run off the core vLLM pinned its compute thread
    to, on every CPU the server was given, and never outside a taskset around it."""
    import subprocess
    import sys

    cpus = sorted(os.sched_getaffinity(0))
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parent.parent))

    given = cpus[-1:]  # a server given one core: all its threads stay there
    procs = [subprocess.Popen([*box, sys.executable, "-c", _SERVER, _AFFINITY],
                              stdout=subprocess.PIPE, text=True, env=env,
                              start_new_session=True)
             for box in ([], ["taskset", "-c", ",".join(map(str, given))])]
    try:  # both at once: each spends most of its time importing vLLM
        free, boxed = (p.communicate(timeout=120)[0].split("\n")[0] for p in procs)
        assert all(p.returncode == 0 for p in procs)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert free == f"{cpus} {cpus[:1]}"  # the caller gets its one core back
    assert boxed == f"{given} {given}"


def test_our_log_lines_go_through_vllms_handler_unless_the_application_set_logging(
        ) -> None:
    """Under vLLM (which gives only its own logger a handler) our info lines reach its
    log, in its format; an application that configured logging keeps its own set-up."""
    import io
    import logging

    from transfer_engine.connectors.vllm.config import log_with

    out = io.StringIO()
    host = logging.Logger("vllm-like", logging.INFO)
    host.addHandler(logging.StreamHandler(out))
    names = ("te-test-log", "te-test-log-too")
    ours = [logging.getLogger(n) for n in names]
    try:
        log_with(host, names, root=logging.Logger("configured"))  # an empty root
        logging.getLogger("te-test-log.scheduler_side").info("computing locally")
        assert out.getvalue() == "computing locally\n"
        assert all(lg.handlers == host.handlers for lg in ours)
        for lg in ours:
            lg.handlers.clear()
            lg.setLevel(logging.NOTSET)
        configured = logging.Logger("configured")
        configured.addHandler(logging.NullHandler())
        log_with(host, names, root=configured)  # the application's own: left alone
        assert all(not lg.handlers and lg.level == logging.NOTSET for lg in ours)
    finally:
        for lg in ours:
            lg.handlers.clear()
            lg.setLevel(logging.NOTSET)


# --- layout from strides --------------------------------------------------------------


def test_layout_from_strides_gpu_cpu_and_permuted() -> None:
    gpu = torch.empty(2, 10, 16, 4, 8, dtype=torch.float16)
    lay = vllm_layout(gpu.shape, gpu.stride(), gpu.element_size(), 10, str(gpu.dtype))
    part = 16 * 4 * 8 * 2
    assert lay.parts == (0, 10 * part) and lay.block_bytes == part
    assert lay.block_stride == part and lay.contiguous and lay.num_blocks == 10
    assert lay.dtype == "torch.float16" and lay.extent == gpu.nbytes
    cpu = torch.empty(10, 4, 16, 16, dtype=torch.float32)
    lay = vllm_layout(cpu.shape, cpu.stride(), 4, 10)
    assert lay.parts == (0,) and lay.block_bytes == lay.block_stride == 4 * 16 * 16 * 4
    # a permuted view: [num_blocks, 2, ...] storage seen as [2, num_blocks, ...]: K and
    # V of a block are adjacent, so a block is one part
    base = torch.empty(10, 2, 16, 4, 8)
    view = base.permute(1, 0, 2, 3, 4)
    lay = vllm_layout(view.shape, view.stride(), 4, 10)
    assert lay.parts == (0,) and lay.block_bytes == lay.block_stride == 2 * 16 * 4 * 8 * 4
    assert lay.extent == base.numel() * 4
    # only K of that storage: blocks are strided, runs cannot coalesce
    lay = vllm_layout(base[:, 0].shape, base[:, 0].stride(), 4, 10)
    assert lay.block_bytes == 16 * 4 * 8 * 4 and lay.block_stride == 2 * lay.block_bytes
    assert not lay.contiguous
    # num_blocks == 2 with a leading K/V dimension: the block dimension is the second
    two = torch.empty(2, 2, 16, 4, 8)
    assert vllm_layout(two.shape, two.stride(), 4, 2).parts == (0, 2 * 16 * 4 * 8 * 4)
    with pytest.raises(ValueError, match="7 blocks"):
        vllm_layout((3, 5), (5, 1), 4, 7)
    with pytest.raises(ValueError, match="outside a block"):  # two K/V-like dimensions
        vllm_layout((2, 3, 10, 8), (240, 80, 8, 1), 4, 10)
    with pytest.raises(ValueError, match="not contiguous"):  # a padded block interior
        vllm_layout((10, 16, 8), (256, 16, 1), 4, 10)


def test_heads_are_found_where_one_dimension_has_their_number() -> None:
    """The heads dimension is the one of this rank's KV heads' size: a piece per token
    in the GPU layout, a run per block in the CPU one, also for one head; two
    dimensions of that size (16 heads, 16 tokens a block) leave the heads unknown."""
    from transfer_engine.connectors.vllm.blocks import head_range

    def heads(shape: tuple[int, ...], kv_heads: int | None) -> Any:
        t = torch.zeros(shape)
        return vllm_layout(t.shape, t.stride(), 4, 10, "float32", kv_heads).heads

    assert heads((2, 10, 16, 4, 8), 4) == (16, 4, 32)
    assert heads((10, 4, 16, 16), 4) == (1, 4, 1024)
    assert heads((2, 10, 16, 1, 8), 1) == (16, 1, 32)
    assert heads((10, 1, 16, 16), 1) == (1, 1, 1024)
    assert heads((10, 16, 16, 16), 16) is None
    assert heads((10, 16, 40), None) is None  # MLA: no heads to split
    assert head_range(1, 2, 2, 4) == (2, 2)
    assert head_range(3, 4, 1, 2) == (1, 1)  # fewer heads than ranks: shared
    assert head_range(0, 3, 1, 2) is None


def test_a_prefill_rank_frees_blocks_once_every_reader_said_so() -> None:
    from transfer_engine.connectors.vllm.sent import MAX_PENDING, SentNotes, sent_note

    notes = SentNotes()
    assert notes.add(sent_note("one")) == "one"
    assert notes.add(sent_note("two", 0, 2)) is None
    assert notes.add(sent_note("two", 0, 2)) is None  # the same reader twice
    assert notes.add(sent_note("two", 1, 2)) == "two"
    for bad in (b"te-vllm/sent-of:zz", b"te-vllm/sent-of:3/2:x", b"te-vllm/sent-of:0/99:x",
                b"te-vllm/sent-of:-1/2:x", b"te-vllm/sent-of:1/2", b"other"):
        assert notes.add(bad) is None
    for i in range(MAX_PENDING + 10):  # readers that never all come: bounded
        notes.add(sent_note(f"r{i}", 0, 2))
    assert len(notes._heard) <= MAX_PENDING


def test_layout_signature_names_what_must_match() -> None:
    from transfer_engine.connectors.vllm.blocks import layout_signature
    a = torch.empty(2, 10, 16, 4, 8, dtype=torch.float16)
    b = torch.empty(2, 30, 16, 4, 8, dtype=torch.float16)  # more blocks: still compatible
    c = torch.empty(2, 10, 16, 2, 16, dtype=torch.float16)  # same bytes, other heads
    sig = [layout_signature(vllm_layout(t.shape, t.stride(), 2, n, str(t.dtype)))
           for t, n in ((a, 10), (b, 30), (c, 10))]
    assert sig[0] == sig[1] != sig[2]


# --- scheduler side ---------------------------------------------------------------------


def request(rid: str, params: dict[str, Any] | None, prompt: int = 40, computed: int = 0,
            status: RequestStatus = RequestStatus.FINISHED_LENGTH_CAPPED) -> Any:
    return SimpleNamespace(request_id=rid, kv_transfer_params=params,
                           prompt_token_ids=list(range(prompt)), num_computed_tokens=computed,
                           status=status)


def test_scheduler_hands_over_and_holds() -> None:
    wall = FakeClock()
    prefill = TEConnectorScheduler("p-engine", BLOCK, lease_s=30, endpoint="tcp://p:1",
                                   wall_clock=wall)
    hold, params = prefill.request_finished(
        request("r", {"do_remote_decode": True}, prompt=40, computed=40), [7, 8, 9, 10])
    assert hold and params is not None
    assert params["remote_block_ids"] == [7, 8, 9]  # ceil(40 / 16) blocks
    assert params["protocol_version"] == PROTOCOL_VERSION
    assert params["lease_expiry"] == wall.now + 30
    assert prefill.build_connector_meta().reqs_to_send == {"r": 30}
    assert prefill.build_connector_meta().reqs_to_send == {}
    # aborted or ordinary requests hold nothing
    aborted = request("x", {"do_remote_decode": True}, status=RequestStatus.FINISHED_ABORTED)
    assert prefill.request_finished(aborted, [1]) == (False, None)
    assert prefill.request_finished(request("y", None), [1]) == (False, None)
    # a first token that ended the request (EOS, a stop token): nothing to decode, so
    # its blocks are free at once instead of at the lease's end
    eos = request("e", {"do_remote_decode": True}, status=RequestStatus.FINISHED_STOPPED)
    assert prefill.request_finished(eos, [1]) == (False, None)
    assert prefill.build_connector_meta().reqs_to_send == {}

    decode = TEConnectorScheduler("d-engine", BLOCK, wall_clock=wall, sync_load=False)
    req = request("d1", dict(params), prompt=40)
    # the decode engine already has the first block cached (16 tokens)
    assert decode.get_num_new_matched_tokens(req, 16) == (24, True)
    decode.update_state_after_alloc(req, blocks([3, 4, 5], cached=1), 24)
    meta = decode.build_connector_meta()
    recv = meta.reqs_to_recv["d1"]
    assert recv.local_block_ids == [4, 5] and recv.remote_block_ids == [8, 9]
    assert recv.remote_endpoint == "tcp://p:1" and not recv.sync
    # loaded once: a preempted request recomputes instead of loading again
    assert decode.get_num_new_matched_tokens(req, 0) == (0, False)


def test_a_prompt_prefilled_in_chunks_is_read_not_pushed_and_said_once(
        caplog: pytest.LogCaptureFixture) -> None:
    """A push needs the whole prompt prefilled in one step; a prompt prefilled in
    chunks is left to decode's read, and the log says so once, not per request."""
    prefill = TEConnectorScheduler("p-engine", BLOCK, endpoint="tcp://p:1", push=True)
    push = {"room": "r" * 24, "to": ["tcp://d:1"]}

    def step(rid: str, scheduled: int) -> Any:
        req = request(rid, {"do_remote_decode": True, "push": dict(push)}, prompt=40)
        prefill.update_state_after_alloc(req, blocks([1, 2, 3]), 0)
        return prefill.build_connector_meta(
            SimpleNamespace(num_scheduled_tokens={rid: scheduled}))

    with caplog.at_level("INFO", logger="transfer_engine"):
        assert step("c1", 16).reqs_to_push == {}  # 16 of 40 tokens this step
        assert step("c2", 32).reqs_to_push == {}
        whole = step("w", 40).reqs_to_push["w"]
    assert whole.block_ids == [1, 2, 3] and whole.num_tokens == 40
    said = [r for r in caplog.records if "prefilled in chunks" in r.getMessage()]
    assert len(said) == 1 and "c1" in said[0].getMessage()


def test_scheduler_sync_load_leaves_the_last_prompt_token_to_compute() -> None:
    """Loading in the admitting step (the default): vLLM must compute at least one
    token there, so a hand-over of the whole prompt loads all but its last token; one
    whose prompt goes on past prefill's (prefill's first token appended) loads all."""
    wall = FakeClock()
    params = _good_params(wall)  # 40 tokens of prefill's prompt
    decode = TEConnectorScheduler("d-engine", BLOCK, wall_clock=wall)
    same = request("same", dict(params), prompt=40)
    assert decode.get_num_new_matched_tokens(same, 16) == (23, False)
    # vLLM hashes a sync load's blocks as it allocates them: only the 16 tokens it had
    # computed count as cached
    decode.update_state_after_alloc(same, blocks([3, 4, 5], cached=3), 23)
    recv = decode.build_connector_meta().reqs_to_recv["same"]
    assert recv.sync and recv.local_block_ids == [4, 5] and recv.remote_block_ids == [8, 9]
    longer = request("longer", dict(params), prompt=41)
    longer.prompt_token_ids = list(range(40)) + [99]  # prefill's first token appended
    fresh = TEConnectorScheduler("d2-engine", BLOCK, wall_clock=wall)
    assert fresh.get_num_new_matched_tokens(longer, 0) == (40, False)


def test_a_load_whose_window_reaches_a_block_prefill_freed_is_computed() -> None:
    """Behind a sliding window vLLM frees blocks (its null block, id 0, takes their
    place), and prefill keeps what its own next token attends. The sequential hand-off
    makes decode compute the prompt's last token again, whose window reaches one token
    further back: when that token's block was freed (prompt length one short of a
    block boundary past the window), decode computes the prompt instead of reading
    the null block. The first-token hand-off (prompt plus prefill's token) loads."""
    wall = FakeClock()
    window = 8
    prefill = TEConnectorScheduler("p", BLOCK, lease_s=30, endpoint="tcp://p:1",
                                   wall_clock=wall, window=window)

    def handed(prompt: int, freed: int) -> dict[str, Any]:
        _, params = prefill.request_finished(
            request(f"r{prompt}", {"do_remote_decode": True}, prompt=prompt,
                    computed=prompt), [0] * freed + list(range(7, 7 + 8)))
        assert params is not None
        return params

    decode = TEConnectorScheduler("d", BLOCK, wall_clock=wall, window=window)
    # 39 tokens: prefill's next token (39) attends 32..39, so blocks 0 and 1 are gone;
    # decode's recomputed token 38 attends 31..38, and 31 lies in block 1
    short = request("short", handed(39, 2), prompt=39)
    assert decode.get_num_new_matched_tokens(short, 0) == (0, False)
    assert "freed" in decode.refused["short"]
    # the same hand-over, continued from prefill's first token: token 39 attends 32..39
    longer = request("longer", handed(39, 2), prompt=40)
    longer.prompt_token_ids = list(range(39)) + [99]
    assert decode.get_num_new_matched_tokens(longer, 0) == (39, False)
    # 40 tokens: token 39 attends 32..39, all in block 2, which prefill kept
    fine = request("fine", handed(40, 2), prompt=40)
    assert decode.get_num_new_matched_tokens(fine, 0) == (39, False)
    # full attention: nothing is freed, the null block never appears
    assert TEConnectorScheduler("d2", BLOCK, wall_clock=wall).get_num_new_matched_tokens(
        request("full", _good_params(wall, 39), prompt=39), 0) == (38, False)


def _good_params(wall: FakeClock, prompt: int = 40) -> dict[str, Any]:
    prefill = TEConnectorScheduler("p", BLOCK, lease_s=30, endpoint="tcp://p:1",
                                   wall_clock=wall)
    _, params = prefill.request_finished(
        request("r", {"do_remote_decode": True}, prompt=prompt, computed=prompt),
        list(range(7, 7 + prompt)))
    assert params is not None
    return params


def test_scheduler_refuses_params_another_request_used() -> None:
    """Prefill frees a hand-over's blocks once they are read: the same
    kv_transfer_params replayed for another request (by the client or anyone who saw
    them) would read whatever those blocks hold by then, so they are refused (vLLM
    computes that prompt) until their lease ends; the request that used them may ask
    again (vLLM asks each step until it can allocate)."""
    wall = FakeClock()
    decode = TEConnectorScheduler("d", BLOCK, wall_clock=wall)
    params = _good_params(wall)
    first = request("first", dict(params))
    assert decode.get_num_new_matched_tokens(first, 0) == (39, False)
    assert decode.get_num_new_matched_tokens(first, 0) == (39, False)  # no blocks yet
    decode.update_state_after_alloc(first, blocks([1, 2, 3]), 39)
    assert list(decode.build_connector_meta().reqs_to_recv) == ["first"]
    again = request("again", dict(params))
    assert decode.get_num_new_matched_tokens(again, 0) == (0, False)
    assert "replayed" in decode.refused["again"]
    assert again.kv_transfer_params["do_remote_prefill"] is False
    # another hand-over from the same prefill is another key
    other = _good_params(wall)
    other["remote_request_id"] = "r2"
    assert decode.get_num_new_matched_tokens(request("next", other), 0) == (39, False)


def test_a_hybrid_kv_cache_hands_nothing_over() -> None:
    """Several KV cache groups each have block ids of their own: rather than move one
    group's blocks for all, prefill hands nothing over and decode computes."""
    wall = FakeClock()
    params = _good_params(wall)
    decode = TEConnectorScheduler("d", BLOCK, wall_clock=wall, kv_groups=2)
    req = request("h", dict(params))
    assert decode.get_num_new_matched_tokens(req, 0) == (0, False)
    assert req.kv_transfer_params["do_remote_prefill"] is False and "hybrid" in \
        decode.refused["h"]
    prefill = TEConnectorScheduler("p", BLOCK, endpoint="tcp://p:1", wall_clock=wall,
                                   kv_groups=2)
    assert prefill.request_finished(request("r", {"do_remote_decode": True}, computed=40),
                                    [1, 2, 3]) == (False, None)


def test_scheduler_refuses_expired_leases_and_other_versions() -> None:
    wall = FakeClock()
    decode = TEConnectorScheduler("d", BLOCK, wall_clock=wall)
    base = _good_params(wall)
    old = dict(base, lease_expiry=wall.now - 1)
    assert decode.get_num_new_matched_tokens(request("old", old), 0) == (0, False)
    assert "lease" in decode.refused["old"]
    newer = dict(base, protocol_version=PROTOCOL_VERSION + 1)
    assert decode.get_num_new_matched_tokens(request("new", newer), 0) == (0, False)
    assert "protocol version" in decode.refused["new"]
    assert decode.get_num_new_matched_tokens(request("ok", dict(base)), 0) == (39, False)


HOSTILE: list[tuple[str, Any]] = [
    ("lease_expiry", "soon"), ("lease_expiry", None), ("lease_expiry", float("nan")),
    ("lease_expiry", float("inf")), ("lease_expiry", True), ("lease_expiry", 1e300),
    ("remote_block_ids", "abc"), ("remote_block_ids", [7]), ("remote_block_ids", []),
    ("remote_block_ids", [7, 8, 9, 10]), ("remote_block_ids", [7, 8, 2**63]),
    ("remote_block_ids", [7, 8, 2**62]), ("remote_block_ids", [7, 8, -1]),
    ("remote_block_ids", [7, 8, "9"]), ("remote_block_ids", [7, 8, 9.0]),
    ("remote_block_ids", [7, 8, True]), ("remote_block_ids", None),
    ("remote_block_ids", {"0": 7}),
    ("remote_num_tokens", 41), ("remote_num_tokens", 0), ("remote_num_tokens", -5),
    ("remote_num_tokens", "40"), ("remote_num_tokens", 2**70), ("remote_num_tokens", None),
    ("remote_num_tokens", 17),  # three blocks listed for two blocks' worth of tokens
    ("remote_endpoint", 5), ("remote_endpoint", ""), ("remote_endpoint", "p:1"),
    ("remote_endpoint", "tcp://" + "x" * 600), ("remote_endpoint", None),
    ("remote_request_id", 12), ("remote_request_id", ""), ("remote_engine_id", ["e"]),
    ("protocol_version", "2"), ("protocol_version", True), ("protocol_version", None),
    ("prompt_hash", None), ("prompt_hash", "0" * 32), ("prompt_hash", 5),
    ("remote_endpoints", "tcp://p:1"), ("remote_endpoints", []), ("remote_endpoints", [5]),
    ("remote_endpoints", ["tcp://p:1", "tcp://p:1"]),  # two ranks at one endpoint
    ("remote_endpoints", ["p:1"]), ("remote_endpoints", ["tcp://p:1"] * 65),
    ("remote_endpoints", ["tcp://elsewhere:1"]),  # not the remote_endpoint it goes with
]


@pytest.mark.parametrize("key,value", HOSTILE, ids=[f"{k}={v!r:.20}" for k, v in HOSTILE])
def test_hostile_kv_transfer_params_are_recomputed_not_fatal(key: str, value: Any) -> None:
    """Params a client sends straight to decode: a bad field never raises, never counts
    a token that will not be loaded; the request is computed locally."""
    wall = FakeClock()
    decode = TEConnectorScheduler("d", BLOCK, wall_clock=wall)
    params = dict(_good_params(wall), **{key: value})
    req = request("bad", params)
    assert decode.get_num_new_matched_tokens(req, 0) == (0, False)
    assert "bad" in decode.refused
    decode.update_state_after_alloc(req, blocks([1, 2, 3]), 0)
    assert decode.build_connector_meta().reqs_to_recv == {}


def test_each_tensor_parallel_rank_loads_from_the_prefill_rank_of_its_number() -> None:
    """Prefill names every rank's worker; a decode of the same size maps rank r to
    prefill rank r (its KV heads), one of twice the size ranks 2r and 2r + 1 (each a
    half of rank r's heads, each one of its two readers), one of half the size rank 0
    to both (its heads from each, their one reader); sizes that do not divide one
    another, or one endpoint for two ranks, are refused (recomputed)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorHandshakeMetadata

    from transfer_engine.connectors.vllm.metadata import RecvSpec, TEHandshakeMetadata

    def meta(ep: str) -> KVConnectorHandshakeMetadata:
        return TEHandshakeMetadata(ep, "w", PROTOCOL_VERSION, "h")
    wall = FakeClock()
    prefill = TEConnectorScheduler("p", BLOCK, lease_s=30, wall_clock=wall, tp_size=2)
    prefill.set_handshake({1: meta("tcp://p:2"), 0: meta("tcp://p:1")})
    _, params = prefill.request_finished(
        request("r", {"do_remote_decode": True}, computed=40), [7, 8, 9])
    assert params is not None
    assert params["remote_endpoints"] == ["tcp://p:1", "tcp://p:2"]
    assert params["remote_endpoint"] == "tcp://p:1"
    decode = TEConnectorScheduler("d", BLOCK, wall_clock=wall, tp_size=2)
    req = request("two", dict(params))
    assert decode.get_num_new_matched_tokens(req, 0) == (39, False)
    decode.update_state_after_alloc(req, blocks([1, 2, 3]), 39)
    spec = decode.build_connector_meta().reqs_to_recv["two"]
    assert [spec.endpoint_for(r) for r in (0, 1)] == ["tcp://p:1", "tcp://p:2"]
    assert [spec.reader(r) for r in (0, 1)] == [(0, 1), (0, 1)]
    four = TEConnectorScheduler("d4", BLOCK, wall_clock=wall, tp_size=4)
    assert four.get_num_new_matched_tokens(request("four", dict(params)), 0) == (39, False)
    four.update_state_after_alloc(request("four", dict(params)), blocks([1, 2, 3]), 39)
    spec4 = four.build_connector_meta().reqs_to_recv["four"]
    assert [spec4.endpoint_for(r) for r in range(4)] == ["tcp://p:1"] * 2 + ["tcp://p:2"] * 2
    assert [spec4.reader(r) for r in range(4)] == [(0, 2), (1, 2), (0, 2), (1, 2)]
    one = TEConnectorScheduler("d1", BLOCK, wall_clock=wall, tp_size=1)
    one.get_num_new_matched_tokens(request("one", dict(params)), 0)
    one.update_state_after_alloc(request("one", dict(params)), blocks([1, 2, 3]), 39)
    spec1 = one.build_connector_meta().reqs_to_recv["one"]  # both prefill ranks' heads
    assert spec1.endpoint_for(0) == "tcp://p:1 + tcp://p:2" and spec1.reader(0) == (0, 1)
    assert spec1.endpoint_for(0, merge=False) == "tcp://p:1"  # a latent cache: one rank
    other = TEConnectorScheduler("d3", BLOCK, wall_clock=wall, tp_size=3)  # 2 and 3
    assert other.get_num_new_matched_tokens(request("o", dict(params)), 0) == (0, False)
    assert "must divide the other" in other.refused["o"]
    single = dict(params)
    del single["remote_endpoints"]
    assert decode.get_num_new_matched_tokens(request("one", single), 0) == (0, False)
    assert "remote_endpoints absent" in decode.refused["one"]
    assert RecvSpec("x", [1], [2], "tcp://p:9", "e", "r").endpoint_for(3) == "tcp://p:9"


def test_params_of_another_prompt_are_refused() -> None:
    wall = FakeClock()
    decode = TEConnectorScheduler("d", BLOCK, wall_clock=wall)
    params = _good_params(wall)
    other = request("other", dict(params))
    other.prompt_token_ids = [t + 1 for t in other.prompt_token_ids]
    assert decode.get_num_new_matched_tokens(other, 0) == (0, False)
    assert "another prompt" in decode.refused["other"]


@pytest.mark.parametrize("params", [None, "x", 5, [], {"do_remote_prefill": "yes"}])
def test_params_that_are_not_a_map_load_nothing(params: Any) -> None:
    decode = TEConnectorScheduler("d", BLOCK, wall_clock=FakeClock())
    assert decode.get_num_new_matched_tokens(request("n", params), 0) == (0, False)


def test_config_validation() -> None:
    cfg = TEConnectorConfig.from_extra_config({"host": "::1", "port": "7000",
                                               "transports": "shm,tcp", "lease_s": 5})
    assert cfg.transports == ("shm", "tcp") and cfg.port == 7000 and cfg.lease_s == 5
    with pytest.raises(ValueError, match="unknown"):
        TEConnectorConfig.from_extra_config({"lease": 5})
    with pytest.raises(ValueError):
        TEConnectorConfig(lease_s=0)


def test_serve_config() -> None:
    cfg = TEConnectorConfig.from_extra_config({"transports": "shm,tcp", "serve": "process"})
    assert cfg.serve == "process"
    assert TEConnectorConfig.from_extra_config({}).serve is None
    with pytest.raises(ValueError, match="serve"):
        TEConnectorConfig.from_extra_config({"serve": "fork"})
