"""transfer_engine_bench's transports: the engine's transports for ``--protocol`` and the
tuning flags, and the CPU time of the process without the emulated NICs' threads."""

from __future__ import annotations

import argparse
from typing import Any

from bench.engine_bench_options import UsageError
from bench.stats import cpu_seconds

__all__ = ["make_transports", "emulated_nics", "host_cpu", "close_unused"]


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
    if (a.rails is None and a.slice_size is None and a.spread is None
            and not a.auto_discovery):
        return {"tcp": ["tcp"], "shm": ["shm", "tcp"], "auto": None}[a.protocol]
    from transfer_engine.transport.shm import ShmTransport
    from transfer_engine.transport.tcp import TcpTransport
    rails = {} if a.rails is None else {"rails": a.rails}
    sliced = {} if a.slice_size is None else {"slice_size": a.slice_size}
    nics = {"nics": "auto"} if a.auto_discovery else {}
    tcp = TcpTransport(host=a.host, spread=a.spread, **rails, **sliced, **nics)
    if a.protocol == "shm" or a.protocol == "auto":
        return [ShmTransport(**rails, **sliced), tcp]
    return [tcp]


def emulated_nics(transports: list[Any] | None) -> list[Any]:
    return [nic for t in transports or [] if hasattr(t, "emulated_nics")
            for nic in t.emulated_nics()]


def host_cpu(transports: list[Any] | None) -> float:
    """This process's CPU seconds less the emulated NICs' threads (the "hardware")."""
    return cpu_seconds() - float(sum(nic.cpu_seconds() for nic in emulated_nics(transports)))


def close_unused(transports: list[Any] | None) -> None:
    for t in transports or []:
        if not isinstance(t, str):
            t.close()
