"""The connector's settings, its protocol constants, and where its threads run."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

# Protocol versions (kv_transfer_params and the manifest):
#   1: pull over Engine.read; manifest segment "te-vllm/manifest"; lease in params.
#   2: params carry prompt_hash, and decode checks every field (parse_remote_params).
PROTOCOL_VERSION = 2
MANIFEST_SEGMENT = "te-vllm/manifest"
SENT_PREFIX = b"te-vllm/sent:"  # notification: the reader has every byte of a request


def _all_cpus() -> set[int]:
    return set(range(os.cpu_count() or 1))


def unpin_current_thread() -> None:
    """Lets the calling thread run on every CPU (the kernel keeps it within the
    process's cpuset)."""
    with contextlib.suppress(AttributeError, OSError):
        os.sched_setaffinity(0, _all_cpus())


@contextlib.contextmanager
def unpinned() -> Iterator[None]:
    """Threads started inside run on every CPU, not on the one core vLLM's CPU worker
    pins its compute thread to. A new thread inherits its creator's CPUs, so without
    this the engine's transfer and control threads would share that core with vLLM's
    busy-polling main loop (and, on one host, with the other engine's): they then
    starve for seconds. The calling thread gets its own CPUs back on exit."""
    try:
        pinned = os.sched_getaffinity(0)
    except (AttributeError, OSError):  # not Linux: nothing is pinned this way
        yield
        return
    if pinned >= _all_cpus():
        yield
        return
    unpin_current_thread()
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            os.sched_setaffinity(0, pinned)


@dataclass(frozen=True)
class TEConnectorConfig:
    """``kv_connector_extra_config`` of the connector.

    :param host: address the worker's engine listens on and peers reach it by.
    :param port: control port of the worker's engine (0: a free one; with tensor
        parallelism, rank r uses ``port + r`` when ``port`` is set).
    :param transports: transport names, best first (``None``: the engine's default).
    :param lease_s: seconds prefill holds a finished request's blocks for decode.
    :param timeout_s: seconds for handshakes (connect, manifest read).
    :param tcp_serve: where the worker's engine serves peers' tcp requests:
        ``"thread"`` or ``"process"`` (a serving process that keeps moving KV while the
        worker is busy in Python; see docs/data-plane.md). None: ``$TE_TCP_SERVE``, else
        threads.
    """

    host: str = "127.0.0.1"
    port: int = 0
    transports: tuple[str, ...] | None = None
    lease_s: float = 30.0
    timeout_s: float = 10.0
    tcp_serve: str | None = None

    def __post_init__(self) -> None:
        if self.tcp_serve not in (None, "thread", "process"):
            raise ValueError(f"tcp_serve must be 'thread' or 'process', not "
                             f"{self.tcp_serve!r}")
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.lease_s <= 0 or self.timeout_s <= 0:
            raise ValueError("lease_s and timeout_s must be positive")

    @classmethod
    def from_extra_config(cls, extra: dict[str, Any]) -> TEConnectorConfig:
        known = {"host", "port", "transports", "lease_s", "timeout_s", "tcp_serve"}
        unknown = set(extra) - known
        if unknown:
            raise ValueError(f"unknown kv_connector_extra_config keys {sorted(unknown)}; "
                             f"known: {sorted(known)}")
        transports = extra.get("transports")
        if isinstance(transports, str):
            transports = [t.strip() for t in transports.split(",") if t.strip()]
        return cls(host=str(extra.get("host", cls.host)), port=int(extra.get("port", 0)),
                   transports=tuple(transports) if transports else None,
                   lease_s=float(extra.get("lease_s", cls.lease_s)),
                   timeout_s=float(extra.get("timeout_s", cls.timeout_s)),
                   tcp_serve=extra.get("tcp_serve"))

    def engine_transports(self) -> list[Any] | None:
        """The engine's transports: the names given (or the default), with tcp built
        for ``tcp_serve`` when it is set."""
        if self.tcp_serve is None:
            return list(self.transports) if self.transports else None
        from transfer_engine.engine import DEFAULT_TRANSPORTS
        from transfer_engine.transport.tcp import TcpTransport

        env = [t.strip() for t in os.environ.get("TE_TRANSPORTS", "").split(",") if t.strip()]
        names = list(self.transports or env or DEFAULT_TRANSPORTS)
        return [TcpTransport(host=self.host, serve=self.tcp_serve) if n == "tcp" else n
                for n in names]
