"""Many peers: what one engine connected to N peers costs, and what a fan-out keeps.

A decode server fed by hundreds of prefill instances (or a prefill instance pushing to
hundreds of decoders) holds a connection to each. This bench starts ``--peers`` target
engines spread over ``--procs`` child processes, connects one initiator engine to all of
them, and reports:

- ``connect_ms_per_peer``, ``threads`` (every thread of the initiator's process),
  ``data_plane_threads`` (those that move bytes: the pump's poller and workers) and
  ``rss_mb`` once every peer is connected;
- ``fanout_gbps``: each round writes one ``--batch_size`` x ``--block_size`` batch to
  every peer at once, then waits for all of them;
- ``one_peer_gbps``: the same number of batches of the same shape, all to one peer;
- ``fanout_vs_one``: their ratio (the cost of many peers), and ``verified`` (peers'
  bytes read back and compared)::

    python -m bench.peers --peers 1000 --procs 4 --json peers.json
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import statistics
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from bench.baselines import Child
from bench.stats import fill_random

__all__ = ["main"]

SEGMENT = "peers-dst"
START_TIMEOUT = 300.0
WAIT_TIMEOUT = 120.0


def _raise_fd_limit() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def run_targets(first: int, count: int, size: int, rails: int | None) -> int:
    """``count`` target engines in this process, each serving ``size`` bytes, until
    SIGTERM or the parent goes."""
    from transfer_engine import Engine
    from transfer_engine.transport.tcp import TcpTransport

    _raise_fd_limit()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda s, f: stop.set())
    parent = os.getppid()
    engines = []
    try:
        for i in range(first, first + count):
            eng = Engine(f"peers-target-{i}", host="127.0.0.1",
                         transports=[TcpTransport(rails=rails)])
            engines.append(eng)
            eng.register(np.zeros(size, dtype=np.uint8), name=SEGMENT)
            print(f"ENDPOINT {eng.endpoint}", flush=True)
        print("READY", flush=True)
        while not stop.wait(0.1):
            if os.getppid() != parent:
                break
    finally:
        for eng in engines:
            eng.close()
    return 0


def _threads() -> tuple[int, int]:
    names = [t.name for t in threading.enumerate()]
    data = sum(1 for n in names if n.startswith(("te-pump", "te-tcp-send", "te-tcp-read")))
    return len(names), data


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1e6


def _round(eng: Any, jobs: Sequence[tuple[Any, Any]]) -> float:
    t0 = time.perf_counter()
    handles = [eng.write(peer, blocks) for peer, blocks in jobs]
    for h in handles:
        h.wait(WAIT_TIMEOUT)
    return time.perf_counter() - t0


def measure(peers: int, procs: int, block_size: int, batch_size: int, rounds: int,
            rails: int | None, seed: int) -> dict[str, Any]:
    from transfer_engine import Blocks, Engine
    from transfer_engine.transport.tcp import TcpTransport

    _raise_fd_limit()
    per_peer = block_size * batch_size
    size = per_peer * 2
    children = []
    endpoints: list[str] = []
    out: dict[str, Any] = {"peers": peers, "procs": procs, "block_size": block_size,
                           "batch_size": batch_size, "rounds": rounds}
    try:
        share = -(-peers // procs)
        for p in range(procs):
            count = min(share, peers - p * share)
            if count <= 0:
                break
            children.append(Child(["-m", "bench.peers", "--_targets", "--first",
                                   str(p * share), "--count", str(count), "--size",
                                   str(size), *(["--rails", str(rails)] if rails else [])]))
        for child in children:
            while True:
                line = child.expect("", START_TIMEOUT)
                if line == "READY":
                    break
                if line.startswith("ENDPOINT "):
                    endpoints.append(line.split()[1])
        local = np.empty(per_peer, dtype=np.uint8)
        fill_random(local, seed)
        back = np.zeros(per_peer, dtype=np.uint8)
        threads_before, _ = _threads()
        with Engine(f"peers-initiator-{os.getpid()}", host="127.0.0.1",
                    transports=[TcpTransport(rails=rails)]) as eng:
            src = eng.register(local, name="peers-src")
            dst = eng.register(back, name="peers-back")
            t0 = time.perf_counter()
            conns = [eng.connect(ep, timeout=60) for ep in endpoints]
            connect_s = time.perf_counter() - t0
            threads, data = _threads()
            out.update(connect_ms_per_peer=round(connect_s / len(conns) * 1e3, 3),
                       threads=threads, threads_before_connect=threads_before,
                       data_plane_threads=data, rss_mb=round(_rss_mb(), 1))
            offsets = np.arange(batch_size, dtype=np.int64) * block_size
            rng = np.random.default_rng(seed + 1)
            fan = [(peer, Blocks(src, peer.segment(SEGMENT), offsets,
                                 rng.permutation(2 * batch_size)[:batch_size] * block_size,
                                 block_size)) for peer in conns]
            one = [(conns[0], fan[0][1])] * len(conns)
            _round(eng, fan)  # warm: first use of every rail
            _round(eng, one)
            fan_s, one_s = [], []
            for _ in range(rounds):
                fan_s.append(_round(eng, fan))
                one_s.append(_round(eng, one))
            total = per_peer * len(conns)
            out["fanout_gbps"] = round(total / statistics.median(fan_s) / 1e9, 3)
            out["one_peer_gbps"] = round(total / statistics.median(one_s) / 1e9, 3)
            out["fanout_vs_one"] = round(out["fanout_gbps"] / out["one_peer_gbps"], 3)
            out["threads_after"], out["data_plane_threads_after"] = _threads()
            verified = True
            for k in sorted({0, len(conns) // 2, len(conns) - 1}):
                peer, blocks = fan[k]
                back[:] = 0
                remote = peer.segment(SEGMENT)
                pull = Blocks(dst, remote, offsets, blocks.remote_offsets, block_size)
                eng.read(peer, pull).wait(WAIT_TIMEOUT)
                verified &= bool(np.array_equal(back, local))
            out["verified"] = verified
    finally:
        for child in children:
            child.close()
    return out


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--peers", type=int, default=100)
    p.add_argument("--procs", type=int, default=4, help="processes the targets run in")
    p.add_argument("--block_size", type=int, default=65536)
    p.add_argument("--batch_size", type=int, default=16)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--rails", type=int, default=None, help="rails per peer (default: tcp's)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--json", metavar="PATH", default=None)
    p.add_argument("--_targets", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--first", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--count", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--size", type=int, default=0, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a._targets:
        return run_targets(a.first, a.count, a.size, a.rails)
    if a.peers < 1 or a.procs < 1 or a.rounds < 1:
        p.error("--peers, --procs and --rounds must be positive")
    out = measure(a.peers, a.procs, a.block_size, a.batch_size, a.rounds, a.rails, a.seed)
    print(json.dumps(out, indent=2))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0 if out.get("verified") else 1


if __name__ == "__main__":
    sys.exit(main())
