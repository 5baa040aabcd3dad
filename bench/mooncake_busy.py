"""Mooncake's Python API with a busy target: how long 100 WRITE+READ pairs of 1 MiB take
while the target's main thread runs a Python loop, per serving mode, in one run.

    python -m bench.mooncake_busy [--rounds 100] [--json PATH]

The target is a child process on ``mooncake.engine``'s API (P2P handshake, tcp) that
registers 64 MiB and then spins; the initiator writes random bytes and reads them back,
checking every byte. ``TE_SERVE`` picks the target's serving mode (``thread`` or
``process``, the drop-in's default); Mooncake's own engine, measured on this kind of
machine, took 0.1-0.5 s for the same loop.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any

import numpy as np

from bench.baselines import child_env

MiB = 1 << 20


def target() -> int:
    from transfer_engine.connectors.mooncake import TransferEngine

    engine = TransferEngine()
    if engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") != 0:
        return 1
    buf = np.zeros(64 * MiB, dtype=np.uint8)
    if engine.register_memory(buf.ctypes.data, buf.nbytes) != 0:
        return 1
    print(engine.get_rpc_port(), buf.ctypes.data, flush=True)
    parent, start, n = os.getppid(), time.monotonic(), 0
    while os.getppid() == parent and time.monotonic() - start < 300:
        for _ in range(100000):  # pure bytecode: the GIL is given up only on demand
            n += 1
    return 0


def measure(serve: str, rounds: int) -> dict[str, Any]:
    from transfer_engine.connectors.mooncake import TransferEngine

    env = {**child_env(), "TE_SERVE": serve}
    proc = subprocess.Popen([sys.executable, "-m", "bench.mooncake_busy", "--_target"],
                            stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stdout is not None
        port, remote = (int(v) for v in proc.stdout.readline().split())
        engine = TransferEngine()
        assert engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
        src = np.random.default_rng(7).integers(0, 256, MiB, dtype=np.uint8)
        back = np.zeros_like(src)
        for buf in (src, back):
            assert engine.register_memory(buf.ctypes.data, buf.nbytes) == 0
        name, exact = f"127.0.0.1:{port}", True
        start = time.perf_counter()
        for i in range(rounds):
            at = remote + (i % 64) * MiB
            assert engine.transfer_sync_write(name, src.ctypes.data, at, MiB) == 0
            assert engine.transfer_sync_read(name, back.ctypes.data, at, MiB) == 0
        seconds = time.perf_counter() - start
        exact = bool(np.array_equal(src, back))
        engine.close()
        return {"serve": serve, "seconds": round(seconds, 3), "verified": exact}
    finally:
        proc.kill()
        proc.wait(10)
        if proc.stdout is not None:
            proc.stdout.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.mooncake_busy", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=100)
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--_target", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a._target:
        return target()
    results = [measure(serve, a.rounds) for serve in ("thread", "process")]
    for r in results:
        print(f"serve={r['serve']:<8} {a.rounds} WRITE+READ of 1 MiB, busy target: "
              f"{r['seconds']:.2f} s, verified {r['verified']}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"rounds": a.rounds, "results": results}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
