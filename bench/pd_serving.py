"""P/D serving benchmark on vLLM (CPU build): fresh prompts sent straight to decode
(it prefills them itself: "local") and through ``scripts/pd_proxy.py``'s hand-offs (the
first-token one also with prefill's push: ``--handoffs first first-push``), on an idle
decode server and on one decoding other streams, per transport. Reports, per
route, time to the first and to the second token (p50/p90), the running streams'
inter-token gap p99 while each kind of request is in flight, and the hand-off's phases
from the connector's own metrics (decode's load, prefill's wait for decode to read);
``--plot`` draws the medians. Starts everything itself: a random Llama with a
byte-level tokenizer built offline (``--layers``, ``--hidden``), two vLLM API servers
with the connector, each on a core of its own (the whole server, under ``taskset``: two
one-core hosts), and a router per hand-off::

    PYTHONPATH=. .venv-vllm/bin/python -m bench.pd_serving --layers 16 --tokens 512 \\
        --streams 0 16 --rounds 8 --transports shm tcp --plot results/pd_serving.png

Routes are interleaved per round and one request is probed at a time, which keeps the
ratios honest on a shared machine; ``*_over_local`` divides the medians, ``*_paired`` is
the median of each round's own ratio. Prints one JSON line per transport and load.
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import functools
import json
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from bench.vllm_servers import by_source, http_json, stream_times, te_metrics

ROOT = Path(__file__).resolve().parent.parent
HANDOFFS = {"first": ["--handoff", "first"],
            "first-push": ["--handoff", "first", "--push"],
            "sequential": ["--handoff", "sequential"]}


def quantile(values: list[float], q: float) -> float:
    """The q-quantile by linear interpolation (statistics' method, any length)."""
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[round(q * 100) - 1]


def gaps_in(windows: list[tuple[float, float]], gaps: list[tuple[float, float]]
            ) -> list[float]:
    """The gaps (end time, length) that end inside one of the windows (sorted, apart)."""
    starts = [w[0] for w in windows]
    out = []
    for end, length in gaps:
        i = bisect.bisect_right(starts, end) - 1
        if i >= 0 and end <= windows[i][1]:
            out.append(length)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=256,
                    help="hidden size (heads of 64; 256: 32 KiB of KV per token with 16 "
                         "layers, 16 MiB per 512-token prompt)")
    ap.add_argument("--tokens", type=int, nargs="+", default=[512],
                    help="prompt tokens, one run each (several: where disaggregating "
                         "starts to pay, the README's --local-below)")
    ap.add_argument("--streams", type=int, nargs="+", default=[0, 16],
                    help="other streams decode runs meanwhile, one run each")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--transports", nargs="+", default=["shm", "tcp"],
                    help="the connector's transport, one pair of servers each")
    ap.add_argument("--handoffs", nargs="+", default=["first", "sequential"],
                    choices=list(HANDOFFS),
                    help="the router's hand-offs: first (decode reads the KV), first-push "
                         "(prefill pushes it layer by layer), sequential")
    ap.add_argument("--load", choices=("sync", "async"), default="sync",
                    help="how decode's connector loads prefill's KV")
    ap.add_argument("--prefill-serve", choices=("process", "thread"), default="process",
                    help="where prefill serves decode's reads (the README's advice: a "
                         "serving process, its model runner holds Python's lock)")
    ap.add_argument("--no-taskset", action="store_true",
                    help="pin only vLLM's compute threads, not each whole server, to its "
                         "core (by default each server is a one-core host)")
    ap.add_argument("--max-tokens", type=int, default=4, help="tokens per probe")
    ap.add_argument("--plot", type=Path, help="draw the medians (PNG, else SVG)")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    rows = []
    for transport in args.transports:
        rows += run_transport(args, transport)
    if args.plot:
        from bench.charts import bars

        groups = [f"{r['transport']}\n{r['decode_streams']} streams"
                  + (f"\n{r['prompt_tokens']} tokens" if len(args.tokens) > 1 else "")
                  for r in rows]
        routes = ["local", *args.handoffs]
        series = {f"{route} {what}": [r[f"{route}_{key}_ms_p50"] for r in rows]
                  for route in routes for what, key in (("TTFT", "ttft"),
                                                        ("2nd token", "second"))}
        print(f"plot: {bars(groups, series, args.plot, ylabel='ms (p50)')}", flush=True)


def run_transport(args: argparse.Namespace, transport: str) -> list[dict[str, Any]]:
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from bench import vllm_servers as servers
    from bench.fleet import free_port

    rows = []
    with tempfile.TemporaryDirectory() as tmp_dir, contextlib.ExitStack() as stack:
        tmp = Path(tmp_dir)
        model = tmp / "model"
        servers.build_byte_model(model)
        cfg = json.loads((model / "config.json").read_text())
        torch.manual_seed(1)
        heads = max(1, args.hidden // 64)
        LlamaForCausalLM(LlamaConfig(**{
            **cfg, "num_hidden_layers": args.layers, "hidden_size": args.hidden,
            "intermediate_size": 2 * args.hidden, "num_attention_heads": heads,
            "num_key_value_heads": heads})).save_pretrained(model)
        ports = {"prefill": free_port(), "decode": free_port()}
        kv = {"kv_connector": "TransferEngineConnector",
              "kv_connector_module_path": "transfer_engine.connectors.vllm",
              "kv_load_failure_policy": "recompute"}
        procs = {}
        for (role, kv_role), cores in zip((("prefill", "kv_producer"),
                                           ("decode", "kv_consumer")), servers.core_halves(),
                                          strict=True):
            extra: dict[str, Any] = {"transports": transport}
            if role == "decode":
                extra["load"] = args.load
            else:
                extra["serve"] = args.prefill_serve
            box = [] if args.no_taskset else ["taskset", "-c", cores]
            cmd = [*box, sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model",
                   str(model), "--port", str(ports[role]), "--dtype", "float32",
                   "--block-size", "32", "--max-model-len", str(2 * max(args.tokens)),
                   "--enforce-eager", "--kv-transfer-config",
                   json.dumps(dict(kv, kv_role=kv_role, kv_connector_extra_config=extra))]
            procs[role] = stack.enter_context(servers.launched(cmd, tmp / f"{role}.log", dict(
                os.environ, VLLM_CPU_KVCACHE_SPACE="1", PYTHONPATH=str(ROOT),
                VLLM_CPU_OMP_THREADS_BIND=cores)))
        for handoff in args.handoffs:
            cmd = [sys.executable, str(ROOT / "scripts" / "pd_proxy.py"), "--port", "0",
                   "--prefill", f"http://127.0.0.1:{ports['prefill']}", "--decode",
                   f"http://127.0.0.1:{ports['decode']}", *HANDOFFS[handoff],
                   "--local-below", "0"]
            stack.enter_context(servers.launched(cmd, tmp / f"proxy-{handoff}.log",
                                             dict(os.environ)))
        for role, proc in procs.items():
            servers.wait_healthy(ports[role], proc, tmp / f"{role}.log")
        for handoff in args.handoffs:
            ports[handoff] = int(servers.wait_in_log(
                tmp / f"proxy-{handoff}.log", r"pd_proxy on http://[\d.]+:(\d+)").group(1))
        tok = AutoTokenizer.from_pretrained(model)
        rng = random.Random(7)
        name = str(model)

        def prompt(tokens: int = max(args.tokens)) -> list[int]:  # fresh: nothing cached
            text = " ".join(rng.choice(servers.WORDS) for _ in range(tokens))
            return list(tok(text)["input_ids"][:tokens])

        for route in ("local", *args.handoffs):  # warm every path once
            port = ports["decode" if route == "local" else route]
            stream_times(port, {"model": name, "prompt": prompt(), "max_tokens": 2,
                                "temperature": 0})
        for tokens in args.tokens:
            sized = functools.partial(prompt, tokens)
            for streams in args.streams:
                rows.append(one_load(args, transport, streams, ports, name, sized, tokens))
                rows[-1]["identical"] = identical(args, ports, name, sized)
                print(json.dumps(rows[-1]), flush=True)
    return rows


def identical(args: argparse.Namespace, ports: dict[str, int], name: str, prompt: Any,
              count: int = 3) -> bool:
    """Whether each hand-off answers fresh prompts token for token as the prefill
    server alone does (greedy; its cache holds only what it computed itself)."""
    for route in args.handoffs:
        for _ in range(count):
            body = {"model": name, "prompt": prompt(), "max_tokens": 8, "temperature": 0,
                    "ignore_eos": True, "return_token_ids": True}
            got = [json.loads(http_json(ports[port], "POST", "/v1/completions", body,
                                        timeout=120)[1])["choices"][0]
                   for port in (route, "prefill")]
            handed, alone = ((c["text"], c["token_ids"]) for c in got)
            if handed != alone:
                return False
    return True


def one_load(args: argparse.Namespace, transport: str, streams: int,
             ports: dict[str, int], name: str, prompt: Any, tokens: int) -> dict[str, Any]:
    from bench import vllm_servers as servers

    stop = threading.Event()
    gaps: list[tuple[float, float]] = []  # (end, length) between a stream's tokens
    lock = threading.Lock()

    def load(k: int) -> None:
        body = {"model": name, "prompt": " ".join(servers.WORDS[k:k + 20]),
                "max_tokens": 128, "temperature": 0, "ignore_eos": True}
        while not stop.is_set():
            seen = stream_times(ports["decode"], body, timeout=600)
            with lock:
                gaps.extend((b, b - a) for a, b in zip(seen[1:], seen[2:], strict=False))

    threads = [threading.Thread(target=load, args=(k,), daemon=True)
               for k in range(streams)]
    for t in threads:
        t.start()
    time.sleep(3 if streams else 0)
    routes = ["local", *args.handoffs]
    first: dict[str, list[float]] = {r: [] for r in routes}
    second: dict[str, list[float]] = {r: [] for r in routes}
    windows: dict[str, list[tuple[float, float]]] = {r: [] for r in routes}
    te_before = te_metrics(ports["decode"]), te_metrics(ports["prefill"])
    source_before = by_source(ports["decode"])
    try:
        for _ in range(args.rounds):
            for route in routes:
                # EOS ignored: a first token that ends the answer hands nothing over
                body = {"model": name, "prompt": prompt(), "max_tokens": args.max_tokens,
                        "temperature": 0, "ignore_eos": True}
                port = ports["decode" if route == "local" else route]
                seen = stream_times(port, body)
                first[route].append(seen[1] - seen[0])
                second[route].append(seen[min(2, len(seen) - 1)] - seen[0])
                windows[route].append((seen[0], seen[-1]))
    finally:
        stop.set()
        for t in threads:
            t.join(600)
    time.sleep(1.5)  # prefill hears of decode's last read at a later step
    for side in ("decode", "prefill"):  # a step of each, which reports the last ones'
        http_json(ports[side], "POST", "/v1/completions", {
            "model": name, "prompt": "tick", "max_tokens": 1}, timeout=120)
    te_after = te_metrics(ports["decode"]), te_metrics(ports["prefill"])
    source_after = by_source(ports["decode"])
    row: dict[str, Any] = {"transport": transport, "load": args.load,
                           "prefill_serve": args.prefill_serve,
                           "layers": args.layers, "hidden": args.hidden,
                           "prompt_tokens": tokens,
                           "decode_streams": streams, "rounds": args.rounds}
    for route in routes:
        for key, values in (("ttft", first[route]), ("second", second[route])):
            for q in (50, 90):
                row[f"{route}_{key}_ms_p{q}"] = round(quantile(values, q / 100) * 1e3, 1)
    for route in args.handoffs:
        for key, values in (("ttft", first), ("second", second)):
            row[f"{route}_{key}_over_local"] = round(
                row[f"{route}_{key}_ms_p50"] / row[f"local_{key}_ms_p50"], 2)
            # the same within each round (its probes are back to back), then the median:
            # a slow spell of the shared machine moves both sides of a round's ratio
            row[f"{route}_{key}_paired"] = round(statistics.median(
                h / loc for h, loc in zip(values[route], values["local"], strict=True)), 2)
    if streams:
        with lock:
            all_gaps = sorted(gaps)
        for route in routes:
            inside = gaps_in(windows[route], all_gaps)
            row[f"gap_p99_ms_during_{route}"] = round(quantile(inside, 0.99) * 1e3, 1) \
                if inside else None
        for route in args.handoffs:
            pd, local = row[f"gap_p99_ms_during_{route}"], row["gap_p99_ms_during_local"]
            row[f"gap_p99_{route}_over_local"] = round(pd / local, 2) if pd and local \
                else None

    # vLLM's own count of prompt tokens decode loaded over the connector, against every
    # prompt token prefill computed (the sequential hand-off leaves decode the last)
    row["external_kv_tokens"] = int(source_after.get("external_kv_transfer", 0)
                                    - source_before.get("external_kv_transfer", 0))
    row["external_kv_tokens_expected"] = args.rounds * sum(
        tokens - (route == "sequential") for route in args.handoffs)

    def grew(side: int, key: str) -> float:
        return te_after[side].get(key, 0.0) - te_before[side].get(key, 0.0)

    loads = grew(0, "te_kv_load_seconds_count")
    waits = grew(0, "te_kv_load_wait_seconds_count")
    held = grew(1, "te_kv_held_seconds_count")
    row["phases"] = {
        "loads": int(grew(0, "te_kv_loads_total")),
        "sync_loads": int(grew(0, "te_kv_sync_loads_total")),
        "layered_loads": int(grew(0, "te_kv_layered_loads_total")),
        "pushed_loads": int(grew(0, "te_kv_pushed_loads_total")),
        "push_failures": int(grew(1, "te_kv_push_failures_total")),
        "load_failures": int(grew(0, "te_kv_load_failures_total")),
        "load_ms_mean": round(grew(0, "te_kv_load_seconds_sum") / loads * 1e3, 1)
        if loads else None,
        "forward_wait_ms_mean": round(grew(0, "te_kv_load_wait_seconds_sum") / waits * 1e3, 1)
        if waits else None,
        "load_mib_mean": round(grew(0, "te_kv_load_bytes_total") / loads / 2**20, 2)
        if loads else None,
        "prefill_held_ms_mean": round(grew(1, "te_kv_held_seconds_sum") / held * 1e3, 1)
        if held else None,
    }
    return row


if __name__ == "__main__":
    main()
