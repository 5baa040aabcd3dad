"""transfer_engine_bench's target: the side that registers the buffer and serves it,
run in this process (``--mode target``) or as a child process (:class:`LocalTarget`,
with CPU samples on demand)."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from typing import Any

import numpy as np

from bench.baselines import Child
from bench.engine_bench_options import (
    CPU_SAMPLE_TIMEOUT,
    SEGMENT_NAME,
    TARGET_START_TIMEOUT,
    registry_of,
    target_name,
)
from bench.engine_bench_transports import close_unused, host_cpu, make_transports
from bench.stats import cpu_seconds, fill_random

__all__ = ["run_target", "LocalTarget"]


def run_target(a: argparse.Namespace, *, watch_parent: bool = False) -> int:
    from transfer_engine import Engine

    transports = make_transports(a)
    if a.use_vram:
        from bench.vram import device_buffer

        buf: Any = device_buffer(a.buffer_size, a.gpu_id, a.seed)
    else:
        buf = np.empty(a.buffer_size, dtype=np.uint8)
        fill_random(buf, a.seed)  # pre-faults every page
    stop = threading.Event()

    def on_usr1(signum: int, frame: Any) -> None:
        os.write(1, f"CPU {host_cpu(transports):.6f}\n".encode())

    def on_stop(signum: int, frame: Any) -> None:
        stop.set()

    old = {s: signal.signal(s, h) for s, h in ((signal.SIGUSR1, on_usr1),
                                              (signal.SIGTERM, on_stop),
                                              (signal.SIGINT, on_stop))}
    parent = os.getppid()
    try:
        try:
            eng = Engine(target_name(a), host=a.host, port=a.port,
                         transports=transports, registry=registry_of(a))
        except BaseException:
            close_unused(transports)
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
        if a.use_vram:
            args += ["--use_vram", "--gpu_id", str(a.gpu_id)]
        if a.auto_discovery:
            args += ["--auto_discovery"]
        self.name: str | None = None  # its registry name, with --metadata_server
        if registry_of(a):
            self.name = target_name(a)  # the child joins under this name
            args += ["--metadata_server", a.metadata_server, "--local_server_name",
                     self.name]
        self.child = Child(args)  # the topology file comes through the environment
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
