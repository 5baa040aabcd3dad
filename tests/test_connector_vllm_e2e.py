"""End to end in real vLLM on CPU: a prefill engine and a decode engine joined by our
connector give the same greedy tokens as one engine alone, and the decode engine's KV
really came over our engine (its transfer counters, not its logs). In the same engines,
the way vLLM's own connector tests check them: a load from a dead prefill engine is a
load error that vLLM recomputes (the output does not change), a lease that runs out
frees the blocks nobody read, and neither engine is left holding a block.

The README's deployment is run as written: two vLLM API servers (prefill, decode) and
``scripts/pd_proxy.py`` in front; the proxy's answers match the engine's own greedy
output and vLLM's metrics on the decode server count every prompt token as loaded over
the connector.

Each engine runs in its own process (``tests/helpers/vllm_pd_worker.py``) with a tiny
random-weight Llama and a word-level tokenizer built offline here: nothing is
downloaded. ``scripts/test.sh`` runs this in the project's vLLM environment
(``scripts/setup_vllm.sh``); elsewhere it is skipped where vLLM is not importable.
Prints the figures (``-s`` shows them): time to first token of the pair against the
single engine, the share of it spent moving KV, and bytes moved per request.
"""

from __future__ import annotations

import http.client
import importlib.util
import json
import os
import random
import secrets
import statistics
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from bench.vllm_servers import (
    WORDS,
    build_model,
    by_source,
    core_halves,
    http_json,
    te_grown,
    te_metrics,
    vllm_metrics,
)
from tests.helpers.openai_answers import alike, chat, completion, shape
from tests.helpers.vllm_engines import BLOCK_BYTES, BLOCK_SIZE, MAX_TOKENS, EngineProcess
from tests.helpers.vllm_pd import WARM_UP, pd_deployment

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(600),
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None
                       and os.environ.get("TE_VLLM_REQUIRED") != "1",
                       reason="vllm is not installed (scripts/setup_vllm.sh installs the "
                              "CPU build)"),
]

ROOT = Path(__file__).resolve().parent.parent
PREFIX = "one two three four five six seven eight nine ten " * 4  # 40 tokens > 1 block
PROMPTS = [
    "the cache block of the engine",                       # under one block
    "prefill and decode transfer the memory of " * 10,     # 70 tokens: three blocks
    PREFIX + "red green blue",                             # shares 40 tokens ...
    PREFIX + "fast slow fast slow",                        # ... with this one
]
BLOCKS_READ = 1 + 3 + 2 + 1  # the fourth finds the shared 32-token block cached on decode
DEAD_PEER = "model memory layer page token " * 8  # its load is sent to a dead endpoint
FIGURE_LENGTHS = (20, 100, 250, 470)  # prompt tokens: 1, 4, 8 and 15 blocks
FIGURE_ROUNDS = 5
LEASE_S = 3.0  # the prefill engine's lease: blocks nobody reads are held this long


@pytest.fixture(scope="module")
def pd_servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """The README's deployment as written (see :func:`pd_deployment`)."""
    with pd_deployment(tmp_path_factory.mktemp("pd")) as servers:
        yield servers


def test_proxy_between_vllm_servers(pd_servers: dict[str, Any]) -> None:
    """Both hand-offs give the single server's text, and vLLM's metrics on the decode
    server count the prompt as loaded over the connector: all of prefill's prompt in the
    first-token hand-off (decode computes prefill's first token), all but its last
    token in the sequential one (decode computes that token to sample the next)."""
    ports, model = pd_servers["ports"], pd_servers["model"]
    te_before = te_metrics(ports["decode"]), te_metrics(ports["prefill"])
    for handoff in ("sequential", "first"):
        before = by_source(ports["decode"])
        prompt_tokens = requests = 0
        for prompt, stream in ((PROMPTS[1], True), (PROMPTS[2], False)):
            prompt = f"{handoff} {prompt}"  # nothing cached on decode from the last round
            body = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS,
                    "temperature": 0}
            ref = completion(ports["prefill"], body)
            prompt_tokens += ref["usage"]["prompt_tokens"]
            requests += 1
            got = completion(ports[handoff], dict(body, stream=True, stream_options={
                "include_usage": True}) if stream else body)
            assert got == ref, handoff
        after = by_source(ports["decode"])
        loaded = after.get("external_kv_transfer", 0) - before.get("external_kv_transfer", 0)
        computed = after.get("local_compute", 0) - before.get("local_compute", 0)
        assert loaded == prompt_tokens - (requests if handoff == "sequential" else 0), (
            handoff, before, after)
        assert computed == requests, (handoff, before, after)
    # the connector's stats reached vLLM's /metrics: four loads in the admitting step,
    # their bytes and times on decode; four requests whose blocks were read on prefill
    # prefill learns of decode's read at a later step, /metrics after it
    sent = te_grown(ports["prefill"], te_before[1], "te_kv_sent_requests_total", 4, model,
                    timeout=30.0)
    dec = te_metrics(ports["decode"])
    grew = {k: v - te_before[0].get(k, 0) for k, v in dec.items()}
    assert grew["te_kv_loads_total"] == grew["te_kv_sync_loads_total"] == 4, grew
    # the sequential proxy's loads after decode's first forward (which taught it the
    # layer order) read layer by layer; the first-token proxy's (--push) copied pushed
    # KV (the first push to a decode worker may miss: its lane is being granted)
    assert grew["te_kv_layered_loads_total"] >= 1, grew
    assert grew["te_kv_pushed_loads_total"] >= 1, grew
    assert grew["te_kv_layered_loads_total"] + grew["te_kv_pushed_loads_total"] >= 3, grew
    assert grew.get("te_kv_load_failures_total", 0) == 0, grew
    assert grew["te_kv_load_bytes_total"] > 0 and grew["te_kv_load_seconds_count"] == 4, grew
    assert sent == 4, te_metrics(ports["prefill"])

    # a prompt under --local-below (default 64 tokens) is prefilled on decode
    body = {"model": model, "prompt": PROMPTS[0], "max_tokens": MAX_TOKENS,
            "temperature": 0}
    ref = completion(ports["prefill"], body)
    assert ref["usage"]["prompt_tokens"] < 64
    before = by_source(ports["decode"])
    assert completion(ports["first"], body) == ref
    after = by_source(ports["decode"])
    assert after["local_compute"] - before["local_compute"] == ref["usage"]["prompt_tokens"]
    assert after["external_kv_transfer"] == before["external_kv_transfer"]


def test_replayed_params_are_computed_not_loaded(pd_servers: dict[str, Any]) -> None:
    """The same kv_transfer_params sent to decode twice (a client replaying prefill's
    answer): the first request loads the KV, the second is computed by decode (prefill
    may have reused the blocks by then), both answers are the single server's."""
    ports, model = pd_servers["ports"], pd_servers["model"]
    prompt = "replay " + PROMPTS[1]
    body = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
    ref = completion(ports["prefill"], body)
    status, raw = http_json(ports["prefill"], "POST", "/v1/completions", dict(
        body, max_tokens=1, kv_transfer_params={"do_remote_decode": True}))
    assert status == 200, raw
    params = json.loads(raw)["kv_transfer_params"]
    assert params and params["do_remote_prefill"], params
    before = by_source(ports["decode"])
    first = completion(ports["decode"], dict(body, kv_transfer_params=dict(params)))
    mid = by_source(ports["decode"])
    again = completion(ports["decode"], dict(body, kv_transfer_params=dict(params)))
    after = by_source(ports["decode"])
    assert first == ref and again == ref
    tokens = ref["usage"]["prompt_tokens"]
    assert mid["external_kv_transfer"] - before.get("external_kv_transfer", 0) == tokens - 1
    assert after["external_kv_transfer"] == mid["external_kv_transfer"]  # not loaded


def test_pushed_kv_is_copied_once_and_only_for_its_prompt(pd_servers: dict[str, Any]
                                                          ) -> None:
    """The router's push, by hand: decode says where its workers are, prefill pushes a
    request's KV into a room there, decode copies it with no READ (the single server's
    answer). The same params again (the room id reused by another client) and another
    prompt's params naming the room are not served from it: computed or read, exact."""
    ports, model = pd_servers["ports"], pd_servers["model"]
    status, raw = http_json(ports["decode"], "POST", "/v1/completions", {
        "model": model, "prompt": ".", "max_tokens": 1,
        "kv_transfer_params": {"te_probe": True}})
    assert status == 200, raw
    workers = json.loads(raw)["kv_transfer_params"]["te_endpoints"]
    assert workers and all(w.startswith("tcp://") for w in workers), workers

    def handed_over(prompt: str, room: str | None) -> tuple[dict[str, Any], dict[str, Any]]:
        body = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS,
                "temperature": 0}
        ask: dict[str, Any] = {"do_remote_decode": True}
        if room is not None:
            ask["push"] = {"room": room, "to": workers}
        status, raw = http_json(ports["prefill"], "POST", "/v1/completions",
                                dict(body, max_tokens=1, kv_transfer_params=ask))
        assert status == 200, raw
        return body, json.loads(raw)["kv_transfer_params"]

    for i in range(4):  # a load may come before a push has landed: it reads instead
        room = secrets.token_urlsafe(24)
        body, params = handed_over(f"push {i} " + PROMPTS[1], room)
        assert params["push_room"] == room
        before = te_metrics(ports["decode"])
        assert completion(ports["decode"], dict(body, kv_transfer_params=params)) == \
            completion(ports["prefill"], body)
        if te_grown(ports["decode"], before, "te_kv_pushed_loads_total", 1, model,
                    timeout=3.0) == 1:
            break
    else:
        raise AssertionError("no load was copied from a pushed room")
    mid = te_metrics(ports["decode"])  # the same params again: a replay, computed
    assert completion(ports["decode"], dict(body, kv_transfer_params=params)) == \
        completion(ports["prefill"], body)
    # another prompt's hand-over naming the room: not its prompt, read from prefill
    other, params2 = handed_over("push other " + PROMPTS[1], None)
    assert completion(ports["decode"], dict(other, kv_transfer_params=dict(
        params2, push_room=room))) == completion(ports["prefill"], other)
    assert te_grown(ports["decode"], mid, "te_kv_loads_total", 1, model) == 1
    assert te_metrics(ports["decode"]).get("te_kv_pushed_loads_total") == \
        mid["te_kv_pushed_loads_total"]


def test_first_token_handoff_is_the_single_servers_answer(pd_servers: dict[str, Any]
                                                          ) -> None:
    """The first-token hand-off answers exactly as one server: streamed or not,
    max_tokens=1, stop strings (inside decode's part and across the join), a first
    token that is a stop token, first tokens ending inside a UTF-8 character, usage
    and token ids."""
    ports, model, tok = pd_servers["ports"], pd_servers["model"], pd_servers["tokenizer"]
    rng = random.Random(11)
    split_chars = 0
    for i in range(8):
        prompt = " ".join(rng.choice(WORDS) for _ in range(40 + 37 * i))
        base = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS,
                "temperature": 0, "return_token_ids": True}
        ref = completion(ports["prefill"], base)
        first = ref["token_ids"][0]
        split_chars += "\ufffd" in tok.decode([first])
        cases = [base, dict(base, stream=True, stream_options={"include_usage": True}),
                 dict(base, max_tokens=1), dict(base, max_tokens=1, stream=True),
                 dict(base, stop_token_ids=[first]), dict(base, ignore_eos=True),
                 dict(base, stream=True, stop_token_ids=[ref["token_ids"][3]])]
        text = ref["text"]
        if len(text) > 6:
            cases += [dict(base, stop=[text[4:6]]), dict(base, stream=True, stop=text[4:6]),
                      dict(base, stop=[text[:2]], include_stop_str_in_output=True)]
        for body in cases:
            want = completion(ports["prefill"], body)
            got = completion(ports["first"], body)
            assert got == want, body
    assert split_chars, "no first token ended inside a UTF-8 character"


def test_client_gone_mid_handoff_leaks_nothing(pd_servers: dict[str, Any]) -> None:
    """Clients that hang up at each point of the first-token hand-off (before any
    token, after prefill's first token, while decode streams): decode's requests end,
    each of prefill's holds ends (read, or its lease ran out), and the next request is
    answered as the single server answers it."""
    ports, model = pd_servers["ports"], pd_servers["model"]
    rng = random.Random(5)
    # prefill's worker counts a hold at the step after its request ended: steps first,
    # so that an earlier test's last hold is not counted as one of these
    for _ in range(2):
        completion(ports["prefill"], {"model": model, "prompt": "tick", "max_tokens": 1})
    held_before = te_metrics(ports["prefill"])
    cuts = (0, 1, 3, 1, 3)
    for lines in cuts:
        prompt = " ".join(rng.choice(WORDS) for _ in range(120))
        body = {"model": model, "prompt": prompt, "max_tokens": 400, "temperature": 0,
                "ignore_eos": True, "stream": True}
        conn = http.client.HTTPConnection("127.0.0.1", ports["first-all"], timeout=60)
        try:
            conn.request("POST", "/v1/completions", json.dumps(body).encode(),
                         {"Content-Type": "application/json"})
            resp = conn.getresponse()
            assert resp.status == 200
            seen = 0
            while seen < lines:
                line = resp.readline()
                assert line, "stream ended early"
                seen += line.startswith(b"data: ")
        finally:
            conn.close()  # the client is gone
    # every hold of prefill's (these and any an earlier test left) ends, read by decode
    # or at the end of its lease (30 s); prefill acts on both at a step, so it is given
    # some
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        now = te_metrics(ports["prefill"])
        held = now.get("te_kv_holds_total", 0) - held_before.get("te_kv_holds_total", 0)
        open_holds = now.get("te_kv_holds_total", 0) - sum(now.get(k, 0) for k in (
            "te_kv_sent_requests_total", "te_kv_lease_expired_total"))
        running = vllm_metrics(ports["decode"], "num_requests_running").get(
            "num_requests_running", 0.0)
        if held == len(cuts) and not open_holds and not running:
            break
        completion(ports["prefill"], {"model": model, "prompt": "tick", "max_tokens": 1})
        time.sleep(0.5)
    assert (held, open_holds, running) == (len(cuts), 0, 0), (held, open_holds, running)
    body = {"model": model, "prompt": "after " + PROMPTS[2], "max_tokens": MAX_TOKENS,
            "temperature": 0}
    assert completion(ports["first-all"], body) == completion(ports["prefill"], body)


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The engines, started once for the module (about a minute on two cores); decode
    loads in the admitting step (the default), decode-async beside the forward."""
    tmp_path = tmp_path_factory.mktemp("vllm")
    model = tmp_path / "model"
    build_model(model)
    # prefill serves decode's READs from a serving process: its model runner is the busy
    # Python thread of a P/D pull
    extra = {"prefill": {"lease_s": LEASE_S, "serve": "process"}, "decode": {"timeout_s": 3.0},
             "decode-async": {"timeout_s": 3.0, "load": "async"}, "single": {}}
    # prefill and decode on cores of their own, as on two hosts; the single engine on
    # prefill's (they never run at the same time): one engine's worth of CPU each
    first, second = core_halves()
    cores = {"prefill": first, "decode": second, "decode-async": second, "single": first}
    procs = {role: EngineProcess(role, model, tmp_path / f"{role}.log", extra[role],
                                 cores[role])
             for role in ("prefill", "decode", "decode-async", "single")}
    try:
        for proc in procs.values():
            proc.recv()  # ready
        yield procs
    finally:
        for proc in procs.values():
            proc.close()


def disaggregated(prefill: EngineProcess, decode: EngineProcess, prompt: str,
                  max_tokens: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """What the proxy does: one token from prefill, then decode with its params."""
    pre = prefill.generate(prompt, 1, {"do_remote_decode": True})
    params = pre["params"]
    assert params and params["do_remote_prefill"] and params["remote_block_ids"], params
    return pre, decode.generate(prompt, max_tokens, params)


@pytest.mark.parametrize("decoder", ["decode", "decode-async"])
def test_disaggregated_pair_matches_single_engine(engines: dict[str, EngineProcess],
                                                  decoder: str) -> None:
    single, prefill, decode = engines["single"], engines["prefill"], engines[decoder]
    single.generate(WARM_UP, 2)
    disaggregated(prefill, decode, WARM_UP, 2)
    prefill.call(op="drain")  # a finished request's hold reaches its worker a step later
    base = decode.call(op="stats")
    base_conn, base_eng = base["connector"], base["engine"]
    base_pre = prefill.call(op="stats")["connector"]

    refs = [single.generate(prompt, MAX_TOKENS) for prompt in PROMPTS]
    pairs = [disaggregated(prefill, decode, prompt, MAX_TOKENS) for prompt in PROMPTS]
    for ref, (pre, dec) in zip(refs, pairs, strict=True):
        assert dec["tokens"] == ref["tokens"]
        assert pre["tokens"] == ref["tokens"][:1]

    # The decode engine's KV came over our engine: one READ per request, every block.
    stats = decode.call(op="stats")
    conn, eng = stats["connector"], stats["engine"]
    assert conn["recv_requests"] - base_conn["recv_requests"] == len(PROMPTS)
    assert conn["recv_failed"] == base_conn["recv_failed"]
    assert conn["recv_bytes"] - base_conn["recv_bytes"] == BLOCKS_READ * BLOCK_BYTES
    assert eng["transfers_done"] - base_eng["transfers_done"] >= len(PROMPTS)
    assert eng["bytes_read"] - base_eng["bytes_read"] >= BLOCKS_READ * BLOCK_BYTES

    # Prefill freed every held block once decode read it (no leak, no lease expiry).
    drained = prefill.call(op="drain")
    assert drained["held"] == 0 and drained["free_blocks"] == drained["total_blocks"]
    pstats = prefill.call(op="stats")["connector"]
    assert pstats["sent_requests"] - base_pre["sent_requests"] == len(PROMPTS)
    assert pstats["lease_expired"] == base_pre["lease_expired"]


@pytest.mark.parametrize("decoder", ["decode", "decode-async"])
def test_dead_prefill_is_a_load_error_and_an_unread_lease_runs_out(
        engines: dict[str, EngineProcess], decoder: str) -> None:
    single, prefill, decode = engines["single"], engines["prefill"], engines[decoder]
    base = decode.call(op="stats")["connector"]
    base_pre = prefill.call(op="stats")["connector"]
    ref = single.generate(DEAD_PEER, MAX_TOKENS)
    pre = prefill.generate(DEAD_PEER, 1, {"do_remote_decode": True})
    # The prefill engine died: nothing answers at its endpoint. Decode's handshake runs
    # out (timeout_s), the load is reported as failed, and vLLM recomputes the prompt.
    params = dict(pre["params"], remote_endpoint="tcp://127.0.0.1:9",
                  remote_endpoints=["tcp://127.0.0.1:9"])
    dec = decode.generate(DEAD_PEER, MAX_TOKENS, params)
    assert dec["tokens"] == ref["tokens"]
    conn = decode.call(op="stats")["connector"]
    assert conn["recv_requests"] - base["recv_requests"] == 1
    assert conn["recv_failed"] - base["recv_failed"] == 1
    assert conn["recv_bytes"] == base["recv_bytes"]

    # Nobody read the prefill engine's blocks for it: the lease frees them.
    drained = prefill.call(op="drain")
    assert drained["held"] == 0 and drained["free_blocks"] == drained["total_blocks"]
    pstats = prefill.call(op="stats")["connector"]
    assert pstats["lease_expired"] - base_pre["lease_expired"] == 1
    assert pstats["sent_requests"] == base_pre["sent_requests"]

    # And the decode engine holds no block either: the failed load gave its blocks back.
    drained = decode.call(op="drain")
    assert drained["free_blocks"] == drained["total_blocks"]


def test_figures_ttft_and_kv_share(engines: dict[str, EngineProcess]) -> None:
    """Time to first token of the pair against the single engine on the same prompts,
    the share of it spent moving KV, bytes moved per request; medians of a few rounds of
    fresh random prompts (no prefix-cache hits), each checked token-identical too."""
    single, prefill, decode = engines["single"], engines["prefill"], engines["decode"]
    single.generate(WARM_UP, 2)
    disaggregated(prefill, decode, WARM_UP, 2)
    rng = random.Random(5)
    samples: dict[int, list[dict[str, float]]] = {n: [] for n in FIGURE_LENGTHS}
    for _ in range(FIGURE_ROUNDS):
        for n in FIGURE_LENGTHS:
            prompt = " ".join(rng.choice(WORDS) for _ in range(n))
            before = decode.call(op="stats")["connector"]
            ref = single.generate(prompt, MAX_TOKENS)
            pre, dec = disaggregated(prefill, decode, prompt, MAX_TOKENS)
            after = decode.call(op="stats")["connector"]
            assert dec["tokens"] == ref["tokens"]
            moved = after["recv_bytes"] - before["recv_bytes"]
            assert moved == -(-n // BLOCK_SIZE) * BLOCK_BYTES
            assert after["recv_failed"] == before["recv_failed"]
            kv_s = after["recv_seconds"][-1]
            samples[n].append({"single": ref["ttft"], "pair": pre["ttft"] + dec["ttft"],
                               "prefill": pre["ttft"], "decode": dec["ttft"], "kv": kv_s,
                               "bytes": moved})
    drained = prefill.call(op="drain")
    assert drained["held"] == 0 and drained["free_blocks"] == drained["total_blocks"]

    def med(n: int, key: str) -> float:
        return statistics.median(s[key] for s in samples[n])

    rows = [{"prompt_tokens": n, "kv_bytes": int(med(n, "bytes")),
             "single_ttft_ms": round(med(n, "single") * 1e3, 2),
             "pair_ttft_ms": round(med(n, "pair") * 1e3, 2),
             "pair_over_single": round(med(n, "pair") / med(n, "single"), 2),
             "prefill_ttft_ms": round(med(n, "prefill") * 1e3, 2),
             "decode_ttft_ms": round(med(n, "decode") * 1e3, 2),
             "kv_ms": round(med(n, "kv") * 1e3, 2),
             "kv_share_of_pair_ttft": round(med(n, "kv") / med(n, "pair"), 3)}
            for n in FIGURE_LENGTHS]
    # The pair's TTFT is prefill's plus decode's (the proxy's HTTP hops are not in it);
    # kv_ms runs from the decode worker issuing the READ to seeing it done.
    print(f"\nvLLM P/D figures (medians of {FIGURE_ROUNDS} rounds):")
    for row in rows:
        print(" ", json.dumps(row))


def test_first_token_handoff_chat(pd_servers: dict[str, Any]) -> None:
    """Chat completions through the first-token hand-off: prefill applies the chat
    template, decode continues from its token ids; the content is one server's."""
    ports, model = pd_servers["ports"], pd_servers["model"]
    before = by_source(ports["decode"])
    for i, stream in enumerate((False, True, False)):
        body = {"model": model, "temperature": 0,
                "max_completion_tokens": MAX_TOKENS, "messages": [
                    {"role": "user", "content": f"chat {i} " + PROMPTS[1]}]}
        want = chat(ports["prefill"], body)
        if i == 2:
            body["stop"] = [want["text"][3:5]]
            want = chat(ports["prefill"], body)
        if stream:
            body = dict(body, stream=True, stream_options={"include_usage": True})
        assert chat(ports["first"], body) == want, body
    after = by_source(ports["decode"])
    assert after["local_compute"] - before["local_compute"] == 3  # the first tokens


def test_first_token_handoff_events_have_the_single_servers_keys(
        pd_servers: dict[str, Any]) -> None:
    """A strict client sees the keys a single server sends, event by event: chat's
    opening event with the role alone, nulls where vLLM writes nulls, the fingerprint
    on the last event, usage without the empty details in a stream (with them in a
    whole answer)."""
    ports, model = pd_servers["ports"], pd_servers["model"]
    prompt = " ".join(WORDS[i % len(WORDS)] for i in range(70))
    for path in ("/v1/completions", "/v1/chat/completions"):
        base: dict[str, Any] = {"model": model, "temperature": 0, "max_tokens": 6}
        base.update({"messages": [{"role": "user", "content": prompt}]} if "chat" in path
                    else {"prompt": prompt})
        for extra in ({}, {"stream": True}, {"return_token_ids": True, "stream": True},
                      {"stream": True, "stream_options": {"include_usage": True}},
                      {"max_tokens": 1, "stream": True}):
            body = dict(base, **extra)
            got, want = shape(ports["first"], path, body), shape(ports["prefill"], path, body)
            assert alike(got, want), (path, extra, got, want)


def test_pd_serving_bench_runs_and_draws(tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                         ) -> None:
    """The README's serving benchmark, at its smallest: its rows carry every route's
    times, the running streams' gaps, the connector's phases, vLLM's count of the
    prompt tokens decode loaded and whether each hand-off answered as prefill alone
    does; the chart is drawn."""
    from bench.pd_serving import main

    main(["--layers", "2", "--hidden", "128", "--tokens", "32", "64", "--streams", "0", "2",
          "--rounds", "1", "--transports", "tcp", "--handoffs", "first",
          "--plot", str(tmp_path / "chart.png")])
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()
            if line.startswith("{")]
    assert [(r["prompt_tokens"], r["decode_streams"]) for r in rows] == [
        (32, 0), (32, 2), (64, 0), (64, 2)]
    for row in rows:
        assert row["local_ttft_ms_p50"] > 0 and row["first_second_ms_p90"] > 0
        assert row["phases"]["loads"] == 1 and row["phases"]["load_failures"] == 0
        assert row["identical"] is True
        tokens = row["prompt_tokens"]
        assert row["external_kv_tokens"] == row["external_kv_tokens_expected"] == tokens
        assert ("gap_p99_ms_during_local" in row) == (row["decode_streams"] > 0)
    assert any(tmp_path.glob("chart.*"))
