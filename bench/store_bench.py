"""Cluster store throughput and latency, with Redis (and Mooncake Store) in the same run.

    python -m bench.store_bench --value-size 1048576 --batch 16 --json results/store_1m.json

Starts a master and ``--nodes`` storage nodes as separate processes on loopback, and a
client here that puts and gets batches of ``--batch`` values of ``--value-size`` bytes
with the zero-copy calls (``put_from`` / ``get_into`` on registered buffers: one master
round trip to place or locate a batch, one engine WRITE/READ per node, one round trip to
commit a put). Then, in the same run, a real Redis or Valkey server from the distribution
(pipelined SET / GET of the same batches; ``apt-get install redis-server`` and
``pip install redis`` when missing), and Mooncake Store when its wheel is installed.
Finally the master's memory per object: RSS growth while ``--rss-objects`` small objects
are stored, scaled to a million.

Mooncake Store runs as :func:`bench_mooncake` says: its master, one client process that
lends the storage segment and a second one that puts and gets over Mooncake's TCP
transport. Ours uses whatever transport its engine picks between processes (on one host,
cross-memory attach; ``--transports tcp`` makes it TCP as well); the JSON's ``transport``
says which.

JSON: ``value_size``, ``batch``, ``transport``, ``put_gbps``, ``get_gbps``,
``get_p50_us``, ``get_p99_us`` (per batch), ``redis_put_gbps``, ``redis_get_gbps``,
``mooncake_put_gbps``, ``mooncake_get_gbps``, ``mooncake_get_p50_us``,
``mooncake_get_p99_us`` (null when absent; ``mooncake_error`` says why when it failed),
``master_rss_mb_per_million_objects``, and the ratios ``{put,get}_vs_{redis,mooncake}``.
Every phase runs ``--duration`` seconds: put throughput is bytes over that time, get
throughput bytes over the summed call times, latencies per batch.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any

import numpy as np

from bench.baselines import Child
from bench.fleet import end_process, free_port
from bench.stats import fill_random, percentile, timed_calls

__all__ = ["main"]


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _sets(args: argparse.Namespace) -> int:
    """Batches of distinct keys the timed loops cycle through (a third of the nodes'
    capacity, 2 to 64)."""
    return max(2, min(64, (args.node_capacity * args.nodes // 3)
                      // (args.value_size * args.batch)))


def bench_store(args: argparse.Namespace, src: np.ndarray, dst: np.ndarray
                ) -> dict[str, Any]:
    from kvstore.client import Client

    port = free_port()
    endpoint = f"tcp://127.0.0.1:{port}"
    out: dict[str, Any] = {}
    size, batch = args.value_size, args.batch
    sets = _sets(args)
    with Child(["-m", "kvstore.master", "--bind", endpoint]) as master:
        master.expect("kvstore-master serving", 30)
        nodes = [Child(["-m", "kvstore.node", "--master", endpoint, "--name", f"bench-n{i}",
                        "--capacity", str(args.node_capacity)]) for i in range(args.nodes)]
        try:
            for node in nodes:
                node.expect("kvstore-node", 60)
            with Client(endpoint, replicas=args.replicas, timeout=30.0) as client:
                client.register_buffer(src)
                client.register_buffer(dst)
                views = [src[i * size:(i + 1) * size] for i in range(batch)]
                outs = [dst[i * size:(i + 1) * size] for i in range(batch)]

                def put(i: int) -> None:
                    s = i % sets
                    client.put_from(range(s * batch, (s + 1) * batch), views)

                def get(i: int) -> None:
                    s = i % sets
                    client.get_into(range(s * batch, (s + 1) * batch), outs)

                for i in range(sets):  # every key stored once before timing
                    put(i)
                get(0)
                if not np.array_equal(dst[:size * batch], src[:size * batch]):
                    raise SystemExit("store bench: a get returned other bytes than put")
                calls, _ = timed_calls(put, args.duration)
                out["put_gbps"] = calls * batch * size / args.duration / 1e9
                calls, lat = timed_calls(get, args.duration)
                out["get_gbps"] = calls * batch * size / sum(lat) / 1e9
                out["get_p50_us"] = percentile(lat, 50) * 1e6
                out["get_p99_us"] = percentile(lat, 99) * 1e6
                get(1)
                if not np.array_equal(dst[:size * batch], src[:size * batch]):
                    raise SystemExit("store bench: a get returned other bytes than put")
                out["transport"] = ",".join(sorted({str(peer.transport) for peer in
                                                    client.engine.peers.values()}))
                client.batch_remove(range(sets * batch))
                out["master_rss_mb_per_million_objects"] = _master_rss(
                    client, master.proc.pid, args.rss_objects)
        finally:
            for node in nodes:
                node.close()
    return out


def _master_rss(client: Any, pid: int, objects: int) -> float:
    """Master RSS growth per million stored objects (64-byte values, batches of 8192)."""
    time.sleep(0.5)
    before = _rss_mb(pid)
    value = os.urandom(64)
    step = 8192
    for start in range(0, objects, step):
        n = min(step, objects - start)
        client.batch_put(np.arange(1 << 40, (1 << 40) + n, dtype=np.uint64) + start,
                         [value] * n)
    after = _rss_mb(pid)
    stored = client.stats()["objects"]
    return (after - before) / max(1, stored) * 1e6


def bench_redis(args: argparse.Namespace, src: np.ndarray) -> dict[str, Any]:
    server = shutil.which("redis-server") or shutil.which("valkey-server")
    try:
        import redis  # type: ignore[import-not-found,unused-ignore]
    except ImportError:
        redis = None
    if server is None or redis is None:
        print("redis baseline skipped: install it with `apt-get install redis-server` and "
              "`pip install redis`")
        return {"redis_put_gbps": None, "redis_get_gbps": None}
    port = free_port()
    proc = subprocess.Popen([server, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no", "--protected-mode", "yes"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        r = redis.Redis(host="127.0.0.1", port=port)
        deadline = time.monotonic() + 10
        while True:
            try:
                r.ping()
                break
            except redis.ConnectionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        size, batch = args.value_size, args.batch
        values = [src[i * size:(i + 1) * size].tobytes() for i in range(batch)]

        def put(i: int) -> None:
            p = r.pipeline(transaction=False)
            for j, v in enumerate(values):
                p.set(f"k{j}", v)
            p.execute()

        def get(i: int) -> None:
            p = r.pipeline(transaction=False)
            for j in range(batch):
                p.get(f"k{j}")
            got = p.execute()
            if i == 0 and got != values:
                raise SystemExit("redis returned other bytes")

        put(0)
        calls, _ = timed_calls(put, args.duration)
        put_gbps = calls * batch * size / args.duration / 1e9
        calls, lat = timed_calls(get, args.duration)
        r.close()
        return {"redis_put_gbps": put_gbps,
                "redis_get_gbps": calls * batch * size / sum(lat) / 1e9}
    finally:
        end_process(proc)


MOONCAKE_FIELDS = ("mooncake_put_gbps", "mooncake_get_gbps", "mooncake_get_p50_us",
                   "mooncake_get_p99_us")


_PROBE = ("import importlib.util\n"
          "spec = importlib.util.find_spec('mooncake.store')\n"
          "print(spec.origin if spec is not None and spec.origin else '')")


def mooncake_master(python: str) -> str | None:
    """Mooncake's ``mooncake_master`` program when ``python`` imports Mooncake's wheel (a
    compiled ``mooncake.store``, not this project's API shim), else None."""
    try:
        probe = subprocess.run([python, "-c", _PROBE], stdin=subprocess.DEVNULL,
                               capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    origin = probe.stdout.strip()
    if probe.returncode != 0 or not origin.endswith(".so"):
        return None
    program = os.path.join(os.path.dirname(origin), "mooncake_master")
    if os.access(program, os.X_OK):
        return program
    return shutil.which("mooncake_master", path=os.path.dirname(python))


def _wait_port(port: int, proc: subprocess.Popen[bytes], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            if proc.poll() is not None:
                raise RuntimeError(f"mooncake_master ended (exit code {proc.returncode})"
                                   ) from None
            if time.monotonic() > deadline:
                raise TimeoutError(f"mooncake_master not listening within {timeout:g}s"
                                   ) from None
            time.sleep(0.05)


def _tail(path: str, n: int = 1500) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()[-n:]
    except OSError:
        return ""


def bench_mooncake(args: argparse.Namespace) -> dict[str, Any]:
    """Mooncake Store over its TCP transport, measured as ours: ``mooncake_master`` (P2P
    handshake, no metadata server or etcd), one client process lending the storage
    segment, and a second client process putting and getting the same batches
    (:mod:`bench.mooncake_store_peer`). Every process ends before this returns."""
    nulls: dict[str, Any] = dict.fromkeys(MOONCAKE_FIELDS)
    python = args.mooncake_python or os.environ.get("MOONCAKE_PYTHON") or sys.executable
    program = mooncake_master(python)
    if program is None:
        print(f"mooncake baseline skipped: {python} does not import Mooncake's wheel; "
              "`pip install mooncake-transfer-engine-non-cuda` (and `apt-get install "
              "libibverbs1`) in a separate environment and name its interpreter with "
              "--mooncake-python (or $MOONCAKE_PYTHON) to measure Mooncake Store")
        return nulls
    size, batch = args.value_size, args.batch
    sets = _sets(args)
    # room for every set twice over: Mooncake evicts from 90 % full
    segment_size = max(64 << 20, -(-2 * sets * batch * size // (1 << 20)) << 20)
    rpc, metrics = free_port(), free_port()
    master_addr = f"127.0.0.1:{rpc}"
    logs = tempfile.mkdtemp(prefix="store-bench-mooncake-")
    master_log = os.path.join(logs, "master.log")
    children: list[Child] = []
    master: subprocess.Popen[bytes] | None = None
    try:
        with open(master_log, "wb") as log:
            master = subprocess.Popen(
                [program, f"--rpc_port={rpc}", "--rpc_address=127.0.0.1",
                 f"--metrics_port={metrics}", "--metrics_host=127.0.0.1",
                 "--enable_metric_reporting=false", "--enable_http_metadata_server=false"],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
        _wait_port(rpc, master, 30)
        with open(os.path.join(logs, "segment.log"), "w") as err:
            children.append(Child(["-m", "bench.mooncake_store_peer", "segment", "--master",
                                   master_addr, "--segment-size", str(segment_size)], err,
                                  python=python))
        children[-1].expect("mooncake-segment ready", 60)
        with open(os.path.join(logs, "client.log"), "w") as err:
            children.append(Child(["-m", "bench.mooncake_store_peer", "client", "--master",
                                   master_addr, "--value-size", str(size), "--batch",
                                   str(batch), "--sets", str(sets), "--duration",
                                   str(args.duration)], err, python=python))
        got = json.loads(children[-1].expect("mooncake-result", 120 + 4 * args.duration))
    except (OSError, RuntimeError, TimeoutError, ValueError) as exc:
        detail = "".join(f"\n--- {name}:\n{_tail(os.path.join(logs, name))}"
                         for name in ("client.log", "segment.log", "master.log")
                         if _tail(os.path.join(logs, name)).strip())
        print(f"mooncake baseline failed: {exc}{detail}")
        return {**nulls, "mooncake_error": str(exc)}
    finally:
        for child in reversed(children):
            child.close(timeout=10)
        if master is not None:
            end_process(master)
        shutil.rmtree(logs, ignore_errors=True)
    return {f"mooncake_{k}": got[k] for k in ("put_gbps", "get_gbps", "get_p50_us",
                                              "get_p99_us")}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="store_bench", description=__doc__.split("\n")[0])
    ap.add_argument("--value-size", type=int, default=1 << 20)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--duration", type=float, default=3.0, help="seconds per phase")
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--node-capacity", type=int, default=512 << 20)
    ap.add_argument("--replicas", type=int, default=1)
    ap.add_argument("--rss-objects", type=int, default=1_000_000)
    ap.add_argument("--skip-redis", action="store_true")
    ap.add_argument("--mooncake-python", default=None,
                    help="interpreter whose environment has Mooncake's wheel (default: "
                         "$MOONCAKE_PYTHON, else this one); it runs Mooncake's processes")
    ap.add_argument("--transports", default=None,
                    help="our engines' transports, best first (sets $TE_TRANSPORTS for the "
                         "client and the nodes), e.g. tcp; default: the engine's own choice")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.transports:
        os.environ["TE_TRANSPORTS"] = args.transports
    src = np.empty(args.value_size * args.batch, dtype=np.uint8)
    fill_random(src, 7)
    dst = np.zeros_like(src)
    dst.fill(1)
    result: dict[str, Any] = {"value_size": args.value_size, "batch": args.batch,
                              "nodes": args.nodes, "replicas": args.replicas,
                              "api": "put_from/get_into"}
    result.update(bench_store(args, src, dst))
    if args.skip_redis:
        result.update({"redis_put_gbps": None, "redis_get_gbps": None})
    else:
        result.update(bench_redis(args, src))
    result.update(bench_mooncake(args))
    for other in ("redis", "mooncake"):
        for op in ("put", "get"):
            base = result.get(f"{other}_{op}_gbps")
            result[f"{op}_vs_{other}"] = (result[f"{op}_gbps"] / base) if base else None
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
