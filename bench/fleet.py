"""Processes for the benches and tests: member engines and standalone registries, with
their stdout read line by line under a deadline, and the one way a child is ended."""

from __future__ import annotations

import contextlib
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def end_process(proc: subprocess.Popen[Any], sig: int = signal.SIGTERM,
                timeout: float = 10.0, group: bool = False) -> None:
    """Ends a child: ``sig`` (to its whole process group with ``group``, for a child
    started in a session of its own), then SIGKILL if it has not exited within
    ``timeout`` seconds; returns once it has been reaped."""
    def send(signum: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            if group:
                os.killpg(proc.pid, signum)
            elif proc.poll() is None:
                proc.send_signal(signum)

    send(sig)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        send(signal.SIGKILL)
        proc.wait(10)


class Proc:
    """A child process whose stdout lines are collected by a reader thread (which ends
    when the child's stdout closes)."""

    def __init__(self, args: list[str], env: dict[str, str] | None = None) -> None:
        self.proc = subprocess.Popen([sys.executable, *args], cwd=ROOT, text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     env={**os.environ, **(env or {})})
        self.lines: queue.SimpleQueue[str] = queue.SimpleQueue()
        self.seen: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True,
                                        name=f"reader-{self.proc.pid}")
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line.strip())

    def expect(self, prefix: str, timeout: float = 15.0) -> str:
        """Waits for a stdout line starting with ``prefix`` (lines before are kept in
        ``seen``); raises AssertionError after ``timeout`` seconds."""
        for line in self.seen:
            if line.startswith(prefix):
                self.seen.remove(line)
                return line
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            try:
                line = self.lines.get(timeout=max(left, 0.001))
            except queue.Empty:
                raise AssertionError(f"no {prefix!r} within {timeout}s; saw {self.seen}"
                                     ) from None
            if line.startswith(prefix):
                return line
            self.seen.append(line)

    def signal(self, sig: int) -> None:
        os.kill(self.proc.pid, sig)

    def stop(self, timeout: float = 10.0) -> None:
        if self.proc.poll() is None:
            try:
                os.kill(self.proc.pid, signal.SIGCONT)
            except OSError:
                pass
            assert self.proc.stdin is not None
            try:
                self.proc.stdin.close()
            except OSError:
                pass
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        else:
            self.proc.wait()
        self._reader.join(5)
        for stream in (self.proc.stdin, self.proc.stdout):
            if stream is not None and not stream.closed:
                try:
                    stream.close()
                except OSError:
                    pass


def member(name: str, registry: str, role: str = "decode", size: int = 1 << 20,
           secret: str | None = None) -> Proc:
    args = ["-m", "bench.member_process", name, registry, role, str(size)]
    return Proc(args + ([secret] if secret else []))


def registry_process(port: int, interval: float = 0.1, max_missed: int = 3,
                     *options: str) -> Proc:
    """The registry in a process of its own; ``options`` go to its command line."""
    return Proc(["-m", "transfer_engine.registry", "--bind", f"tcp://127.0.0.1:{port}",
                 "--interval", str(interval), "--max-missed", str(max_missed), "--stdin",
                 *options])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
