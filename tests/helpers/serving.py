"""Engines served by a serving process, and what tests ask of its process."""

from __future__ import annotations

import os
from collections.abc import Callable

from transfer_engine import Engine
from transfer_engine.transport.tcp import TcpTransport


def target(make_engine: Callable[..., Engine], name: str = "t") -> Engine:
    """An engine whose tcp transport serves from a serving process."""
    return make_engine(name, transports=[TcpTransport(serve="process")])


def serve_pid(engine: Engine) -> int:
    pid = engine.transports["tcp"].info("serve_pid")
    assert isinstance(pid, int)
    return pid


def zombie(pid: int) -> bool:
    """Whether ``pid`` has exited (a zombie not yet reaped, or gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[1].split()[0] == "Z"
    except OSError:
        return True


def fd_target(fd: str) -> str:
    """What this process's descriptor ``fd`` refers to ("" once closed)."""
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return ""
