"""Storage nodes as real processes, for the cluster store's tests and benches."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


class NodeProcess:
    """``python -m kvstore.node`` in a child process; ``kill()`` is SIGKILL (no goodbye),
    ``close()`` stops it politely. Closes its pipe either way."""

    def __init__(self, master: str, name: str, capacity: int = 32 << 20,
                 timeout: float = 30.0, extra: list[str] | None = None) -> None:
        env = dict(os.environ)
        env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
        self.name = name
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvstore.node", "--master", master, "--name", name,
             "--capacity", str(capacity), *(extra or [])],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, cwd=ROOT, text=True)
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        line = ""
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if "serving" in line or not line:
                break
        if "serving" not in line:
            self.close()
            raise RuntimeError(f"node {name} did not start: {line!r}")
        self.endpoint = line.split()[-1]

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        if self.proc.stdout is not None:
            self.proc.stdout.close()

    def __enter__(self) -> NodeProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
