"""The simulator: deterministic, its summary fields, policies ordered as they should be
under load, the command line, and a slice of the real trace when it is present."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from scheduler.errors import TraceError
from scheduler.report import run, table
from scheduler.sim import SimConfig, main, simulate
from scheduler.trace import load_trace, synthetic_trace

TRACE = Path(__file__).resolve().parents[3] / "shared" / "traces" / "conversation_trace.jsonl"
FIELDS = {"policy", "nodes", "requests", "prefix_hit_rate", "hit_bound", "goodput",
          "p50_ttft_s", "p99_ttft_s", "sim_seconds"}


def _strip(result: dict[str, object]) -> dict[str, object]:
    return {k: v for k, v in result.items() if k != "sim_seconds"}


def test_same_seed_same_numbers() -> None:
    trace = synthetic_trace(400, seed=3, rate=20.0)
    config = SimConfig(nodes=32, seed=5, sample=2)
    first = simulate(trace, "default", config)
    assert FIELDS <= first.keys() and first["requests"] == 400
    assert _strip(first) == _strip(simulate(synthetic_trace(400, seed=3, rate=20.0),
                                            "default", config))
    for policy in ("round_robin", "least_loaded", "prefix_only"):
        assert _strip(simulate(trace, policy, config)) == _strip(
            simulate(trace, policy, config))


def test_policies_under_load() -> None:
    trace = synthetic_trace(1500, seed=1, rate=4.0)
    config = SimConfig(nodes=16, time_scale=4.0, cache_blocks=200)
    got = {p: simulate(trace, p, config) for p in ("round_robin", "least_loaded",
                                                   "prefix_only", "default")}
    bound = trace.hit_bound
    assert got["default"]["hit_bound"] == round(bound, 4) and bound > 0.5
    assert got["default"]["prefix_hit_rate"] >= 0.9 * bound
    assert got["round_robin"]["prefix_hit_rate"] < got["default"]["prefix_hit_rate"]
    assert got["default"]["goodput"] >= got["least_loaded"]["goodput"]
    assert got["default"]["goodput"] >= got["round_robin"]["goodput"]
    assert got["default"]["p99_ttft_s"] <= got["round_robin"]["p99_ttft_s"]
    assert "| 16 | cache_aware |" in table(list(got.values()))


@pytest.mark.parametrize(("nodes", "rate", "scale"),
                         [(16, 4.0, 1.0), (16, 4.0, 8.0), (48, 12.0, 2.0)])
def test_default_is_never_below_least_loaded(nodes: int, rate: float, scale: float) -> None:
    """Light, heavy and past saturation, small and larger fleets."""
    trace = synthetic_trace(800, seed=4, rate=rate)
    config = SimConfig(nodes=nodes, time_scale=scale, cache_blocks=200)
    got = {p: simulate(trace, p, config) for p in ("round_robin", "least_loaded", "default")}
    assert got["default"]["goodput"] >= got["least_loaded"]["goodput"]
    assert got["default"]["goodput"] >= got["round_robin"]["goodput"]
    assert got["default"]["prefix_hit_rate"] >= 0.8 * trace.hit_bound


def test_report_runs_each_load_and_compares_within_it() -> None:
    trace = synthetic_trace(200, seed=2, rate=10.0)
    rows = run(trace, [8], ["round_robin", "cache_aware"], None, [0.7, 0.3])
    scales = sorted({r["time_scale"] for r in rows})
    assert len(rows) == 4 and len(scales) == 2
    assert all(0.0 <= r["hit_vs_bound"] <= 1.0 for r in rows)
    md = table(rows)
    assert md.count("| 1.00x |") == 2  # round robin against itself, once per load
    assert "hit_vs_bound" in md.splitlines()[0]


def test_command_line_writes_json(tmp_path: Path) -> None:
    trace = synthetic_trace(200, seed=2)
    path = tmp_path / "t.jsonl"
    with path.open("w") as fh:
        for t, i, o, k in zip(trace.arrival_s, trace.input_tokens, trace.output_tokens,
                              trace.keys, strict=True):
            fh.write(json.dumps({"timestamp": int(t * 1000), "input_length": int(i),
                                 "output_length": int(o), "hash_ids": list(k)}) + "\n")
    out = tmp_path / "res" / "sim.json"
    result = main(["--trace", str(path), "--nodes", "16", "--policy", "least_loaded",
                   "--time-scale", "2", "--json", str(out)])
    assert json.loads(out.read_text())["goodput"] == result["goodput"]
    assert result["policy"] == "least_loaded" and result["nodes"] == 16


def test_bad_traces_are_refused(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 5, "output_length": 1, '
                   '"hash_ids": [1]}\n{"timestamp": "x"}\n')
    with pytest.raises(TraceError, match="bad.jsonl:2"):
        load_trace(bad)
    with pytest.raises(TraceError):
        load_trace(tmp_path / "missing.jsonl")


@pytest.mark.skipif(not TRACE.exists(), reason=f"trace not found at {TRACE}")
def test_conversation_trace_slice() -> None:
    trace = load_trace(TRACE, limit=2000)
    assert len(trace) == 2000 and 0.2 < trace.hit_bound < 0.6
    config = SimConfig(nodes=200, time_scale=200 * 200 / 1000)
    rr = simulate(trace, "round_robin", config)
    best = simulate(trace, "default", config)
    assert best["prefix_hit_rate"] >= 0.85 * trace.hit_bound > rr["prefix_hit_rate"]
    assert best["goodput"] >= rr["goodput"]
