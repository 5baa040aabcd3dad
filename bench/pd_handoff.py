"""P/D hand-off benchmark on vLLM (CPU build): time to first token of fresh prompts sent
straight to decode (it prefills them itself), through ``scripts/pd_proxy.py``'s
first-token hand-off and through its sequential one, on an idle decode server and on
one running other streams, with the time to the second token (decode's share of the
hand-off); prefill's own answer time is measured too, so the router's share shows.
Two vLLM API servers with the connector (one core each) and two routers are started;
the model is the e2e tests' random Llama with a byte-level tokenizer, with ``--layers``
layers::

    PYTHONPATH=. .venv-vllm/bin/python -m bench.pd_handoff --layers 16 --tokens 512 \\
        --streams 0 16 --rounds 8

Routes are interleaved per round (medians reported), which keeps the ratios honest on
a shared machine. Prints one JSON line per load.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def stream_times(port: int, body: dict[str, Any]) -> tuple[float, float]:
    """Seconds from sending a streamed completion to its first and second data lines
    (one per token, but for text a token leaves unfinished)."""
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    try:
        t0 = time.perf_counter()
        conn.request("POST", "/v1/completions", json.dumps(dict(body, stream=True)).encode(),
                     {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {resp.read()[:200]!r}")
        seen: list[float] = []
        for line in iter(resp.readline, b""):
            if line.startswith(b"data: ") and not line.startswith(b"data: [DONE]"):
                seen.append(time.perf_counter() - t0)
                if len(seen) == 2:
                    resp.read()
                    break
        if not seen:
            raise RuntimeError("no data line")
        return seen[0], seen[-1]
    finally:
        conn.close()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=512, help="prompt tokens")
    ap.add_argument("--streams", type=int, nargs="+", default=[0, 16],
                    help="other streams decode runs meanwhile, one run each")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--transports", default="",
                    help="the connector's transports, best first (default: the engine's)")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from tests import test_connector_vllm_e2e as e2e

    with tempfile.TemporaryDirectory() as tmp_dir, contextlib.ExitStack() as stack:
        tmp = Path(tmp_dir)
        model = tmp / "model"
        e2e.build_byte_model(model)
        cfg = json.loads((model / "config.json").read_text())
        torch.manual_seed(1)
        LlamaForCausalLM(LlamaConfig(**{**cfg, "num_hidden_layers": args.layers})
                         ).save_pretrained(model)
        ports = {"prefill": e2e.free_port(), "decode": e2e.free_port()}
        kv = {"kv_connector": "TransferEngineConnector",
              "kv_connector_module_path": "transfer_engine.connectors.vllm",
              "kv_load_failure_policy": "recompute"}
        if args.transports:
            kv["kv_connector_extra_config"] = {"transports": args.transports}
        procs = {}
        for (role, kv_role), cores in zip((("prefill", "kv_producer"),
                                           ("decode", "kv_consumer")), e2e.core_halves(),
                                          strict=True):
            cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model",
                   str(model), "--port", str(ports[role]), "--dtype", "float32",
                   "--block-size", "32", "--max-model-len", str(2 * args.tokens),
                   "--enforce-eager", "--kv-transfer-config",
                   json.dumps(dict(kv, kv_role=kv_role))]
            procs[role] = stack.enter_context(e2e.launched(cmd, tmp / f"{role}.log", dict(
                os.environ, VLLM_CPU_KVCACHE_SPACE="1", PYTHONPATH=str(ROOT),
                VLLM_CPU_OMP_THREADS_BIND=cores)))
        for handoff in ("first", "sequential"):
            cmd = [sys.executable, str(ROOT / "scripts" / "pd_proxy.py"), "--port", "0",
                   "--prefill", f"http://127.0.0.1:{ports['prefill']}", "--decode",
                   f"http://127.0.0.1:{ports['decode']}", "--handoff", handoff,
                   "--local-below", "0"]
            stack.enter_context(e2e.launched(cmd, tmp / f"proxy-{handoff}.log",
                                             dict(os.environ)))
        for role, proc in procs.items():
            e2e.wait_healthy(ports[role], proc, tmp / f"{role}.log")
        for handoff in ("first", "sequential"):
            log = tmp / f"proxy-{handoff}.log"
            while not (found := re.search(r"pd_proxy on http://[\d.]+:(\d+)",
                                          log.read_text())):
                time.sleep(0.1)
            ports[handoff] = int(found.group(1))
        tok = AutoTokenizer.from_pretrained(model)
        rng = random.Random(7)
        name = str(model)

        def prompt() -> list[int]:  # fresh: nothing of it cached anywhere
            text = " ".join(rng.choice(e2e.WORDS) for _ in range(args.tokens))
            return list(tok(text)["input_ids"][:args.tokens])

        for streams in args.streams:
            stop = threading.Event()

            def load(k: int, stop: threading.Event = stop) -> None:
                body = {"model": name, "prompt": " ".join(e2e.WORDS[k:k + 20]),
                        "max_tokens": 128, "temperature": 0, "ignore_eos": True}
                while not stop.is_set():
                    e2e.http_json(ports["decode"], "POST", "/v1/completions", body,
                                  timeout=600)

            threads = [threading.Thread(target=load, args=(k,), daemon=True)
                       for k in range(streams)]
            for t in threads:
                t.start()
            time.sleep(3 if streams else 0)
            times: dict[str, list[float]] = {"local": [], "first": [], "sequential": [],
                                             "prefill_answer": []}
            second: dict[str, list[float]] = {"local": [], "first": [], "sequential": []}
            try:
                for _ in range(args.rounds):
                    for route in times:
                        body: dict[str, Any] = {"model": name, "prompt": prompt(),
                                                "max_tokens": 4, "temperature": 0}
                        if route == "prefill_answer":  # what the router waits for
                            t0 = time.perf_counter()
                            e2e.http_json(ports["prefill"], "POST", "/v1/completions", dict(
                                body, max_tokens=1, return_token_ids=True,
                                kv_transfer_params={"do_remote_decode": True}))
                            times[route].append(time.perf_counter() - t0)
                        else:
                            port = ports["decode" if route == "local" else route]
                            t1, t2 = stream_times(port, body)
                            times[route].append(t1)
                            second[route].append(t2)
            finally:
                stop.set()
                for t in threads:
                    t.join(600)
            med = {k: statistics.median(v) for k, v in times.items()}
            med2 = {k: statistics.median(v) for k, v in second.items()}
            print(json.dumps({"layers": args.layers, "prompt_tokens": args.tokens,
                              "transports": args.transports or "default",
                              "decode_streams": streams,
                              **{f"{k}_ttft_ms": round(v * 1e3, 1) for k, v in med.items()},
                              "first_over_local": round(med["first"] / med["local"], 2),
                              "sequential_over_local": round(med["sequential"]
                                                             / med["local"], 2),
                              **{f"{k}_second_ms": round(v * 1e3, 1)
                                 for k, v in med2.items()},
                              "first_second_over_local": round(med2["first"]
                                                               / med2["local"], 2)}),
                  flush=True)


if __name__ == "__main__":
    main()
