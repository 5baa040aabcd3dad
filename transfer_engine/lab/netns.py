"""Thin wrappers over ``ip`` and ``tc``: the only place the lab runs system commands.

Every command has a deadline and its failure raises :class:`LabError` with the command
and what it printed, so a half-built lab says exactly which step failed.
"""

from __future__ import annotations

import functools
import ipaddress
import os
import shutil
import subprocess
from collections.abc import Sequence

from transfer_engine.errors import TransferEngineError

__all__ = ["LabError", "LAB_NETWORK", "check_address", "lab_skip_reason", "run",
           "namespaces", "CMD_TIMEOUT"]

LAB_NETWORK = ipaddress.ip_network("198.18.0.0/15")  # RFC 2544 benchmarking range
CMD_TIMEOUT = 10.0
_CAP_NET_ADMIN = 12
_CAP_SYS_ADMIN = 21  # creating and entering network namespaces


class LabError(TransferEngineError):
    """A lab step failed. What the lab had made before it is removed by its ``close``."""


def check_address(address: str) -> ipaddress.IPv4Address:
    """The lab only ever addresses 198.18.0.0/15; anything else is a bug, refused."""
    addr = ipaddress.ip_address(address)
    if not isinstance(addr, ipaddress.IPv4Address) or addr not in LAB_NETWORK:
        raise LabError(f"{address} is outside the lab network {LAB_NETWORK}")
    return addr


def _caps() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("CapEff:"):
                    return int(line.split()[1], 16)
    except (OSError, ValueError):
        pass
    return 0


@functools.cache
def lab_skip_reason() -> str | None:
    """Why a lab cannot be built here, or None when it can: the tools and capabilities
    are checked, then a throwaway namespace with a shaped veth pair is made and removed
    (a container may grant the capabilities and still refuse namespaces)."""
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"the lab needs iproute2's {tool!r} command, not found on PATH"
    caps = _caps()
    missing = [name for bit, name in ((_CAP_NET_ADMIN, "CAP_NET_ADMIN"),
                                      (_CAP_SYS_ADMIN, "CAP_SYS_ADMIN"))
               if not caps >> bit & 1]
    if missing:
        return (f"the lab needs {' and '.join(missing)} (run as root) to create network "
                "namespaces, veth pairs and qdiscs")
    probe = f"te-probe-{os.getpid()}"
    try:
        run(["ip", "netns", "add", probe])
        run(["ip", "link", "add", "tprobe0", "type", "veth", "peer", "name", "tprobe1"],
            probe)
        run(["tc", "qdisc", "add", "dev", "tprobe0", "root", "tbf", "rate", "1gbit",
             "burst", "128k", "latency", "100ms"], probe)
    except LabError as exc:
        return f"this machine refuses a lab's namespaces, veths or tbf: {exc}"
    finally:
        run(["ip", "netns", "delete", probe], check=False)
    return None


def run(args: Sequence[str], netns: str | None = None, check: bool = True,
        timeout: float = CMD_TIMEOUT) -> str:
    """Runs one ``ip``/``tc`` command (inside ``netns`` if given); returns its stdout."""
    cmd = (["ip", "netns", "exec", netns] if netns else []) + list(args)
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                              env={**os.environ, "LC_ALL": "C"}, check=False)
    except subprocess.TimeoutExpired as exc:
        raise LabError(f"{' '.join(cmd)!r} did not finish in {timeout}s") from exc
    except OSError as exc:
        raise LabError(f"cannot run {' '.join(cmd)!r}: {exc}") from exc
    if check and done.returncode != 0:
        raise LabError(f"{' '.join(cmd)!r} failed ({done.returncode}): "
                       f"{(done.stderr or done.stdout).strip()[:400]}")
    return done.stdout


def namespaces() -> list[str]:
    """Names of the network namespaces that exist now."""
    out = run(["ip", "netns", "list"], check=False)
    return [line.split()[0] for line in out.splitlines() if line.strip()]
