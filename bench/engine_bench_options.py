"""transfer_engine_bench's command line: Mooncake's flags and ours, the checks of their
combinations, and the constants both sides of a run share."""

from __future__ import annotations

import argparse
import os

from transfer_engine.topology import load_topology_file
from transfer_engine.transport.tcp_congestion import check_congestion

__all__ = ["DEFAULT_BUFFER", "SEGMENT_NAME", "EXIT_USAGE", "WAIT_TIMEOUT",
           "TARGET_START_TIMEOUT", "CPU_SAMPLE_TIMEOUT", "UsageError", "build_parser",
           "check_flags", "registry_of", "target_name"]

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
                   help="P2PHANDSHAKE (the default: the initiator connects to the "
                        "target's endpoint), or a registry both join: "
                        "etcd://host:port[,host:port...][/prefix] or tcp://host:port (the "
                        "embedded ZeroMQ registry); the initiator then finds the target "
                        "by name (--segment_id NAME)")
    p.add_argument("--local_server_name", default=None,
                   help="target: the name it joins the registry under (default "
                        "bench-target-PID)")
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
    p.add_argument("--use_vram", action="store_true",
                   help="register GPU memory (cuda:--gpu_id, through torch) on both sides "
                        "instead of host memory; --baseline then also measures device<->"
                        "pinned host copies")
    p.add_argument("--gpu_id", type=int, default=0, help="the CUDA device of --use_vram")
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
    p.add_argument("--nic_priority_matrix", metavar="PATH", default=None,
                   help="Mooncake's NIC priority matrix (JSON), or our topology file: "
                        "the NICs used and their order per memory location (the same "
                        "as TE_TOPOLOGY_FILE)")
    p.add_argument("--auto_discovery", action="store_true",
                   help="tcp: one rail per NIC pair over the NICs found (sysfs, or the "
                        "--nic_priority_matrix file), striped by measured goodput; rdma "
                        "always uses the NICs found unless --device_name names them")
    p.add_argument("--grace", type=float, default=600.0,
                   help="target: seconds served beyond duration x repeat")
    return p


def registry_of(a: argparse.Namespace) -> str | None:
    """The registry ``--metadata_server`` names (etcd or ours), else None."""
    ms = a.metadata_server or ""
    return ms if ms.startswith(("etcd://", "tcp://")) else None


def target_name(a: argparse.Namespace) -> str:
    return a.local_server_name or f"bench-target-{os.getpid()}"


def check_flags(a: argparse.Namespace) -> None:
    ms = a.metadata_server
    if ms not in (None, "", "P2PHANDSHAKE") and registry_of(a) is None:
        raise UsageError(f"--metadata_server {ms}: not supported; pass P2PHANDSHAKE "
                         "(peer-to-peer handshake), an etcd://host:port or a tcp://host:port "
                         "registry")
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
    if a.nic_priority_matrix is not None:
        try:
            load_topology_file(a.nic_priority_matrix)
        except (OSError, ValueError) as exc:
            raise UsageError(f"--nic_priority_matrix: {exc}") from None
    if a.use_vram and a.emulated:
        raise UsageError("--use_vram with --emulated: the emulated NICs move host memory "
                         "only")
    if a.emulated and a.protocol != "rdma":
        raise UsageError("--emulated is for --protocol rdma")
    if a.protocol == "rdma" and (a.rails is not None or a.slice_size is not None
                                 or a.spread is not None):
        raise UsageError("--rails, --slice_size and --spread are for tcp and shm; rdma "
                         "opens one rail per NIC pair")
