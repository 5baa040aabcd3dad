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

Its parts: :mod:`bench.engine_bench_options` (flags), :mod:`bench.engine_bench_transports`,
:mod:`bench.engine_bench_target`, :mod:`bench.engine_bench_initiator` and
:mod:`bench.engine_bench_report`; this module is the entry point
(``python -m bench.transfer_engine_bench``, the ``transfer_engine_bench`` command).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence

from bench.engine_bench_initiator import run_initiator
from bench.engine_bench_options import (
    EXIT_USAGE,
    UsageError,
    build_parser,
    check_flags,
    registry_of,
)
from bench.engine_bench_report import control_signed, print_summary, summarize
from bench.engine_bench_target import LocalTarget, run_target
from bench.engine_bench_transports import close_unused, make_transports
from transfer_engine.topology import TOPOLOGY_ENV

__all__ = ["main", "build_parser"]


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    parser.add_argument("--_child", action="store_true", help=argparse.SUPPRESS)
    a = parser.parse_args(argv)
    saved = {k: os.environ.get(k) for k in ("TE_CONTROL_SECRET", "TE_CONTROL_SECRET_FILE",
                                            TOPOLOGY_ENV)}
    try:
        check_flags(a)
        if a.nic_priority_matrix is not None:  # for our engines and the local target's
            os.environ[TOPOLOGY_ENV] = os.path.abspath(a.nic_priority_matrix)
        if a.secret_file is not None:  # for our engines and the local target's
            os.environ["TE_CONTROL_SECRET_FILE"] = os.path.abspath(a.secret_file)
            os.environ.pop("TE_CONTROL_SECRET", None)
            authenticated = True
        else:
            authenticated = control_signed()
        if a.mode == "target":
            return run_target(a, watch_parent=a._child)
        if a.use_vram:  # fail before starting anything
            from bench.vram import require

            require(a.gpu_id)
        if a.protocol == "rdma":  # fail before starting anything
            close_unused(make_transports(a))
        if a.local:
            with LocalTarget(a) as target:
                res = run_initiator(a, target.name or target.endpoint, target)
        elif registry_of(a) and "://" not in a.segment_id:
            res = run_initiator(a, a.segment_id, None)  # a name the registry knows
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
    print_summary(a, out)
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
