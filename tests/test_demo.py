"""The README's demo runs: an in-process registry, a decode worker process found by role,
scattered paged-KV blocks written over shm (tcp where the host refuses cross-memory
attach) and over tcp, verified by the receiver."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.timeout(180)
def test_demo_moves_and_verifies_blocks_over_shm_and_tcp() -> None:
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "demo.py"), "--layers", "2",
                          "--blocks", "16"], capture_output=True, text=True, timeout=150,
                         stdin=subprocess.DEVNULL)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "(in-process)" in out.stdout
    verified = [line for line in out.stdout.splitlines() if "verified the bytes: yes" in line]
    used = [line.split(":")[0].strip() for line in verified]
    assert len(used) == 2 and used[1] == "tcp", out.stdout
    assert used[0] in ("shm", "tcp"), out.stdout  # tcp where the host forbids shm
