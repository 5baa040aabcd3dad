"""The README's demo shows the KV store: a request's blocks put into an embedded master
and node, and a second request loading its shared prefix from there, bytes checked."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(120)
def test_demo_store_part_loads_the_shared_prefix() -> None:
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "demo.py"), "--store-only",
                          "--layers", "2", "--blocks", "16"], capture_output=True, text=True,
                         timeout=100, stdin=subprocess.DEVNULL, cwd=ROOT)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "request 2 found 8 of 16 blocks stored" in out.stdout, out.stdout
    assert "bytes checked: yes" in out.stdout, out.stdout
