"""transfer_engine_bench: throughput, latency and CPU cost of the transfer engine.

Takes Mooncake's ``transfer_engine_bench`` flags, so an operator can swap one for the
other::

    # two hosts
    transfer_engine_bench --mode target --protocol tcp            # prints ENDPOINT tcp://...
    transfer_engine_bench --mode initiator --segment_id tcp://HOST:PORT --protocol tcp

    # one command: target as a child process on loopback, baselines in the same run
    transfer_engine_bench --local --protocol tcp --block_size 1048576 --batch_size 16 \\
        --duration 3 --repeat 3 --baseline --json results.json

The initiator runs ``--threads`` threads; each submits batches of ``--batch_size`` blocks
of ``--block_size`` bytes and waits for each batch, for ``--duration`` seconds after a
warm-up: one batch in flight per thread, as in Mooncake's bench (whose blocks are
contiguous with one thread). Unless ``--contiguous``, the blocks of a batch sit in
shuffled slots on both sides, so the engine cannot coalesce them into fewer, larger
pieces. ``--rails`` and ``--slice_size`` override the tcp/shm transports' tuning,
``--spread`` the tcp transport's. The raw socket baseline runs under the host's TCP
congestion control; the engine's rails within one host use a loss-based one (see
:mod:`transfer_engine.transport.tcp`), and ``--baseline_congestion auto`` measures the
socket under that same choice. The JSON names both (``congestion``,
``baseline_socket_congestion``).

Reported per run and as the median of ``--repeat`` runs: GB/s (1e9 bytes/s), blocks
and batches per second, batch latency p50/p99, and CPU seconds per GB for the initiator
and, with ``--local``, for the target (the target prints its CPU time when sent SIGUSR1;
it is sampled at both ends of every measured window). After the runs one sample batch
per thread is checked byte for byte (``verified`` in the JSON).

Target protocol on stdout, one line each: ``ENDPOINT <control endpoint>`` once it
serves; ``CPU <user+sys seconds>`` on every SIGUSR1; a JSON object (its CPU time and
engine counters) when it exits (SIGINT/SIGTERM, its deadline, or its parent gone).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from bench.baselines import Child, memcpy_gbps, socket_baseline
from bench.stats import cpu_seconds, expected_bytes, fill_random, median, percentile
from transfer_engine.transport.tcp import check_congestion

__all__ = ["main", "build_parser"]

DEFAULT_BUFFER = 256 << 20
SEGMENT_NAME = "bench"
EXIT_USAGE = 2  # bad flags, or a protocol this host cannot run
WAIT_TIMEOUT = 60.0  # bound on one batch
TARGET_START_TIMEOUT = 120.0
CPU_SAMPLE_TIMEOUT = 10.0


class UsageError(Exception):
    """A flag combination or protocol this host cannot run (exit code 2)."""


def _size(text: str) -> int:
    """Bytes, with an optional K/M/G suffix (binary): ``65536``, ``64K``, ``1G``."""
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    mult = 1
    if t and t[-1] in "KMG":
        mult = 1 << {"K": 10, "M": 20, "G": 30}[t[-1]]
        t = t[:-1]
    try:
        value = int(t) * mult
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a byte count: {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive: {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="transfer_engine_bench",
        description="Throughput, latency and CPU cost of the transfer engine "
                    "(Mooncake transfer_engine_bench flags).")
    p.add_argument("--mode", choices=["initiator", "target"], default="initiator")
    p.add_argument("--protocol", choices=["tcp", "shm", "auto", "rdma"], default="tcp",
                   help="shm: same-host cross-memory attach, tcp as fallback; auto: the "
                        "engine's default choice")
    p.add_argument("--operation", choices=["read", "write"], default="read")
    p.add_argument("--block_size", type=_size, default=65536)
    p.add_argument("--batch_size", type=int, default=128)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--duration", type=float, default=5.0, help="seconds per measured run")
    p.add_argument("--buffer_size", type=_size, default=DEFAULT_BUFFER,
                   help="bytes registered on each side (default 256 MiB)")
    p.add_argument("--segment_id", default=None,
                   help="the target's endpoint (tcp://HOST:PORT or HOST:PORT)")
    p.add_argument("--device_name", default="",
                   help="RDMA NICs, comma-separated (e.g. mlx5_0,mlx5_1)")
    p.add_argument("--metadata_server", default=None,
                   help="only P2PHANDSHAKE (peer-to-peer handshake) is supported")
    p.add_argument("--local", action="store_true",
                   help="run the target as a child process on loopback")
    p.add_argument("--baseline", action="store_true",
                   help="also measure a raw one-stream socket and one-thread memcpy")
    p.add_argument("--baseline_congestion", metavar="NAME", default=None,
                   help="TCP congestion control of the raw socket baseline (default: the "
                        "host's; 'auto': what the engine's rails within one host use)")
    p.add_argument("--json", metavar="PATH", default=None, help="write the results here")
    p.add_argument("--repeat", type=int, default=1, help="runs; the medians are reported")
    p.add_argument("--contiguous", action="store_true",
                   help="blocks of a batch in consecutive slots (coalescable)")
    p.add_argument("--rails", type=int, default=None,
                   help="rails per peer (default: the transport's own)")
    p.add_argument("--slice_size", type=_size, default=None,
                   help="bytes per work request on tcp/shm (default: the transport's own)")
    p.add_argument("--spread", type=int, default=None,
                   help="most tcp rails one transfer is cut over (default: what the "
                        "host's cores allow)")
    p.add_argument("--api", choices=("blocks", "pairs"), default="blocks",
                   help="how batches are described: Blocks arrays, or a Descriptor pair "
                        "per block")
    p.add_argument("--emulated", action="store_true",
                   help="with --protocol rdma: the emulated verbs provider (no NIC needed). "
                        "Measured runs count bytes instead of moving them and report "
                        "host_us_per_wr and host_cpu_s_per_gb, the CPU time of the "
                        "engine's own threads (the emulated NICs' threads left out); "
                        "the verified batches are moved for real")
    p.add_argument("--warmup", type=float, default=0.5, help="seconds before each run")
    p.add_argument("--seed", type=int, default=1234,
                   help="the target fills its buffer from this seed (checks READs)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on and advertise (a target reached from "
                        "another host needs this host's address)")
    p.add_argument("--port", type=int, default=0, help="target control port (0: any)")
    p.add_argument("--secret-file", "--secret_file", dest="secret_file", metavar="PATH",
                   default=None,
                   help="control secret shared by initiator and target (the same as "
                        "TE_CONTROL_SECRET_FILE; TE_CONTROL_SECRET also works): control "
                        "messages are signed and rails open with a ticket's proof")
    p.add_argument("--grace", type=float, default=600.0,
                   help="target: seconds served beyond duration x repeat")
    return p


# --- transports --------------------------------------------------------------------

def _check_flags(a: argparse.Namespace) -> None:
    ms = a.metadata_server
    if ms not in (None, "", "P2PHANDSHAKE"):
        raise UsageError(f"--metadata_server {ms}: a metadata registry is not supported "
                         "yet; omit the flag or pass P2PHANDSHAKE (peer-to-peer handshake)")
    for name in ("batch_size", "threads", "repeat"):
        if getattr(a, name) < 1:
            raise UsageError(f"--{name} must be at least 1")
    if a.rails is not None and a.rails < 1:
        raise UsageError("--rails must be at least 1")
    if a.spread is not None and a.spread < 1:
        raise UsageError("--spread must be at least 1")
    if a.baseline_congestion is not None:
        try:
            check_congestion(a.baseline_congestion)
        except ValueError as exc:
            raise UsageError(f"--baseline_congestion: {exc}") from None
    if a.duration <= 0:
        raise UsageError("--duration must be positive")
    if a.secret_file is not None:
        try:
            with open(a.secret_file, "rb") as f:
                if len(f.read().strip()) < 16:
                    raise UsageError(f"--secret-file {a.secret_file}: a control secret "
                                     "needs at least 16 bytes")
        except OSError as exc:
            raise UsageError(f"--secret-file: {exc}") from None
    if a.mode == "initiator" and not a.local and not a.segment_id:
        raise UsageError("--mode initiator needs --segment_id (the target's endpoint) "
                         "or --local")
    if a.emulated and a.protocol != "rdma":
        raise UsageError("--emulated is for --protocol rdma")
    if a.protocol == "rdma" and (a.rails is not None or a.slice_size is not None
                                 or a.spread is not None):
        raise UsageError("--rails, --slice_size and --spread are for tcp and shm; rdma "
                         "opens one rail per NIC pair")


def make_transports(a: argparse.Namespace) -> list[Any] | None:
    """Transport objects (or names) for ``Engine(transports=...)``; None = default.

    Raises :class:`UsageError` when rdma is asked for and cannot run here.
    """
    if a.protocol == "rdma":
        from transfer_engine.errors import TransferEngineError
        try:
            from transfer_engine.transport.rdma import RdmaTransport
            devices = a.device_name or None
            if a.emulated:
                return [RdmaTransport(devices=devices, host=a.host, provider="emulated")]
            return [RdmaTransport(devices=devices, host=a.host)]
        except (TransferEngineError, ImportError, OSError) as exc:
            what = f"device {a.device_name}" if a.device_name else "an RDMA device"
            msg = " ".join(str(exc).split())
            raise UsageError(f"--protocol rdma needs {what} with an active port, "
                             f"none usable here: {msg}") from None
    if a.rails is None and a.slice_size is None and a.spread is None:
        return {"tcp": ["tcp"], "shm": ["shm", "tcp"], "auto": None}[a.protocol]
    from transfer_engine.transport.shm import ShmTransport
    from transfer_engine.transport.tcp import TcpTransport
    rails = {} if a.rails is None else {"rails": a.rails}
    sliced = {} if a.slice_size is None else {"slice_size": a.slice_size}
    tcp = TcpTransport(host=a.host, spread=a.spread, **rails, **sliced)
    if a.protocol == "shm" or a.protocol == "auto":
        return [ShmTransport(**rails, **sliced), tcp]
    return [tcp]


def _emulated_nics(transports: list[Any] | None) -> list[Any]:
    return [nic for t in transports or [] if hasattr(t, "emulated_nics")
            for nic in t.emulated_nics()]


def _host_cpu(transports: list[Any] | None) -> float:
    """This process's CPU seconds less the emulated NICs' threads (the "hardware")."""
    return cpu_seconds() - float(sum(nic.cpu_seconds() for nic in _emulated_nics(transports)))


def _close_unused(transports: list[Any] | None) -> None:
    for t in transports or []:
        if not isinstance(t, str):
            t.close()


# --- target ------------------------------------------------------------------------

def run_target(a: argparse.Namespace, *, watch_parent: bool = False) -> int:
    from transfer_engine import Engine

    transports = make_transports(a)
    buf = np.empty(a.buffer_size, dtype=np.uint8)
    fill_random(buf, a.seed)  # pre-faults every page
    stop = threading.Event()

    def on_usr1(signum: int, frame: Any) -> None:
        os.write(1, f"CPU {_host_cpu(transports):.6f}\n".encode())

    def on_stop(signum: int, frame: Any) -> None:
        stop.set()

    old = {s: signal.signal(s, h) for s, h in ((signal.SIGUSR1, on_usr1),
                                              (signal.SIGTERM, on_stop),
                                              (signal.SIGINT, on_stop))}
    parent = os.getppid()
    try:
        try:
            eng = Engine(f"bench-target-{os.getpid()}", host=a.host, port=a.port,
                         transports=transports)
        except BaseException:
            _close_unused(transports)
            raise
        with eng:
            with eng.register(buf, name=SEGMENT_NAME):
                print(f"ENDPOINT {eng.endpoint}", flush=True)
                print(f"# target {eng!r}: {a.buffer_size} bytes as {SEGMENT_NAME!r}",
                      file=sys.stderr, flush=True)
                deadline = time.monotonic() + a.duration * a.repeat + a.grace
                while not stop.is_set() and time.monotonic() < deadline:
                    time.sleep(0.05)
                    if watch_parent and os.getppid() != parent:
                        break
                stats = dict(eng.stats)
        ru_cpu = cpu_seconds()
        print(json.dumps({"role": "target", "cpu_s": round(ru_cpu, 6), "stats": stats}),
              flush=True)
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    return 0


class LocalTarget:
    """The target as a child process, with CPU samples on demand."""

    def __init__(self, a: argparse.Namespace) -> None:
        args = ["-m", "bench.transfer_engine_bench", "--mode", "target", "--_child",
                "--protocol", a.protocol, "--buffer_size", str(a.buffer_size),
                "--seed", str(a.seed), "--host", a.host, "--duration", str(a.duration),
                "--repeat", str(a.repeat), "--grace", str(self.grace(a))]
        if a.rails is not None:
            args += ["--rails", str(a.rails)]
        if a.slice_size is not None:
            args += ["--slice_size", str(a.slice_size)]
        if a.device_name:
            args += ["--device_name", a.device_name]
        if a.emulated:
            args += ["--emulated"]
        self.child = Child(args)
        try:
            self.endpoint = self.child.expect("ENDPOINT ", TARGET_START_TIMEOUT)
        except BaseException:
            self.child.close(timeout=5)
            raise
        self.exit_info: dict[str, Any] | None = None

    @staticmethod
    def grace(a: argparse.Namespace) -> float:
        per_run = float(a.warmup) + (2 * float(a.duration) + 15 if a.baseline else 5)
        return int(a.repeat) * per_run + 120

    def cpu(self) -> float:
        self.child.send_signal(signal.SIGUSR1)
        return float(self.child.expect("CPU ", CPU_SAMPLE_TIMEOUT))

    def close(self) -> None:
        try:
            if self.child.proc.poll() is None:
                self.child.send_signal(signal.SIGTERM)
                try:
                    self.exit_info = json.loads("{" + self.child.expect("{", 15))
                except (TimeoutError, RuntimeError, ValueError):
                    self.exit_info = None
        finally:
            self.child.close(timeout=15)

    def __enter__(self) -> LocalTarget:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# --- initiator ---------------------------------------------------------------------

@dataclass
class Layout:
    """Which slots each thread's batches use: ``local[t][k]``/``remote[t][k]`` are the
    slot numbers (in block units) of batch ``k`` of thread ``t``, in submission order."""

    local: np.ndarray  # (threads, batches, batch_size)
    remote: np.ndarray
    pairs: list[list[Any]] = field(default_factory=list)  # per thread: each batch's pairs
    reached: list[int] = field(default_factory=list)  # batches of each thread moved so far


def make_layout(a: argparse.Namespace, local_len: int, remote_len: int) -> Layout:
    bs, bsz, threads = a.block_size, a.batch_size, a.threads
    n_local, n_remote = local_len // bs, remote_len // bs
    n = min(n_local, n_remote)
    per_batch = bsz * threads
    batches = min(n // per_batch, 4096)
    if batches < 1:
        raise UsageError(
            f"--buffer_size too small: {threads} thread(s) x {bsz} blocks of {bs} bytes "
            f"need {per_batch * bs} bytes on each side (local {local_len}, remote "
            f"{remote_len})")
    need = batches * per_batch
    if a.contiguous:
        loc = np.arange(need, dtype=np.int64)
        rem = np.arange(need, dtype=np.int64)
    else:
        rng = np.random.default_rng(a.seed + 7)
        loc = rng.permutation(n_local)[:need].astype(np.int64)
        rem = rng.permutation(n_remote)[:need].astype(np.int64)
    # thread t takes batches t, t+threads, ...: every batch has its own slots on both sides
    shape = (batches, threads, bsz)
    loc = loc.reshape(shape).transpose(1, 0, 2).copy()
    rem = rem.reshape(shape).transpose(1, 0, 2).copy()
    return Layout(loc, rem, reached=[0] * threads)


def _coalescable(layout: Layout) -> int:
    """Pairs the engine's planner would merge (sorted by remote, adjacent on both sides)."""
    merged = 0
    for t in range(layout.local.shape[0]):
        for k in range(layout.local.shape[1]):
            order = np.argsort(layout.remote[t, k], kind="stable")
            lo, ro = layout.local[t, k][order], layout.remote[t, k][order]
            merged += int(np.count_nonzero((np.diff(lo) == 1) & (np.diff(ro) == 1)))
    return merged


@dataclass
class _Worker:
    latencies: list[float] = field(default_factory=list)
    batches: int = 0
    moved: int = 0  # batches completed, warm-up included
    error: BaseException | None = None


def _measure(eng: Any, peer: Any, layout: Layout, a: argparse.Namespace,
             target: LocalTarget | None, transports: list[Any] | None = None
             ) -> dict[str, Any]:
    """One warm-up then one measured window; returns the run's figures."""
    submit = eng.write if a.operation == "write" else eng.read
    threads = a.threads
    warm_stop = threading.Event()
    go = threading.Event()
    abort = threading.Event()
    barrier = threading.Barrier(threads + 1, timeout=WAIT_TIMEOUT + 30)
    window = {"end": 0.0}
    workers = [_Worker() for _ in range(threads)]

    def loop(t: int) -> None:
        w = workers[t]
        batches = layout.pairs[t]
        nb = len(batches)
        k = 0
        try:
            while not warm_stop.is_set():
                submit(peer, batches[k]).wait(WAIT_TIMEOUT)
                k = k + 1 if k + 1 < nb else 0
                w.moved += 1
            barrier.wait()
            go.wait(WAIT_TIMEOUT + 30)
            if abort.is_set():
                return
            end = window["end"]
            lat = w.latencies
            clock = time.perf_counter
            while True:
                t0 = clock()
                submit(peer, batches[k]).wait(WAIT_TIMEOUT)
                t1 = clock()
                lat.append(t1 - t0)
                k = k + 1 if k + 1 < nb else 0
                if t1 >= end:
                    break
            w.batches = len(lat)
        except BaseException as exc:  # reported by the main thread
            w.error = exc
            abort.set()
            barrier.abort()
        finally:
            w.moved += len(w.latencies)
            layout.reached[t] = max(layout.reached[t], min(w.moved, nb))

    pool = [threading.Thread(target=loop, args=(t,), name=f"bench-{t}", daemon=True)
            for t in range(threads)]
    for th in pool:
        th.start()
    try:
        abort.wait(a.warmup)
        warm_stop.set()
        try:
            barrier.wait()
        except threading.BrokenBarrierError:
            pass
        if not abort.is_set():
            tcpu0 = target.cpu() if target is not None else None
            nics = _emulated_nics(transports)
            wrs0 = sum(nic.wrs_issued for nic in nics)
            cpu0 = _host_cpu(transports)
            t0 = time.perf_counter()
            window["end"] = t0 + a.duration
            go.set()
            for th in pool:
                th.join(a.duration + WAIT_TIMEOUT + 30)
            t1 = time.perf_counter()
            cpu1 = _host_cpu(transports)
            wrs1 = sum(nic.wrs_issued for nic in nics)
            tcpu1 = target.cpu() if target is not None else None
    finally:
        if any(w.error for w in workers):
            abort.set()
        go.set()
        for th in pool:
            th.join(WAIT_TIMEOUT + 5)
    errors = [w.error for w in workers if w.error is not None]
    if errors:  # the first real one, not a sibling's broken barrier
        errors.sort(key=lambda e: isinstance(e, threading.BrokenBarrierError))
        raise errors[0]
    if any(th.is_alive() for th in pool):
        raise TimeoutError("a bench thread did not finish")
    batches = sum(w.batches for w in workers)
    nbytes = batches * a.batch_size * a.block_size
    wall = t1 - t0
    gb = nbytes / 1e9
    lat_us = [x * 1e6 for w in workers for x in w.latencies]
    cpu_i = cpu1 - cpu0
    cpu_t = (tcpu1 - tcpu0) if tcpu0 is not None and tcpu1 is not None else None
    host: dict[str, Any] = {}
    if nics:  # emulated rdma: the CPU time of our threads, both sides with --local
        wrs = wrs1 - wrs0
        cpu_host = cpu_i + (cpu_t or 0.0)
        host = {"work_requests": wrs,
                "host_us_per_wr": cpu_host / wrs * 1e6 if wrs else None,
                "host_cpu_s_per_gb": cpu_host / gb if gb else None,
                "host_cpu_sides": "initiator+target" if cpu_t is not None else "initiator"}
    return {**host,
        "gbps": gb / wall,
        "ops_per_s": batches * a.batch_size / wall,
        "batches_per_s": batches / wall,
        "p50_us": percentile(lat_us, 50),
        "p99_us": percentile(lat_us, 99),
        "bytes": nbytes,
        "seconds": wall,
        "cpu_s_initiator": cpu_i,
        "cpu_s_target": cpu_t,
        "cpu_s_per_gb_initiator": cpu_i / gb if gb else None,
        "cpu_s_per_gb_target": cpu_t / gb if gb and cpu_t is not None else None,
    }


def _verify(eng: Any, peer: Any, local_seg: Any, local: np.ndarray, rseg: Any,
            layout: Layout, a: argparse.Namespace) -> bool:
    """Checks the first and the last batch each thread moved, byte for byte."""
    from transfer_engine import Descriptor

    bs = a.block_size
    ok = True
    for t in range(layout.local.shape[0]):
        if layout.reached[t] < 1:
            return False
        for k in sorted({0, layout.reached[t] - 1}):
            lslots, rslots = layout.local[t, k].tolist(), layout.remote[t, k].tolist()
            if a.operation == "read":
                # the target filled its buffer from --seed: regenerate what it holds
                for ls, rs in zip(lslots, rslots, strict=True):
                    want = expected_bytes(a.seed, rs * bs, bs)
                    if not np.array_equal(local[ls * bs:(ls + 1) * bs], want):
                        ok = False
            else:
                # read the target's bytes back into a fresh buffer and compare
                fresh = np.empty(len(rslots) * bs, dtype=np.uint8)
                fill_random(fresh, a.seed + 99)
                with eng.register(fresh) as fseg:
                    pairs = [(Descriptor(fseg, i * bs, bs), Descriptor(rseg, rs * bs, bs))
                             for i, rs in enumerate(rslots)]
                    eng.read(peer, pairs).wait(WAIT_TIMEOUT)
                for i, ls in enumerate(lslots):
                    if not np.array_equal(fresh[i * bs:(i + 1) * bs],
                                          local[ls * bs:(ls + 1) * bs]):
                        ok = False
    return ok


def run_initiator(a: argparse.Namespace, endpoint: str,
                  target: LocalTarget | None) -> dict[str, Any]:
    from transfer_engine import Blocks, Descriptor, Engine

    transports = make_transports(a)
    try:
        eng = Engine(f"bench-initiator-{os.getpid()}", host=a.host, transports=transports)
    except BaseException:
        _close_unused(transports)
        raise
    with eng:
        local = np.empty(a.buffer_size, dtype=np.uint8)
        fill_random(local, a.seed + 1)  # not the target's bytes, and never zeros
        with eng.register(local, name="bench-local") as seg:
            peer = eng.connect(endpoint, timeout=30)
            rseg = peer.segment(SEGMENT_NAME)
            layout = make_layout(a, seg.length, rseg.length)
            bs = a.block_size
            if a.api == "blocks":
                layout.pairs = [[Blocks(seg, rseg, lb * bs, rb * bs, bs)
                                 for lb, rb in zip(layout.local[t], layout.remote[t],
                                                   strict=True)]
                                for t in range(a.threads)]
            else:
                layout.pairs = [[[(Descriptor(seg, ls * bs, bs),
                                   Descriptor(rseg, rs * bs, bs))
                                  for ls, rs in zip(lb.tolist(), rb.tolist(), strict=True)]
                                 for lb, rb in zip(layout.local[t], layout.remote[t],
                                                   strict=True)]
                                for t in range(a.threads)]
            merged = _coalescable(layout)
            rails = {name: len(r) for name, r in peer.rails.items()}
            congestion = getattr(peer.rails.get("tcp", [None])[0], "congestion", None)
            cc = f", congestion {congestion}" if congestion else ""
            print(f"# {a.operation} via {peer.transport} (rails {rails}{cc}), "
                  f"{a.threads} thread(s) x {a.batch_size} x {bs} B blocks, "
                  f"{'contiguous' if a.contiguous else 'shuffled'} slots "
                  f"({merged} coalescable pairs), {a.duration:g} s x {a.repeat}", flush=True)
            print(_header(a.baseline), flush=True)
            runs = []
            nics = _emulated_nics(transports)
            for nic in nics:
                nic.copy = False  # counting: the measured runs move no byte
            for i in range(a.repeat):
                run = _measure(eng, peer, layout, a, target, transports)
                run["transport"] = peer.transport
                if a.baseline:
                    sock = socket_baseline(bs, duration=a.duration, batch_size=a.batch_size,
                                           contiguous=a.contiguous,
                                           congestion=a.baseline_congestion)
                    run["baseline_socket_gbps"] = sock["gbps"]
                    run["baseline_socket_congestion"] = sock["congestion"]
                    run["baseline_socket_cpu_s_per_gb"] = (sock["cpu_s_per_gb_sender"]
                                                           + sock["cpu_s_per_gb_receiver"])
                    run["baseline_memcpy_gbps"] = memcpy_gbps(
                        bs, duration=max(0.5, min(a.duration, 2.0)),
                        contiguous=a.contiguous)
                runs.append(run)
                print(_row(f"run {i + 1}", run, a.baseline), flush=True)
            if nics:  # the batches _verify checks, moved for real this time
                for nic in nics:
                    nic.copy = True
                submit = eng.write if a.operation == "write" else eng.read
                for t in range(a.threads):
                    for k in sorted({0, layout.reached[t] - 1}):
                        submit(peer, layout.pairs[t][k]).wait(WAIT_TIMEOUT)
            verified = _verify(eng, peer, seg, local, rseg, layout, a)
            stats = dict(eng.stats)
            used = peer.transport
    return {"runs": runs, "verified": verified, "transport": used, "rails": rails,
            "congestion": congestion, "coalescable_pairs": merged, "engine_stats": stats}


# --- reporting ---------------------------------------------------------------------

_COLS = [("GB/s", "gbps", "{:8.3f}"), ("blocks/s", "ops_per_s", "{:10.0f}"),
         ("p50 us", "p50_us", "{:9.0f}"), ("p99 us", "p99_us", "{:9.0f}"),
         ("cpu/GB ini", "cpu_s_per_gb_initiator", "{:10.3f}"),
         ("cpu/GB tgt", "cpu_s_per_gb_target", "{:10.3f}")]
_BASE_COLS = [("sock GB/s", "baseline_socket_gbps", "{:9.3f}"),
              ("memcpy GB/s", "baseline_memcpy_gbps", "{:11.3f}")]


def _header(baseline: bool) -> str:
    cols = _COLS + (_BASE_COLS if baseline else [])
    return f"{'':8}" + " ".join(f"{name:>{len(fmt.format(0))}}" for name, _, fmt in cols)


def _row(label: str, run: dict[str, Any], baseline: bool) -> str:
    cols = _COLS + (_BASE_COLS if baseline else [])
    cells = []
    for _, key, fmt in cols:
        v = run.get(key)
        width = len(fmt.format(0))
        cells.append(fmt.format(v) if v is not None else f"{'-':>{width}}")
    return f"{label:8}" + " ".join(cells)


def _authenticated() -> bool:
    """Whether this run's engines sign control messages (a control secret is set)."""
    from transfer_engine.control.auth import AuthConfig

    return AuthConfig.from_env().secret is not None


def summarize(a: argparse.Namespace, res: dict[str, Any]) -> dict[str, Any]:
    runs = res["runs"]
    keys = ["gbps", "ops_per_s", "batches_per_s", "p50_us", "p99_us",
            "cpu_s_per_gb_initiator", "cpu_s_per_gb_target"]
    if runs and "host_us_per_wr" in runs[0]:
        keys += ["host_us_per_wr", "host_cpu_s_per_gb"]
    out: dict[str, Any] = {
        "protocol": a.protocol, "transport": res["transport"], "operation": a.operation,
        "block_size": a.block_size, "batch_size": a.batch_size, "threads": a.threads,
        "rails": res["rails"], "congestion": res.get("congestion"), "spread": a.spread,
        "api": a.api, "slice_size": a.slice_size, "emulated": a.emulated,
        "contiguous": a.contiguous,
        "duration": a.duration, "repeat": a.repeat, "buffer_size": a.buffer_size,
        "coalescable_pairs": res["coalescable_pairs"],
        "authenticated": _authenticated(),  # main() says for runs with --secret-file
    }
    for k in keys:
        out[k] = median([r[k] for r in runs])
    ci, ct = out["cpu_s_per_gb_initiator"], out["cpu_s_per_gb_target"]
    out["cpu_s_per_gb_total"] = median(
        [r["cpu_s_per_gb_initiator"] + r["cpu_s_per_gb_target"] for r in runs
         if r["cpu_s_per_gb_initiator"] is not None and r["cpu_s_per_gb_target"] is not None]
    ) if ci is not None and ct is not None else None
    if a.baseline:
        sock = median([r["baseline_socket_gbps"] for r in runs])
        mem = median([r["baseline_memcpy_gbps"] for r in runs])
        out["baseline_socket_gbps"] = sock
        out["baseline_memcpy_gbps"] = mem
        out["baseline_socket_cpu_s_per_gb"] = median(
            [r["baseline_socket_cpu_s_per_gb"] for r in runs])
        out["baseline_socket_congestion"] = runs[0].get("baseline_socket_congestion")
        # each run's engine figure against the baselines measured right after it: the
        # machine's mood changes between runs, less within one
        out["ratio_vs_socket"] = median([r["gbps"] / r["baseline_socket_gbps"] for r in runs
                                         if r["baseline_socket_gbps"]])
        out["ratio_vs_memcpy"] = median([r["gbps"] / r["baseline_memcpy_gbps"] for r in runs
                                         if r["baseline_memcpy_gbps"]])
    out["verified"] = res["verified"]
    out["runs"] = runs
    out["engine_stats"] = res["engine_stats"]
    out["host"] = {"cpus": os.cpu_count(), "python": platform.python_version(),
                   "machine": platform.machine()}
    return out


def _print_summary(a: argparse.Namespace, out: dict[str, Any]) -> None:
    print(_row("median", out, a.baseline))
    extra = []
    if out.get("cpu_s_per_gb_total") is not None:
        extra.append(f"cpu/GB both sides {out['cpu_s_per_gb_total']:.3f}")
    if a.baseline:
        extra.append(f"socket cpu/GB both sides {out['baseline_socket_cpu_s_per_gb']:.3f}")
        sock_cc = out.get("baseline_socket_congestion")
        extra.append(f"vs socket {out['ratio_vs_socket']:.2f}x"
                     + (f" (socket under {sock_cc})" if sock_cc else ""))
        extra.append(f"vs memcpy {out['ratio_vs_memcpy']:.2f}x")
    if out.get("host_us_per_wr") is not None:
        extra.append(f"host {out['host_us_per_wr']:.2f} us/WR, "
                     f"{out['host_cpu_s_per_gb']:.4f} cpu s/GB (emulated NIC, counting)")
    extra.append(f"verified {str(out['verified']).lower()}")
    extra.append("authenticated" if out.get("authenticated") else "no control secret")
    print("# " + ", ".join(extra), flush=True)


# --- entry point -------------------------------------------------------------------

def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    parser.add_argument("--_child", action="store_true", help=argparse.SUPPRESS)
    a = parser.parse_args(argv)
    saved = {k: os.environ.get(k) for k in ("TE_CONTROL_SECRET", "TE_CONTROL_SECRET_FILE")}
    try:
        _check_flags(a)
        if a.secret_file is not None:  # for our engines and the local target's
            os.environ["TE_CONTROL_SECRET_FILE"] = os.path.abspath(a.secret_file)
            os.environ.pop("TE_CONTROL_SECRET", None)
            authenticated = True
        else:
            authenticated = _authenticated()
        if a.mode == "target":
            return run_target(a, watch_parent=a._child)
        if a.protocol == "rdma":  # fail before starting anything
            _close_unused(make_transports(a))
        if a.local:
            with LocalTarget(a) as target:
                res = run_initiator(a, target.endpoint, target)
        else:
            endpoint = a.segment_id if "://" in a.segment_id else f"tcp://{a.segment_id}"
            res = run_initiator(a, endpoint, None)
    except UsageError as exc:
        print(f"transfer_engine_bench: error: {exc}", file=sys.stderr, flush=True)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("transfer_engine_bench: interrupted", file=sys.stderr)
        return 130
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    out = summarize(a, res)
    out["authenticated"] = authenticated
    _print_summary(a, out)
    if a.json:
        folder = os.path.dirname(a.json)
        if folder:
            os.makedirs(folder, exist_ok=True)
        with open(a.json, "w") as f:
            json.dump(out, f, indent=2)
            f.write("\n")
    return 0 if out["verified"] else 1


if __name__ == "__main__":
    sys.exit(main())
