"""Prefill and decode of different tensor-parallel sizes in real vLLM on CPU: prefill
at one rank holds both KV heads of a tiny model, decode at two ranks holds one head a
rank, and each decode rank reads its own head's slice of prefill's blocks; and the
other way round, prefill at two ranks, decode at one reading each prefill rank's head
into its blocks. The P/D
answers are the decode server's own greedy answers, token for token, and vLLM's metrics
on decode count the prompt's tokens as loaded over the connector (not computed).

Both servers run without prefix caching, so the decode server's own answer is computed
from scratch and the P/D one loads every prompt token but the last. Skipped where vLLM
is not importable (``scripts/test.sh`` runs it in the project's vLLM environment).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from bench.fleet import free_port
from bench.vllm_servers import build_model, by_source, http_json, launched, wait_healthy

CPUS = sorted(os.sched_getaffinity(0))

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(600),
    # vLLM's CPU workers wait for work spinning on their cores: prefill and a decode rank
    # sharing one core stall each other's engines for whole leases (also at TP 1/1)
    pytest.mark.skipif(len(CPUS) < 3, reason="needs 3 CPUs: one for each rank of "
                                             "prefill and decode"),
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None
                       and os.environ.get("TE_VLLM_REQUIRED") != "1",
                       reason="vllm is not installed (scripts/setup_vllm.sh installs the "
                              "CPU build)"),
]

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = [
    "prefill and decode transfer the memory of " * 6,  # 42 tokens: two blocks
    "one two three four five six seven eight nine ten " * 5,
    "fast slow red green blue one two three memory layer page token " * 9,  # four blocks
]


@pytest.fixture(scope="module", params=[(1, 2), (2, 1)], ids=["tp1to2", "tp2to1"])
def tp_servers(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
               ) -> Iterator[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("tp")
    model = tmp / "model"
    build_model(model, kv_heads=2)
    cfg = {"kv_connector": "TransferEngineConnector",
           "kv_connector_module_path": "transfer_engine.connectors.vllm",
           "kv_load_failure_policy": "recompute",
           "kv_connector_extra_config": {"lease_s": 120, "timeout_s": 30}}
    ports = {"prefill": free_port(), "decode": free_port()}
    sizes = dict(zip(("prefill", "decode"), request.param, strict=True))
    cores = iter(CPUS)  # a core each rank
    binds = {role: "|".join(str(next(cores)) for _ in range(n)) for role, n in sizes.items()}
    cmds = {role: [sys.executable, "-m", "vllm.entrypoints.openai.api_server",
                   "--model", str(model), "--port", str(ports[role]), "--dtype", "float32",
                   "--block-size", "32", "--max-model-len", "512", "--enforce-eager",
                   "--no-enable-prefix-caching", "--tensor-parallel-size",
                   str(sizes[role]), "--kv-transfer-config",
                   json.dumps(dict(cfg, kv_role=kv_role))]
            + (["--distributed-executor-backend", "mp"] if sizes[role] > 1 else [])
            for role, kv_role in (("prefill", "kv_producer"), ("decode", "kv_consumer"))}
    with contextlib.ExitStack() as stack:
        procs = {role: stack.enter_context(launched(
                     cmd, tmp / f"{role}.log",
                     dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", PYTHONPATH=str(ROOT),
                          VLLM_CPU_OMP_THREADS_BIND=binds[role])))
                 for role, cmd in cmds.items()}
        for role, proc in procs.items():
            wait_healthy(ports[role], proc, tmp / f"{role}.log", timeout=480)
        yield {"ports": ports, "model": str(model), "logs": tmp, "sizes": sizes}


def test_decode_ranks_load_their_heads_from_prefill_of_another_size(
        tp_servers: dict[str, Any]) -> None:
    ports, model = tp_servers["ports"], tp_servers["model"]
    for text in PROMPTS:
        began = time.monotonic()
        body = {"model": model, "prompt": text, "max_tokens": 12, "temperature": 0}
        status, own = http_json(ports["decode"], "POST", "/v1/completions", body,
                                timeout=120)
        assert status == 200, own
        status, first = http_json(ports["prefill"], "POST", "/v1/completions",
                                  dict(body, max_tokens=1,
                                       kv_transfer_params={"do_remote_decode": True}))
        assert status == 200, first
        answer = json.loads(first)
        params = answer["kv_transfer_params"]
        assert params is not None
        assert len(params["remote_endpoints"]) == tp_servers["sizes"]["prefill"]
        before = by_source(ports["decode"])
        status, pd = http_json(ports["decode"], "POST", "/v1/completions",
                               dict(body, kv_transfer_params=params), timeout=120)
        assert status == 200, pd
        after = by_source(ports["decode"])
        loaded = after.get("external_kv_transfer", 0) - before.get("external_kv_transfer", 0)
        prompt_tokens = json.loads(pd)["usage"]["prompt_tokens"]
        assert loaded == prompt_tokens - 1, (text, before, after)
        assert json.loads(pd)["choices"][0]["text"] == json.loads(own)["choices"][0]["text"]
        print(f"{prompt_tokens} prompt tokens: {time.monotonic() - began:.1f} s")
    log = (tp_servers["logs"] / "decode.log").read_text()
    assert "KV load from" not in log  # no load failed and was recomputed
