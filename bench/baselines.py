"""Baselines measured in the same run as the engine, on the same machine.

* :func:`socket_gbps`: one raw loopback TCP stream between two processes. The sender
  (this process) gathers a batch of ``block_size`` memoryviews per ``sendmsg``; the
  receiver (a child process) ``recv_into``s each block into its own slot of a
  pre-faulted buffer. 4 MiB socket buffers, ``TCP_NODELAY``, and the host's congestion
  control unless one is named (the engine's loopback rails use their own, see
  :mod:`transfer_engine.transport.tcp`; naming it here measures the socket under the
  same). This is what plain Python sockets reach here, the yardstick for the engine's
  TCP transport.
* :func:`memcpy_gbps`: one thread copying ``block_size`` chunks between two pre-faulted
  256 MiB buffers with ``np.copyto``, the yardstick for the same-host transport.

Both place blocks in shuffled slots unless ``contiguous`` is set, as the engine bench does.
Run ``python -m bench.baselines --block_size 65536`` to measure them alone.
"""

from __future__ import annotations

import argparse
import os
import queue
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from bench.fleet import end_process
from bench.stats import cpu_seconds, fill_random
from transfer_engine.transport.tcp_congestion import (
    check_congestion,
    congestion_of,
    set_congestion,
)

__all__ = ["socket_gbps", "socket_baseline", "memcpy_gbps", "Child", "child_env"]

SOCKET_BUFFER = 4 << 20
DEFAULT_BUFFER = 256 << 20
_TOTAL = struct.Struct("<Qd")  # bytes received, receiver CPU seconds


def child_env() -> dict[str, str]:
    """Environment for a child ``python -m bench...``: finds this checkout's packages."""
    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


class Child:
    """A child Python process whose stdout lines are read with timeouts.

    ``close()`` stops it (signal, bounded wait, then kill) and reaps it; use it as a
    context manager so that no error path leaves an orphan or an open pipe.
    """

    def __init__(self, args: Sequence[str], stderr: Any = None,
                 python: str | None = None) -> None:
        self.proc = subprocess.Popen([python or sys.executable, *args],
                                     stdin=subprocess.DEVNULL,
                                     stdout=subprocess.PIPE, stderr=stderr, text=True,
                                     bufsize=1, env=child_env())
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.other: list[str] = []
        self._pump_thread = threading.Thread(target=self._pump, daemon=True,
                                             name=f"child-{self.proc.pid}-stdout")
        self._pump_thread.start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        try:
            for line in self.proc.stdout:
                self.lines.put(line.rstrip("\n"))
        except (OSError, ValueError):
            pass
        finally:
            self.lines.put(None)

    def expect(self, prefix: str, timeout: float) -> str:
        """The rest of the next stdout line that starts with ``prefix`` (other lines are
        kept in ``other``). Raises ``TimeoutError`` or ``RuntimeError`` (child ended)."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no {prefix.strip()!r} line from child "
                                   f"{self.proc.pid} within {timeout:g}s")
            try:
                line = self.lines.get(timeout=left)
            except queue.Empty:
                continue
            if line is None:
                self.lines.put(None)  # stay at EOF for later calls
                rc = self.proc.wait(5)
                raise RuntimeError(f"child {self.proc.pid} ended (exit code {rc}) before "
                                   f"printing {prefix.strip()!r}")
            if line.startswith(prefix):
                return line[len(prefix):].strip()
            self.other.append(line)

    def send_signal(self, sig: int) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)

    def close(self, sig: int = signal.SIGTERM, timeout: float = 10.0,
              grace: float = 0.0) -> int:
        """Reaps the child: waits up to ``grace`` seconds for it to end by itself, then
        sends ``sig``, then SIGKILL after ``timeout`` more seconds."""
        try:
            if grace > 0:
                try:
                    self.proc.wait(grace)
                except subprocess.TimeoutExpired:
                    pass
            end_process(self.proc, sig, timeout)
        finally:
            self._pump_thread.join(5)
            if self.proc.stdout is not None:
                self.proc.stdout.close()
        return self.proc.returncode

    def __enter__(self) -> Child:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _slots(buffer_size: int, block_size: int, contiguous: bool, seed: int) -> np.ndarray:
    count = buffer_size // block_size
    if count < 1:
        raise ValueError(f"buffer of {buffer_size} bytes holds no block of {block_size}")
    if contiguous:
        return np.arange(count, dtype=np.int64)
    return np.random.default_rng(seed).permutation(count).astype(np.int64)


def _tune(sock: socket.socket, congestion: str | None = None) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER)
    set_congestion(sock, congestion)


def _receiver(block_size: int, buffer_size: int, contiguous: bool,
              congestion: str | None) -> int:
    """Child side of :func:`socket_gbps`: receive until EOF, answer the byte count."""
    buf = np.empty(buffer_size, dtype=np.uint8)
    fill_random(buf, 2)
    mv = buf.data.cast("B")
    views = [mv[s * block_size:(s + 1) * block_size]
             for s in _slots(buffer_size, block_size, contiguous, 3).tolist()]
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        listener.settimeout(30)
        print(f"PORT {listener.getsockname()[1]}", flush=True)
        conn, _ = listener.accept()
    with conn:
        conn.settimeout(120)
        _tune(conn, congestion)
        cpu0 = cpu_seconds()
        total = 0
        i = 0
        nviews = len(views)
        recv_into = conn.recv_into
        while True:
            view = views[i]
            n = recv_into(view)
            if n == 0:
                break
            total += n
            while n < block_size:  # rest of this block
                got = recv_into(view[n:])
                if got == 0:
                    break
                n += got
                total += got
            else:
                i = i + 1 if i + 1 < nviews else 0
                continue
            break
        conn.sendall(_TOTAL.pack(total, cpu_seconds() - cpu0))
    return 0


def socket_gbps(block_size: int, total_bytes: int | None = None, duration: float = 3.0,
                **kwargs: Any) -> float:
    """GB/s (1e9 bytes/s) of one raw loopback TCP stream at ``block_size``; see
    :func:`socket_baseline`."""
    return float(socket_baseline(block_size, total_bytes, duration, **kwargs)["gbps"])


def socket_baseline(block_size: int, total_bytes: int | None = None, duration: float = 3.0,
                    *, batch_size: int = 16, buffer_size: int = DEFAULT_BUFFER,
                    contiguous: bool = False, warmup: float = 0.3,
                    congestion: str | None = None) -> dict[str, Any]:
    """One raw loopback TCP stream at ``block_size``: ``gbps`` (1e9 bytes/s), CPU
    seconds per GB of the sender and of the receiver, and the ``congestion`` control
    it ran under (``congestion`` names one for both ends; None: the host's).

    Sends ``batch_size`` blocks per ``sendmsg`` for ``duration`` seconds (or until
    ``total_bytes``), after ``warmup`` seconds not counted; the time runs until the
    receiver has confirmed every byte.
    """
    src = np.empty(buffer_size, dtype=np.uint8)
    fill_random(src, 1)
    mv = src.data.cast("B")
    slots = _slots(buffer_size, block_size, contiguous, 4).tolist()
    nb = max(1, len(slots) // batch_size)
    batches = [[mv[s * block_size:(s + 1) * block_size]
                for s in (slots * batch_size)[k * batch_size:(k + 1) * batch_size]]
               for k in range(nb)]
    batch_bytes = batch_size * block_size
    args = ["-m", "bench.baselines", "--receiver", "--block_size", str(block_size),
            "--buffer_size", str(buffer_size)] + (["--contiguous"] if contiguous else [])
    if congestion is not None:
        args += ["--congestion", congestion]
    with Child(args) as child:
        port = int(child.expect("PORT ", 60))
        with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
            _tune(sock, congestion)
            algorithm = congestion_of(sock)
            sendmsg = sock.sendmsg
            sent = 0
            k = 0
            phase_end = time.perf_counter() + warmup
            start = None
            while True:
                now = time.perf_counter()
                if now >= phase_end:
                    if start is None:
                        start, phase_end, sent = now, now + duration, 0
                        cpu0 = cpu_seconds()
                    else:
                        break
                if total_bytes is not None and start is not None and sent >= total_bytes:
                    break
                bufs = batches[k]
                k = k + 1 if k + 1 < nb else 0
                n = sendmsg(bufs)
                sent += n
                if n < batch_bytes:  # partial send: finish this batch
                    left = batch_bytes - n
                    pending = list(bufs)
                    while left:
                        while n >= len(pending[0]):
                            n -= len(pending[0])
                            pending.pop(0)
                        pending[0] = pending[0][n:]
                        n = sendmsg(pending)
                        sent += n
                        left -= n
            sock.shutdown(socket.SHUT_WR)
            got = bytearray()
            while len(got) < _TOTAL.size:
                chunk = sock.recv(_TOTAL.size - len(got))
                if not chunk:
                    raise RuntimeError("socket baseline receiver closed without a count")
                got += chunk
            elapsed = time.perf_counter() - start
            cpu_sender = cpu_seconds() - cpu0
        received, cpu_receiver = _TOTAL.unpack(bytes(got))
        if received < sent:  # the receiver also counted the warm-up bytes
            raise RuntimeError(f"socket baseline: sent {sent} bytes, receiver got {received}")
        rc = child.close(grace=30)
        if rc != 0:
            raise RuntimeError(f"socket baseline receiver exited with {rc}")
    return {"gbps": sent / elapsed / 1e9,
            "cpu_s_per_gb_sender": cpu_sender / (sent / 1e9),
            "cpu_s_per_gb_receiver": cpu_receiver / (received / 1e9),
            "congestion": algorithm}


def memcpy_gbps(block_size: int, duration: float = 1.0, *,
                buffer_size: int = DEFAULT_BUFFER, contiguous: bool = False) -> float:
    """GB/s of one thread copying ``block_size`` chunks with ``np.copyto`` between two
    pre-faulted buffers (blocks in shuffled slots unless ``contiguous``)."""
    src = np.empty(buffer_size, dtype=np.uint8)
    dst = np.empty(buffer_size, dtype=np.uint8)
    fill_random(src, 5)
    fill_random(dst, 6)
    so = _slots(buffer_size, block_size, contiguous, 7).tolist()
    do = _slots(buffer_size, block_size, contiguous, 8).tolist()
    pairs = [(dst[d * block_size:(d + 1) * block_size], src[s * block_size:(s + 1) * block_size])
             for d, s in zip(do, so, strict=True)]
    copyto = np.copyto
    for d, s in pairs[:64]:  # warm
        copyto(d, s)
    step = max(1, min(len(pairs), (16 << 20) // block_size))
    copied = 0
    start = time.perf_counter()
    end = start + duration
    i = 0
    while True:
        chunk = pairs[i:i + step]
        for d, s in chunk:
            copyto(d, s)
        copied += len(chunk) * block_size
        i = i + step if i + step < len(pairs) else 0
        now = time.perf_counter()
        if now >= end:
            break
    return copied / (now - start) / 1e9


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--block_size", type=int, default=65536)
    p.add_argument("--batch_size", type=int, default=16)
    p.add_argument("--buffer_size", type=int, default=DEFAULT_BUFFER)
    p.add_argument("--duration", type=float, default=3.0)
    p.add_argument("--contiguous", action="store_true")
    p.add_argument("--congestion", default=None,
                   help="TCP congestion control of the socket (default: the host's)")
    p.add_argument("--receiver", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.receiver:
        return _receiver(a.block_size, a.buffer_size, a.contiguous, a.congestion)
    try:
        check_congestion(a.congestion)
    except ValueError as exc:
        p.error(str(exc))
    sb = socket_baseline(a.block_size, duration=a.duration, batch_size=a.batch_size,
                         buffer_size=a.buffer_size, contiguous=a.contiguous,
                         congestion=a.congestion)
    s = sb["gbps"]
    m = memcpy_gbps(a.block_size, duration=min(a.duration, 1.0), buffer_size=a.buffer_size,
                    contiguous=a.contiguous)
    print(f"socket one stream ({sb['congestion']}) {s:.2f} GB/s (CPU s/GB: sender "
          f"{sb['cpu_s_per_gb_sender']:.3f}, receiver {sb['cpu_s_per_gb_receiver']:.3f})   "
          f"memcpy one thread {m:.2f} GB/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
