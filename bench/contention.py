"""Contention benchmark: throughput and latency of WRITEs while Python code is busy.

The engine lives in an application's process, whose own threads often run pure Python.
A thread that runs Python holds the GIL for up to the switch interval (5 ms); every
time an engine thread comes back from a system call it waits for it. This bench
measures, in one run, for each protocol and block size::

    idle            nothing else runs
    busy_elsewhere  another process runs a Python loop (CPU contention, no GIL)
    busy_target     a thread in the target's process runs a Python loop
    busy_initiator  a thread in the initiator's process runs a Python loop

and reports GB/s, the ratio to idle and the p99 latency of a batch per case::

    python -m bench.contention --duration 2 --repeat 3 --json contention.json

Every case runs once per serve mode (``--serve process,thread``, the default): the
target serving its rails from a serving process, as a process whose Python is busy
should (``results``), then from its own threads, the engine's default (``other_serve``).

The target is a child process; its busy thread is switched on and off with SIGUSR1 /
SIGUSR2 (it answers ``BUSY 1`` / ``BUSY 0``), so every case of one protocol runs against
the same target, and the cases are interleaved per repeat (medians reported), which
keeps the ratios honest on a shared, noisy machine. After the runs one batch is read
back and compared byte for byte (``verified``).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from bench.baselines import Child, child_env, memcpy_gbps, socket_gbps
from bench.stats import fill_random, median, percentile
from transfer_engine.transport import held
from transfer_engine.transport.stream.process import serve_mode

__all__ = ["main", "CASES"]

CASES = ("idle", "busy_elsewhere", "busy_target", "busy_initiator")
SEGMENT = "contention"
WAIT_TIMEOUT = 60.0
START_TIMEOUT = 120.0


class Spinner:
    """A thread that runs a pure-Python loop (holding the GIL) while switched on."""

    def __init__(self) -> None:
        self._on = threading.Event()
        self._stop = False
        self.spins = 0
        self._thread = threading.Thread(target=self._run, daemon=True, name="busy-python")
        self._thread.start()

    def _run(self) -> None:
        while not self._stop:
            if not self._on.wait(0.05):
                continue
            n = 0
            while self._on.is_set() and not self._stop:
                for _ in range(10000):  # pure bytecode: the GIL is given up only on demand
                    n += 1
            self.spins += n

    def set(self, on: bool) -> None:
        if on:
            self._on.set()
        else:
            self._on.clear()

    def close(self) -> None:
        self._stop = True
        self._on.clear()
        self._thread.join(5)


def _transports(protocol: str) -> list[str]:
    return {"tcp": ["tcp"], "shm": ["shm", "tcp"]}[protocol]


def run_target(protocol: str, buffer_size: int, seed: int) -> int:
    """The target: serves ``buffer_size`` bytes until SIGTERM; SIGUSR1/2 start and
    stop its busy thread."""
    from transfer_engine import Engine

    buf = np.empty(buffer_size, dtype=np.uint8)
    fill_random(buf, seed)
    stop = threading.Event()
    spinner = Spinner()

    def busy(on: bool) -> Callable[[int, Any], None]:
        def handler(signum: int, frame: Any) -> None:
            spinner.set(on)
            os.write(1, f"BUSY {int(on)}\n".encode())
        return handler

    signal.signal(signal.SIGUSR1, busy(True))
    signal.signal(signal.SIGUSR2, busy(False))
    signal.signal(signal.SIGTERM, lambda s, f: stop.set())
    parent = os.getppid()
    try:
        with Engine(f"contention-target-{os.getpid()}", host="127.0.0.1",
                    transports=_transports(protocol)) as eng:
            with eng.register(buf, name=SEGMENT):
                print(f"ENDPOINT {eng.endpoint}", flush=True)
                while not stop.wait(0.05):
                    if os.getppid() != parent:
                        break
    finally:
        spinner.close()
    return 0


class Elsewhere:
    """Another process running a Python loop: it competes for a core, not for a GIL."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen[bytes] | None = None

    def set(self, on: bool) -> None:
        if on and self.proc is None:
            self.proc = subprocess.Popen([sys.executable, "-c", "while True: pass"],
                                         stdin=subprocess.DEVNULL, env=child_env())
        elif not on and self.proc is not None:
            self.proc.kill()
            self.proc.wait(10)
            self.proc = None


def _window(submit: Callable[[], Any], duration: float) -> tuple[int, float, list[float]]:
    """Batches done, seconds and each batch's latency over one measured window."""
    lat: list[float] = []
    clock = time.perf_counter
    t0 = clock()
    end = t0 + duration
    while True:
        a = clock()
        submit().wait(WAIT_TIMEOUT)
        b = clock()
        lat.append(b - a)
        if b >= end:
            break
    return len(lat), clock() - t0, lat


def measure_protocol(protocol: str, shapes: Sequence[tuple[int, int]], duration: float,
                     repeat: int, warmup: float, seed: int,
                     switch_interval: float | None = None) -> dict[str, Any]:
    """Every case for every (block size, batch size) of one protocol, one target."""
    from transfer_engine import Blocks, Descriptor, Engine

    need = max(bs * n for bs, n in shapes) * 8
    buffer_size = max(64 << 20, need)
    child = Child(["-m", "bench.contention", "--_target", "--protocol", protocol,
                   "--buffer_size", str(buffer_size), "--seed", str(seed),
                   *(["--switch-interval", str(switch_interval)]
                     if switch_interval is not None else [])])
    spinner = Spinner()
    elsewhere = Elsewhere()
    out: dict[str, Any] = {}
    try:
        endpoint = child.expect("ENDPOINT ", START_TIMEOUT)

        def target_busy(on: bool) -> None:
            child.send_signal(signal.SIGUSR1 if on else signal.SIGUSR2)
            child.expect(f"BUSY {int(on)}", 10)

        switches: dict[str, Callable[[bool], None]] = {
            "idle": lambda on: None, "busy_elsewhere": elsewhere.set,
            "busy_target": target_busy, "busy_initiator": spinner.set}
        local = np.empty(buffer_size, dtype=np.uint8)
        fill_random(local, seed + 1)
        with Engine(f"contention-initiator-{os.getpid()}", host="127.0.0.1",
                    transports=_transports(protocol)) as eng:
            with eng.register(local, name="contention-local") as seg:
                peer = eng.connect(endpoint, timeout=30)
                rseg = peer.segment(SEGMENT)
                rng = np.random.default_rng(seed + 7)
                for bs, n in shapes:
                    slots = buffer_size // bs
                    batches = [Blocks(seg, rseg, rng.permutation(slots)[:n] * bs,
                                      rng.permutation(slots)[:n] * bs, bs)
                               for _ in range(8)]
                    k = [0]

                    def submit(batches: list[Any] = batches, k: list[int] = k) -> Any:
                        k[0] = (k[0] + 1) % len(batches)
                        return eng.write(peer, batches[k[0]])

                    _window(submit, warmup)
                    runs: dict[str, list[tuple[float, float]]] = {c: [] for c in CASES}
                    for _ in range(repeat):
                        for case in CASES:
                            # each case starts as a process never seen busy would:
                            # the engine holds the GIL only once it saw it contended
                            held.contention.until = 0.0
                            switches[case](True)
                            try:
                                time.sleep(0.05)
                                _window(submit, min(0.2, warmup))
                                count, secs, lat = _window(submit, duration)
                            finally:
                                switches[case](False)
                            runs[case].append((count * n * bs / secs / 1e9,
                                               percentile(lat, 99) * 1e3))
                    # the last batch of this shape, read back byte for byte
                    last = batches[k[0]]
                    fresh = np.empty(n * bs, dtype=np.uint8)
                    with eng.register(fresh) as fseg:
                        pairs = [(Descriptor(fseg, i * bs, bs), Descriptor(rseg, int(r), bs))
                                 for i, r in enumerate(last.remote_offsets.tolist())]
                        eng.read(peer, pairs).wait(WAIT_TIMEOUT)
                    want = np.concatenate([local[int(o):int(o) + bs]
                                           for o in last.local_offsets.tolist()])
                    case_out: dict[str, Any] = {"transport": peer.transport,
                                                "verified": bool(np.array_equal(fresh, want))}
                    idle = median([g for g, _ in runs["idle"]]) or float("nan")
                    for case in CASES:
                        gbps = median([g for g, _ in runs[case]]) or 0.0
                        case_out[f"{case}_gbps"] = round(gbps, 4)
                        case_out[f"{case}_p99_ms"] = round(
                            median([p for _, p in runs[case]]) or 0.0, 3)
                        if case != "idle":
                            case_out[f"{case}_vs_idle"] = round(gbps / idle, 3)
                    case_out["p99_ms"] = case_out["idle_p99_ms"]
                    out[f"{bs}x{n}"] = case_out
    finally:
        elsewhere.set(False)
        spinner.close()
        child.close(timeout=15)
    return out


def _shape(text: str) -> tuple[int, int]:
    bs, _, n = text.lower().partition("x")
    units = {"k": 1 << 10, "m": 1 << 20}
    mult = units.get(bs[-1:], 1)
    return int(bs.rstrip("km")) * mult, int(n)


def _baselines(shapes: list[tuple[int, int]], duration: float) -> dict[str, dict[str, float]]:
    """Per shape, in this run: what the host gives one raw loopback TCP stream (batches
    of the shape's blocks per ``sendmsg``) and one thread's memcpy of those blocks. The
    idle figures swing with the host; against these they can be compared across runs."""
    out = {}
    for bs, n in shapes:
        out[f"{bs}x{n}"] = {
            "socket_gbps": round(socket_gbps(bs, duration=duration, batch_size=n), 4),
            "memcpy_gbps": round(memcpy_gbps(bs, duration=min(duration, 1.0)), 4)}
    return out


def _table(results: dict[str, dict[str, Any]]) -> str:
    lines = [f"{'case':<16}" + "".join(f"{c:>16}" for c in CASES)]
    for proto, shapes in results.items():
        for shape, r in shapes.items():
            gb = "".join(f"{r[c + '_gbps']:9.3f}" + (f" {r[c + '_vs_idle']:5.2f}x"
                                                      if c != "idle" else "       ")
                         for c in CASES)
            p99 = "".join(f"{r[c + '_p99_ms']:14.2f}ms" for c in CASES)
            lines.append(f"{proto + ' ' + shape:<16}{gb}")
            lines.append(f"{'  p99':<16}{p99}")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.contention", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--protocols", default="tcp,shm", help="comma-separated: tcp, shm")
    p.add_argument("--shapes", default="4kx128,1mx16",
                   help="comma-separated BLOCKxBATCH (e.g. 4kx128,1mx16)")
    p.add_argument("--duration", type=float, default=1.0, help="seconds per case and run")
    p.add_argument("--repeat", type=int, default=3, help="runs per case (medians)")
    p.add_argument("--warmup", type=float, default=0.5, help="seconds before the cases")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--switch-interval", "--switch_interval", dest="switch_interval",
                   type=float, default=None, metavar="SECONDS",
                   help="sys.setswitchinterval in both processes (default: Python's 0.005)")
    p.add_argument("--serve", default=os.environ.get("TE_SERVE") or "process,thread",
                   help="comma-separated: where the target serves its rails, each mode a "
                        "run of every case (serve=... of the transports): process, as a "
                        "busy process should (the first mode's figures are `results`), "
                        "thread, the engine's default (`other_serve`)")
    p.add_argument("--baseline", action="store_true",
                   help="also measure, per shape, one raw loopback TCP stream and memcpy, "
                        "and report idle against them (idle_vs_socket, idle_vs_memcpy)")
    p.add_argument("--json", metavar="PATH", default=None)
    p.add_argument("--_target", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--protocol", default="tcp", help=argparse.SUPPRESS)
    p.add_argument("--buffer_size", type=int, default=64 << 20, help=argparse.SUPPRESS)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    if a.switch_interval is not None:
        sys.setswitchinterval(a.switch_interval)
    if a._target:  # serves as the parent's TE_SERVE says
        return run_target(a.protocol, a.buffer_size, a.seed)
    modes = [m for m in a.serve.split(",") if m]
    protocols = [p for p in a.protocols.split(",") if p]
    try:
        for mode in modes:
            serve_mode(mode)  # the transports' own check of a mode
    except ValueError as exc:
        print(exc, file=sys.stderr)
        return 2
    unknown = [p for p in protocols if p not in ("tcp", "shm")]
    if unknown:
        print(f"unknown protocol {unknown[0]!r}", file=sys.stderr)
        return 2
    if not modes or not protocols:
        print("--serve and --protocols name at least one each", file=sys.stderr)
        return 2
    shapes = [_shape(s) for s in a.shapes.split(",") if s]
    by_mode: dict[str, dict[str, dict[str, Any]]] = {}
    for mode in modes:
        os.environ["TE_SERVE"] = mode  # both engines' transports; the target inherits it
        results = by_mode[mode] = {}
        for proto in protocols:
            results[proto] = measure_protocol(proto, shapes, a.duration, a.repeat,
                                              a.warmup, a.seed, a.switch_interval)
            print(f"# {proto} served from a {mode} done", file=sys.stderr, flush=True)
    baselines = _baselines(shapes, a.duration * a.repeat) if a.baseline else {}
    for results in by_mode.values():
        for shape_results in results.values():
            for shape, r in shape_results.items():
                if shape in baselines:
                    b = baselines[shape]
                    r["idle_vs_socket"] = round(r["idle_gbps"] / b["socket_gbps"], 3)
                    r["idle_vs_memcpy"] = round(r["idle_gbps"] / b["memcpy_gbps"], 3)
    for mode, results in by_mode.items():
        print(f"served from a {mode}:")
        print(_table(results))
    for shape, b in baselines.items():
        print(f"baseline {shape}: raw loopback socket {b['socket_gbps']:.3f} GB/s, "
              f"memcpy {b['memcpy_gbps']:.3f} GB/s")
    doc = {"duration": a.duration, "repeat": a.repeat, "cpus": os.cpu_count(),
           "switch_interval": sys.getswitchinterval(), "serve": modes[0],
           "results": by_mode[modes[0]],
           "other_serve": {m: by_mode[m] for m in modes[1:]}, "baselines": baselines}
    if a.json:
        with open(a.json, "w") as f:
            json.dump(doc, f, indent=2)
    else:
        print(json.dumps(doc, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
