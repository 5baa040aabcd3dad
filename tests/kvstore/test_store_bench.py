"""bench.store_bench: one short run end to end, with and without Mooncake's wheel."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import pytest

from bench import store_bench

# Mooncake's wheel belongs in an environment of its own (its `mooncake` package and this
# project's API shim exclude each other): name that interpreter with $MOONCAKE_PYTHON.
MOONCAKE_PYTHON = os.environ.get("MOONCAKE_PYTHON") or sys.executable
SMALL = ["--value-size", "65536", "--batch", "8", "--duration", "0.3",
         "--node-capacity", str(32 << 20), "--rss-objects", "1000", "--skip-redis"]


def _children() -> list[int]:
    """Live (not zombie) processes whose parent is this one."""
    me, found = os.getpid(), []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == me and fields[0] != "Z":
            found.append(int(entry))
    return found


def test_store_bench_without_mooncake(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(store_bench, "mooncake_master", lambda python: None)
    out = tmp_path / "store.json"
    store_bench.main([*SMALL, "--json", str(out)])
    result = json.loads(out.read_text())
    assert result["put_gbps"] > 0 and result["get_gbps"] > 0
    assert result["transport"] in ("shm", "tcp")
    assert result["get_p99_us"] >= result["get_p50_us"] > 0
    for field in store_bench.MOONCAKE_FIELDS:
        assert result[field] is None
    assert result["get_vs_mooncake"] is None and result["get_vs_redis"] is None
    assert "mooncake baseline skipped" in capsys.readouterr().out
    assert _children() == []


def _args(duration: float = 0.3) -> argparse.Namespace:
    return argparse.Namespace(value_size=65536, batch=8, duration=duration, nodes=2,
                              node_capacity=32 << 20, mooncake_python=MOONCAKE_PYTHON)


def test_mooncake_failure_is_reported_and_cleaned_up(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(store_bench, "mooncake_master", lambda python: "/bin/false")
    got = store_bench.bench_mooncake(_args())
    assert all(got[f] is None for f in store_bench.MOONCAKE_FIELDS)
    assert "mooncake_master ended" in got["mooncake_error"]
    assert "mooncake baseline failed" in capsys.readouterr().out
    assert _children() == []


@pytest.mark.slow
@pytest.mark.skipif(store_bench.mooncake_master(MOONCAKE_PYTHON) is None,
                    reason="no Mooncake wheel: pip install mooncake-transfer-engine-non-cuda "
                           "in a separate environment and set MOONCAKE_PYTHON to its python")
def test_mooncake_store_measured() -> None:
    got = store_bench.bench_mooncake(_args())
    assert "mooncake_error" not in got
    assert got["mooncake_put_gbps"] > 0 and got["mooncake_get_gbps"] > 0
    assert got["mooncake_get_p99_us"] >= got["mooncake_get_p50_us"] > 0
    assert _children() == []
