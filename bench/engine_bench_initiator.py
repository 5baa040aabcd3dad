"""transfer_engine_bench's initiator: the slots each thread's batches use, the measured
windows (threads submitting one batch each, CPU sampled at both ends), the byte-for-byte
check of what moved, and the runs with their baselines."""

from __future__ import annotations

import argparse
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from bench.baselines import memcpy_gbps, socket_baseline
from bench.engine_bench_options import SEGMENT_NAME, WAIT_TIMEOUT, UsageError, registry_of
from bench.engine_bench_report import header, row
from bench.engine_bench_target import LocalTarget
from bench.engine_bench_transports import close_unused, emulated_nics, host_cpu, make_transports
from bench.stats import expected_bytes, fill_random, percentile

__all__ = ["Layout", "make_layout", "run_initiator"]


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
            nics = emulated_nics(transports)
            wrs0 = sum(nic.wrs_issued for nic in nics)
            cpu0 = host_cpu(transports)
            t0 = time.perf_counter()
            window["end"] = t0 + a.duration
            go.set()
            for th in pool:
                th.join(a.duration + WAIT_TIMEOUT + 30)
            t1 = time.perf_counter()
            cpu1 = host_cpu(transports)
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
        eng = Engine(f"bench-initiator-{os.getpid()}", host=a.host, transports=transports,
                     registry=registry_of(a))
    except BaseException:
        close_unused(transports)
        raise
    with eng:
        if a.use_vram:
            from bench import vram

            local_mem: Any = vram.device_buffer(a.buffer_size, a.gpu_id, a.seed + 1)
        else:
            local_mem = np.empty(a.buffer_size, dtype=np.uint8)
            fill_random(local_mem, a.seed + 1)  # not the target's bytes, and never zeros
        with eng.register(local_mem, name="bench-local") as seg:
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
            print(header(a.baseline), flush=True)
            runs = []
            nics = emulated_nics(transports)
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
                    if a.use_vram:  # one batch's bytes, each way over PCIe
                        run.update(vram.copy_baseline(bs * a.batch_size, a.gpu_id))
                runs.append(run)
                print(row(f"run {i + 1}", run, a.baseline), flush=True)
            if nics:  # the batches _verify checks, moved for real this time
                for nic in nics:
                    nic.copy = True
                submit = eng.write if a.operation == "write" else eng.read
                for t in range(a.threads):
                    for k in sorted({0, layout.reached[t] - 1}):
                        submit(peer, layout.pairs[t][k]).wait(WAIT_TIMEOUT)
            local = vram.to_host(local_mem) if a.use_vram else local_mem
            verified = _verify(eng, peer, seg, local, rseg, layout, a)
            stats = dict(eng.stats)
            used = peer.transport
    return {"runs": runs, "verified": verified, "transport": used, "rails": rails,
            "congestion": congestion, "coalescable_pairs": merged, "engine_stats": stats}
