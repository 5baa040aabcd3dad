"""Compares routing policies on a trace: a table (fleet size x policy) and a chart of
TTFT percentiles per policy.

    python -m scheduler.report --trace ../shared/traces/conversation_trace.jsonl \\
        --nodes 100 1000 --time-scale 200 --out results/scheduler

``--time-scale`` per fleet size is scaled with it (``200`` at 1000 nodes is ``20`` at
100), so every row sees the same load per instance. ``--find-load G [G ...]`` instead
picks, per fleet size and per ``G``, the time scale at which round robin's goodput falls
to ``G`` (bisection): ratios between policies mean most where round robin misses the SLO
for a good share of requests but the fleet is not past saturation, and where that is
differs between traces, so several loads can go in one table.
The chart is a PNG when matplotlib is installed, else an SVG drawn here.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from scheduler.router import POLICIES
from scheduler.sim import SimConfig, simulate
from scheduler.trace import Trace, load_trace

__all__ = ["run", "find_load", "table", "plot", "main"]

_COLUMNS = ("nodes", "policy", "time_scale", "goodput", "prefix_hit_rate", "hit_bound",
            "hit_vs_bound", "p50_ttft_s", "p90_ttft_s", "p99_ttft_s", "sim_seconds")


def find_load(trace: Trace, nodes: int, goodput: float, *, lo: float = 1.0,
              hi: float = 4096.0, steps: int = 10) -> float:
    """The time scale at which round robin's goodput is about ``goodput`` on ``nodes``
    instances (bisection on a log scale, ``steps`` runs)."""
    for _ in range(steps):
        mid = (lo * hi) ** 0.5
        got = simulate(trace, "round_robin", SimConfig(nodes=nodes, time_scale=mid))
        if got["goodput"] > goodput:
            lo = mid
        else:
            hi = mid
    return round(float((lo * hi) ** 0.5), 2)


def run(trace: Trace, nodes: list[int], policies: list[str], scale_at_1000: float | None,
        target_goodput: float | Sequence[float] | None) -> list[dict[str, Any]]:
    """Every policy at every fleet size, at each load: the time scale given for 1000
    nodes (scaled with the fleet), or per target the one where round robin's goodput
    is that target."""
    if target_goodput is None:
        targets: list[float | None] = [None]
    elif isinstance(target_goodput, int | float):
        targets = [float(target_goodput)]
    else:
        targets = [float(g) for g in target_goodput]
    rows = []
    for n in nodes:
        for target in targets:
            if target is not None:
                scale = find_load(trace, n, target)
            else:
                scale = (scale_at_1000 or 1.0) * n / 1000
            for policy in policies:
                result = simulate(trace, policy, SimConfig(nodes=n, time_scale=scale))
                result["hit_vs_bound"] = (round(result["prefix_hit_rate"]
                                                / result["hit_bound"], 3)
                                          if result["hit_bound"] else 0.0)
                rows.append(result)
                print(" ".join(f"{k}={result[k]}" for k in _COLUMNS), flush=True)
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    """A Markdown table of the runs, with each policy's goodput relative to round robin
    and to least loaded at the same fleet size and load."""
    base = {(r["nodes"], r["time_scale"], r["policy"]): r["goodput"] for r in rows}
    head = list(_COLUMNS) + ["vs_round_robin", "vs_least_loaded"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        rel = []
        for other in ("round_robin", "least_loaded"):
            g = base.get((r["nodes"], r["time_scale"], other))
            rel.append(f"{r['goodput'] / g:.2f}x" if g else "-")
        lines.append("| " + " | ".join(str(r.get(k, "-")) for k in _COLUMNS) + " | "
                     + " | ".join(rel) + " |")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict[str, Any]], path: Path) -> Path:
    """TTFT p50/p90/p99 per policy (one group per fleet size). Returns the file written:
    ``path`` as PNG with matplotlib, else beside it as SVG."""
    from bench.charts import bars  # noqa: PLC0415

    groups = [f"{r['policy']}\n{r['nodes']} x{r['time_scale']:g}" for r in rows]
    return bars(groups, {f"{q} TTFT": [r[f"{q}_ttft_s"] for r in rows]
                         for q in ("p50", "p90", "p99")}, path, ylabel="TTFT (s, log)",
                log=True)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m scheduler.report", description=__doc__
                                 .split("\n\n")[0])
    ap.add_argument("--trace", required=True)
    ap.add_argument("--nodes", type=int, nargs="+", default=[100, 1000])
    ap.add_argument("--policies", nargs="+", default=list(POLICIES))
    load = ap.add_mutually_exclusive_group()
    load.add_argument("--time-scale", type=float, default=200.0,
                      help="time scale at 1000 nodes (scaled with the fleet size)")
    load.add_argument("--find-load", type=float, nargs="+", metavar="GOODPUT",
                      help="per fleet size, the loads at which round robin reaches each "
                           "GOODPUT (e.g. 0.5 0.3)")
    ap.add_argument("--out", default="results/scheduler", help="folder for the outputs")
    args = ap.parse_args(argv)
    trace = load_trace(args.trace)
    rows = run(trace, args.nodes, args.policies,
               None if args.find_load is not None else args.time_scale, args.find_load)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "runs.json").write_text(json.dumps(rows, indent=2) + "\n")
    md = table(rows)
    (out / "table.md").write_text(md)
    print(md)
    print(f"chart: {plot(rows, out / 'ttft.png')}")


if __name__ == "__main__":
    main()
