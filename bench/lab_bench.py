"""TCP rails per NIC between two lab hosts: throughput against the links' limit.

    python -m bench.lab_bench --nics 1,2,4 --rate-mbit 1000 --json results/lab.json

Needs root (it builds a fleet lab, :mod:`transfer_engine.lab`): two hosts with as many
NICs as the largest count asked, each shaped to ``--rate-mbit``. A target engine in
host 1 listens on all its NICs; for each NIC count k, an initiator engine in host 0
opens ``--rails-per-nic`` TCP rails (default 1) per NIC from its first k NICs and
WRITEs 1 MiB x 16 (one 16 MiB transfer of 16 descriptors, ``IN_FLIGHT`` at once) for
``--seconds``, then checks a WRITE and a READ back byte for byte. Rows:
``{nics, gbps, limit_gbps, ratio, rails, rail_gbps, exact}``; ``limit_gbps`` is the
sum of the k NICs' shaped rates (the payload's share of it is about 95%: TCP/IP
headers). With 2 NICs or more a failover phase follows: host 0's eth1 cable is pulled
0.2 s into a 64 MiB WRITE over eth0 and eth1; ``failover`` gives
``{seconds_to_recover, bytes_verified, moved}``: from the pull to the first work moved
to eth0, the bytes then READ back and found exact, and how many works moved. The JSON
is ``{"rows": [...], "failover": {...}}``. ``--nic-rates`` shapes NICs below the rate
their topology claims, so only measured goodput can split the bytes right. Both engines
sign their control messages with a secret made here.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

MiB = 1 << 20
BLOCKS = 16
IN_FLIGHT = 2  # transfers kept in flight


def _engine(name: str, host: str, nics: list[str] | str, rails: int = 1) -> Any:
    from transfer_engine import Engine  # noqa: PLC0415  (children only)
    from transfer_engine.transport.tcp import TcpTransport  # noqa: PLC0415

    return Engine(name, host=host, transports=[TcpTransport(host=host, nics=nics,
                                                             rails=rails)],
                  timeout=10)


def _mib_pairs(local: Any, remote: Any, count: int) -> list[tuple[Any, Any]]:
    """``count`` 1 MiB blocks at the same offsets of ``local`` and ``remote``."""
    from transfer_engine import Descriptor  # noqa: PLC0415  (children only)

    return [(Descriptor(local, i * MiB, MiB), Descriptor(remote, i * MiB, MiB))
            for i in range(count)]


def fail_over(host: str, endpoint: str) -> dict[str, Any]:
    """The initiator of the failover phase: a 64 MiB WRITE over eth0 and eth1 (default
    ``nic_timeout``); prints ``STARTED`` once it is posted, waits for the parent's
    ``pulled <monotonic>`` line (it pulls eth1's cable), and notes when the first work
    moved to eth0. Then a READ back, compared byte for byte."""
    n = 4 * BLOCKS
    with _engine("init-failover", host, ["eth0", "eth1"]) as engine:
        tcp = engine.transports["tcp"]
        data = np.random.default_rng(99).integers(0, 256, n * MiB, np.uint8)
        back = np.zeros_like(data)
        src, dst_local = engine.register(data), engine.register(back)
        peer = engine.connect(endpoint)
        dst = peer.segment("dst")
        engine.write(peer, _mib_pairs(src, dst, BLOCKS)).wait(30)  # warm: slow start
        handle = engine.write(peer, _mib_pairs(src, dst, n))
        print("STARTED", flush=True)
        pulled = float(sys.stdin.readline().split()[1])
        moved = None
        for _ in range(3000):  # bounded: 30 s
            if tcp.failovers:
                moved = time.monotonic()
                break
            if handle.done():
                break
            time.sleep(0.01)
        handle.wait(60)
        engine.read(peer, _mib_pairs(dst_local, dst, n)).wait(60)
        exact = bool(np.array_equal(data, back))
        return {"seconds_to_recover": None if moved is None else moved - pulled,
                "bytes_verified": int(data.nbytes) if exact else 0,
                "moved": tcp.failovers}


def serve(host: str) -> None:
    """The target: prints its endpoint, serves until stdin closes."""
    with _engine("target", host, "auto") as engine:
        engine.register(np.zeros(4 * BLOCKS * MiB, np.uint8), name="dst")
        print(f"ENDPOINT {engine.endpoint}", flush=True)
        sys.stdin.read()


def initiate(host: str, endpoint: str, nics: int, seconds: float, rails: int = 1
             ) -> dict[str, Any]:
    names = [f"eth{j}" for j in range(nics)]
    with _engine(f"init-{nics}", host, names, rails) as engine:
        src_buf = np.random.default_rng(nics).integers(0, 256, BLOCKS * MiB, np.uint8)
        back = np.zeros_like(src_buf)
        src, dst_local = engine.register(src_buf), engine.register(back)
        peer = engine.connect(endpoint)
        dst = peer.segment("dst")
        pairs = _mib_pairs(src, dst, BLOCKS)
        rails = [getattr(r, "nic", None) for r in peer.rails["tcp"]]
        engine.write(peer, pairs).wait(30)  # warm: connections, slow start
        done, t0 = 0, time.monotonic()
        window = [engine.write(peer, pairs) for _ in range(IN_FLIGHT)]
        deadline = t0 + seconds
        for _ in range(100_000):  # bounded: ends by time long before
            window.pop(0).wait(60)
            done += BLOCKS * MiB
            if time.monotonic() >= deadline:
                break
            window.append(engine.write(peer, pairs))
        for h in window:
            h.wait(60)
            done += BLOCKS * MiB
        elapsed = time.monotonic() - t0
        engine.write(peer, pairs).wait(30)
        engine.read(peer, _mib_pairs(dst_local, dst, BLOCKS)).wait(30)
        weights = [round(float(getattr(r, "weight", 0.0)), 3) for r in peer.rails["tcp"]]
        return {"nics": nics, "gbps": done * 8 / elapsed / 1e9, "rails": rails,
                "rail_gbps": weights, "exact": bool(np.array_equal(src_buf, back)),
                "seconds": elapsed}


def run_lab(nic_counts: list[int], rate_mbit: float, seconds: float,
            tag: str = "bench", state_root: Path | None = None, rails_per_nic: int = 1,
            nic_rates_mbit: tuple[float, ...] = (), failover: dict[str, Any] | None = None
            ) -> list[dict[str, Any]]:
    """Builds the lab, runs one initiator per NIC count, removes the lab; the rows.
    With ``failover`` (a dict, filled in) and at least 2 NICs, also the failover
    phase: host 0's eth1 cable is pulled in the middle of a 64 MiB WRITE."""
    from transfer_engine.lab import Lab, LabConfig  # noqa: PLC0415

    env = {**os.environ, "TE_CONTROL_SECRET": secrets.token_hex(24)}
    rows = []
    config = LabConfig(hosts=2, nics=max(nic_counts), rate_mbit=rate_mbit, tag=tag,
                       nic_rates_mbit=nic_rates_mbit)
    with Lab(config, state_root=state_root) as lab:
        h0, h1 = lab.hosts
        target = lab.spawn(h1, [sys.executable, "-m", "bench.lab_bench", "serve",
                                "--host", h1.address], env=env, stdin=subprocess.PIPE,
                           stdout=subprocess.PIPE, text=True)
        assert target.stdout is not None and target.stdin is not None
        line = target.stdout.readline().split()
        if line[:1] != ["ENDPOINT"]:
            raise RuntimeError(f"target did not start: {line}")
        for k in nic_counts:
            init = lab.spawn(h0, [sys.executable, "-m", "bench.lab_bench", "initiate",
                                  "--host", h0.address, "--endpoint", line[1],
                                  "--nics", str(k), "--seconds", str(seconds),
                                  "--rails-per-nic", str(rails_per_nic)],
                             env=env, stdout=subprocess.PIPE, text=True)
            out, _ = init.communicate(timeout=seconds + 120)
            if init.returncode != 0:
                raise RuntimeError(f"initiator with {k} NICs failed ({init.returncode})")
            row = json.loads(out.strip().splitlines()[-1])
            row["limit_gbps"] = sum(lab.rate_of(j) for j in range(k)) / 1000
            row["ratio"] = row["gbps"] / row["limit_gbps"]
            rows.append(row)
        if failover is not None and config.nics >= 2:
            failover.update(_failover_phase(lab, line[1], env))
        target.stdin.close()
        target.wait(20)
    return rows


def _failover_phase(lab: Any, endpoint: str, env: dict[str, str]) -> dict[str, Any]:
    h0 = lab.hosts[0]
    init = lab.spawn(h0, [sys.executable, "-m", "bench.lab_bench", "failover", "--host",
                          h0.address, "--endpoint", endpoint], env=env,
                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert init.stdout is not None and init.stdin is not None
    if init.stdout.readline().strip() != "STARTED":
        raise RuntimeError("the failover initiator did not start its write")
    time.sleep(0.2)  # the write is under way on both NICs
    lab.set_link(0, 1, up=False)
    init.stdin.write(f"pulled {time.monotonic()!r}\n")
    init.stdin.flush()
    out, _ = init.communicate(timeout=120)
    lab.set_link(0, 1, up=True)
    if init.returncode != 0:
        raise RuntimeError(f"the failover initiator failed ({init.returncode})")
    result: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd")
    s = sub.add_parser("serve")
    s.add_argument("--host", required=True)
    i = sub.add_parser("initiate")
    i.add_argument("--host", required=True)
    i.add_argument("--endpoint", required=True)
    i.add_argument("--nics", type=int, required=True)
    i.add_argument("--seconds", type=float, default=3.0)
    i.add_argument("--rails-per-nic", type=int, default=1)
    f = sub.add_parser("failover")
    f.add_argument("--host", required=True)
    f.add_argument("--endpoint", required=True)
    ap.add_argument("--nics", default="1,2,4")
    ap.add_argument("--rate-mbit", type=float, default=1000.0)
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--rails-per-nic", type=int, default=1)
    ap.add_argument("--nic-rates", default="",
                    help="what NIC j is really shaped to, Mbit/s (comma list); the "
                         "topology still says --rate-mbit: a degraded link")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    if args.cmd == "serve":
        serve(args.host)
        return 0
    if args.cmd == "failover":
        print(json.dumps(fail_over(args.host, args.endpoint)), flush=True)
        return 0
    if args.cmd == "initiate":
        print(json.dumps(initiate(args.host, args.endpoint, args.nics, args.seconds,
                                  args.rails_per_nic)), flush=True)
        return 0
    from transfer_engine.lab import lab_skip_reason  # noqa: PLC0415

    reason = lab_skip_reason()
    if reason:
        print(f"lab_bench: {reason}", file=sys.stderr)
        return 2
    counts = [int(x) for x in args.nics.split(",") if x.strip()]
    failover: dict[str, Any] = {}
    rows = run_lab(counts, args.rate_mbit, args.seconds,
                   rails_per_nic=args.rails_per_nic,
                   nic_rates_mbit=tuple(float(x) for x in args.nic_rates.split(",") if x),
                   failover=failover)
    for row in rows:
        print(f"{row['nics']} NICs: {row['gbps']:.3f} Gb/s of {row['limit_gbps']:.3f} "
              f"({row['ratio']:.2f}), exact={row['exact']}, rails {row['rail_gbps']}")
    if failover:
        print(f"failover: eth1 pulled mid-write, work moved after "
              f"{failover['seconds_to_recover']:.3f} s, "
              f"{failover['bytes_verified']} bytes verified")
    text = json.dumps({"rows": rows, "failover": failover or None}, indent=1)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(text)
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
