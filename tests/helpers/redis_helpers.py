"""A real redis for tests: one ``redis-server`` on a free loopback port, no persistence."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager

from bench.fleet import free_port

REDIS = "redis-server"


def redis_skip_reason() -> str | None:
    if shutil.which(REDIS) is None:
        return "redis-server is not installed (Debian: apt-get install redis-server)"
    return None


def _answers(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1) as s:
            s.sendall(b"*1\r\n$4\r\nPING\r\n")
            return s.recv(64).startswith((b"+PONG", b"-NOAUTH"))
    except OSError:
        return False


@contextmanager
def redis_server(password: str | None = None, start_timeout: float = 10.0
                 ) -> Iterator[str]:
    """Runs redis-server on a free loopback port; yields ``redis://127.0.0.1:PORT`` and
    kills it afterwards, pass or fail."""
    port = free_port()
    argv = [REDIS, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
            "--appendonly", "no"]
    if password is not None:
        argv += ["--requirepass", password]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + start_timeout
        while not _answers(port):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("redis-server did not start")
            time.sleep(0.05)
        yield f"redis://127.0.0.1:{port}"
    finally:
        proc.kill()
        proc.wait(10)
