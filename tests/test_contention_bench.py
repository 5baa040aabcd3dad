"""bench.contention runs every case in one run and reports the fields docs/data-plane.md
names (the figures themselves are not checked: timing belongs to the bench)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from bench.baselines import child_env
from bench.contention import CASES


def test_one_short_run_reports_every_case_and_verifies(tmp_path: Path) -> None:
    out = tmp_path / "contention.json"
    proc = subprocess.run(
        [sys.executable, "-m", "bench.contention", "--protocols", "tcp", "--shapes",
         "64kx8", "--duration", "0.1", "--repeat", "1", "--warmup", "0.1", "--baseline",
         "--json", str(out)], capture_output=True, text=True, timeout=150, env=child_env())
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads(out.read_text())
    assert doc["serve"] == "process" and list(doc["other_serve"]) == ["thread"]
    for results in (doc["results"], doc["other_serve"]["thread"]):
        case = results["tcp"]["65536x8"]
        assert case["verified"] is True and case["transport"] == "tcp"
        for name in CASES:
            assert case[f"{name}_gbps"] > 0
            assert case[f"{name}_p99_ms"] > 0
            if name != "idle":
                assert case[f"{name}_vs_idle"] > 0
        assert case["p99_ms"] == case["idle_p99_ms"]
    base = doc["baselines"]["65536x8"]  # measured in the same run
    assert base["socket_gbps"] > 0 and base["memcpy_gbps"] > 0
    assert case["idle_vs_socket"] > 0 and case["idle_vs_memcpy"] > 0
    assert "baseline 65536x8: raw loopback socket" in proc.stdout
    assert "served from a process:" in proc.stdout and "served from a thread:" in proc.stdout


def test_an_unknown_serve_mode_is_refused_at_once() -> None:
    proc = subprocess.run([sys.executable, "-m", "bench.contention", "--serve", "fork"],
                          capture_output=True, text=True, timeout=60, env=child_env())
    assert proc.returncode == 2 and "'fork'" in proc.stderr
