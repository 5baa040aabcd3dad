"""A vLLM engine in its own process, driven over stdin/stdout by the e2e tests.

    python tests/helpers/vllm_pd_worker.py ROLE MODEL_DIR
        ROLE: single | prefill | decode | both (kv_both: store mode, P/D either way)

Reads one JSON command per line; answers one line starting with ``@@TE@@ `` (vLLM's
own output goes to stderr/stdout around it). Commands:

    {"op": "generate", "prompts": [...], "max_tokens": N, "params": [... or null]}
        -> {"tokens": [[...]], "params": [...], "wall": [s...], "ttft": [s...]}
    {"op": "drain"}   steps the engine (30 s at most) until the connector holds no
                      blocks and every KV block is free again
        -> {"held": n, "free_blocks": n, "total_blocks": n}
    {"op": "stats"}   -> the worker connector's counters and its engine's
    {"op": "metrics"} -> vLLM's prompt-token counters: {"source": tokens}, from
                      ``vllm:prompt_tokens_by_source``
    {"op": "quit"}
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

BLOCK_SIZE = 32


def _reply(obj: Any) -> None:
    # default=list: the connector keeps its latest load times in a bounded deque
    sys.stdout.write("@@TE@@ " + json.dumps(obj, default=list) + "\n")
    sys.stdout.flush()


def _make_llm(role: str, model: str) -> Any:
    from vllm import LLM

    kwargs: dict[str, Any] = {}
    if role != "single":
        kwargs["kv_transfer_config"] = {
            "kv_connector": "TransferEngineConnector",
            "kv_connector_module_path": "transfer_engine.connectors.vllm",
            "kv_role": {"prefill": "kv_producer", "decode": "kv_consumer",
                        "both": "kv_both"}[role.partition("-")[0]],  # decode-async...
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": json.loads(
                os.environ.get("TE_VLLM_EXTRA", "{}")),
        }
    return LLM(model=model, dtype="float32", block_size=BLOCK_SIZE, max_model_len=512,
               enforce_eager=True, seed=0, disable_log_stats=False,
               enable_prefix_caching=True, gpu_memory_utilization=0.5, **kwargs)


def _worker() -> Any:
    from transfer_engine.connectors.vllm import live_workers

    workers = live_workers()
    return workers[0] if workers else None


def main() -> None:
    role, model = sys.argv[1], sys.argv[2]
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from vllm import SamplingParams

    llm = _make_llm(role, model)
    _reply({"ready": True})
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["op"]
        if op == "quit":
            break
        if op == "generate":
            out: dict[str, list[Any]] = {"tokens": [], "params": [], "wall": [], "ttft": []}
            params = cmd.get("params") or [None] * len(cmd["prompts"])
            for prompt, kvp in zip(cmd["prompts"], params, strict=True):
                extra = {"kv_transfer_params": kvp} if kvp is not None else None
                sp = SamplingParams(temperature=0, max_tokens=cmd["max_tokens"],
                                    ignore_eos=True, extra_args=extra)
                t0 = time.perf_counter()
                res = llm.generate([prompt], sp, use_tqdm=False)[0]
                out["wall"].append(time.perf_counter() - t0)
                metrics = getattr(res, "metrics", None)
                out["ttft"].append(getattr(metrics, "first_token_latency", None))
                out["tokens"].append(list(res.outputs[0].token_ids))
                out["params"].append(res.kv_transfer_params)
            _reply(out)
        elif op == "drain":
            worker = _worker()
            core = llm.llm_engine.engine_core.engine_core
            pool = core.scheduler.kv_cache_manager.block_pool
            total = pool.num_gpu_blocks - 1  # block 0 is the null block
            deadline = time.monotonic() + 30
            # a finished request's hold reaches the worker only with the next step
            while time.monotonic() < deadline:
                llm.llm_engine.step()
                if (worker is None or not worker.held) and pool.get_num_free_blocks() == total:
                    break
                time.sleep(0.01)
            _reply({"held": worker.held if worker else 0,
                    "free_blocks": pool.get_num_free_blocks(), "total_blocks": total})
        elif op == "metrics":
            by_source: dict[str, float] = {}
            for metric in llm.get_metrics():
                if metric.name == "vllm:prompt_tokens_by_source":
                    source = metric.labels.get("source", "")
                    by_source[source] = by_source.get(source, 0) + metric.value
            _reply(by_source)
        elif op == "stats":
            worker = _worker()
            if worker is None:
                _reply({})
            else:
                engine_stats = dict(worker.engine.stats) if worker.engine else {}
                layouts = {n: str(lay) for n, lay in worker.layouts.items()}
                _reply({"connector": worker.stats, "engine": engine_stats,
                        "layouts": layouts})
    worker = _worker()
    if worker is not None:
        worker.close()


if __name__ == "__main__":
    main()
