"""The connector's settings, its protocol constants, where its threads run, and where
its log lines go."""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from transfer_engine.control.auth import AuthConfig
from transfer_engine.transport.stream.process import serve_mode

# Protocol versions (kv_transfer_params and the manifest):
#   1: pull over Engine.read; manifest segment "te-vllm/manifest"; lease in params.
#   2: params carry prompt_hash, and decode checks every field (parse_remote_params).
#   3: the manifest's layer layouts are transfer_engine.layout.BlockLayout.to_wire().
#   4: params list every prefill rank's endpoint (remote_endpoints); each decode rank
#      loads from the prefill rank of its own number, and the manifest's compat names
#      the rank (tp_rank), so a rank never loads another rank's heads.
#   5: tensor-parallel sizes may differ (decode's a multiple of prefill's): the manifest
#      says which of the model's KV heads a worker holds and where a block's heads lie,
#      and a decode rank reads its heads' slice of a prefill rank's blocks; a prefill
#      rank read by several decode ranks frees its blocks once each has said so.
PROTOCOL_VERSION = 5
MANIFEST_SEGMENT = "te-vllm/manifest"
SENT_PREFIX = b"te-vllm/sent:"  # notification: the reader has every byte of a request
# ... one of several readers (decode ranks reading slices of one prefill rank's blocks)
SENT_OF_PREFIX = b"te-vllm/sent-of:"


def _all_cpus() -> set[int]:
    """The CPUs this server was given: those any thread of any process in its process
    group (the server's job: its API server, engine core and workers) may run on. vLLM
    pins a worker's compute thread, and every thread started after it, to its bind
    list; a ``taskset`` or cpuset around the server bounds all of its processes, and
    the engine's threads keep within it."""
    cpus: set[int] = set()
    with contextlib.suppress(OSError):
        group = os.getpgid(0)
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            with contextlib.suppress(OSError, ValueError, IndexError):
                with open(f"/proc/{entry.name}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()  # state ppid pgrp ...
                if int(fields[2]) != group:
                    continue
                for tid in os.listdir(f"/proc/{entry.name}/task"):
                    with contextlib.suppress(OSError, ValueError):
                        cpus |= os.sched_getaffinity(int(tid))
    return cpus or set(range(os.cpu_count() or 1))


def unpin_current_thread(cpus: set[int] | None = None) -> None:
    """Lets the calling thread run on every CPU the process was given (``cpus``, when
    the caller has already asked)."""
    with contextlib.suppress(AttributeError, OSError):
        os.sched_setaffinity(0, _all_cpus() if cpus is None else cpus)


@contextlib.contextmanager
def unpinned() -> Iterator[None]:
    """Threads started inside run on every CPU the process was given, not on the one
    core vLLM's CPU worker pins its compute thread to. A new thread inherits its
    creator's CPUs, so without this the engine's transfer and control threads would
    share that core with vLLM's busy-polling main loop (and, on one host, with the
    other engine's): they then starve for seconds. The calling thread gets its own
    CPUs back on exit."""
    try:
        pinned = os.sched_getaffinity(0)
    except (AttributeError, OSError):  # not Linux: nothing is pinned this way
        yield
        return
    given = _all_cpus()
    if pinned >= given:
        yield
        return
    unpin_current_thread(given)
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            os.sched_setaffinity(0, pinned)


LOAD_MODES = ("sync", "async")


@dataclass(frozen=True)
class TEConnectorConfig:
    """``kv_connector_extra_config`` of the connector.

    :param host: address the worker's engine listens on and peers reach it by.
    :param port: control port of the worker's engine (0: a free one; with tensor
        parallelism, rank r uses ``port + r`` when ``port`` is set).
    :param transports: transport names, best first (``None``: the engine's default).
    :param lease_s: seconds prefill holds a finished request's blocks for decode.
    :param timeout_s: seconds for handshakes (connect, manifest read).
    :param serve: where the worker's engine serves peers' tcp and shm requests:
        ``"thread"`` or ``"process"`` (a serving process that keeps moving KV while the
        worker is busy in Python; see docs/data-plane.md). None: ``$TE_SERVE``, else
        threads.
    :param store: the cluster store's master, ``tcp://host:port`` (``None``: no store
        mode): prompts' full blocks are put there when a request finishes, and any
        engine that later sees the same prefix loads them.
    :param store_timeout_s: seconds for one store request (a lookup by the scheduler,
        a load's or a save's transfers by the worker).
    :param secret_file: a file holding the control secret of the worker's engine and
        of its store requests (``None``: ``TE_CONTROL_SECRET``/``TE_CONTROL_SECRET_FILE``,
        as every engine and the store's master read it).
    :param load: how decode loads a remote prefill's KV, which is whole by the time
        decode sees the request. ``"sync"`` (default): read before the step's forward,
        so the request computes its next token in the very step that admitted it (the
        step's forward waits for the read: milliseconds). ``"async"``: read beside
        the forward; the request is admitted at the step after the read ends, which
        costs it a step and never delays running streams.
    :param push: prefill pushes a request's KV layer by layer into a room decode
        reserved, where the router asks for it (``push`` in kv_transfer_params); decode
        then copies it into its blocks with no READ (see ``push.py``). False: prefill
        never pushes, decode always reads.
    :param push_mib: decode's staging memory for pushed KV, MiB per worker (0: it
        takes no pushes). Host KV caches only.
    """

    host: str = "127.0.0.1"
    port: int = 0
    transports: tuple[str, ...] | None = None
    lease_s: float = 30.0
    timeout_s: float = 10.0
    serve: str | None = None
    store: str | None = None
    store_timeout_s: float = 5.0
    secret_file: str | None = None
    load: str = "sync"
    push: bool = True
    push_mib: int = 256

    def __post_init__(self) -> None:
        if self.serve is not None:
            serve_mode(self.serve)  # raises ValueError for an unknown mode
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.lease_s <= 0 or self.timeout_s <= 0:
            raise ValueError("lease_s and timeout_s must be positive")
        if not self.store_timeout_s > 0:
            raise ValueError(f"store_timeout_s must be positive, got {self.store_timeout_s}")
        if self.store is not None:
            _check_store_address(self.store)
        if self.load not in LOAD_MODES:
            raise ValueError(f"load must be one of {', '.join(LOAD_MODES)}, got "
                             f"{self.load!r:.40}")
        if not 0 <= self.push_mib <= 1 << 20:
            raise ValueError(f"push_mib must be in [0, {1 << 20}], got {self.push_mib}")
        if self.secret_file is not None and not os.path.isfile(self.secret_file):
            raise ValueError(f"secret_file {self.secret_file!r} is not a readable file")

    def auth(self) -> AuthConfig:
        """The control secret the worker's engine and store requests sign with."""
        if self.secret_file is None:
            return AuthConfig.from_env()
        with open(self.secret_file, "rb") as f:
            return AuthConfig(secret=f.read().strip())

    @classmethod
    def from_extra_config(cls, extra: dict[str, Any]) -> TEConnectorConfig:
        known = {"host", "port", "transports", "lease_s", "timeout_s", "serve", "store",
                 "store_timeout_s", "secret_file", "load", "push", "push_mib"}
        unknown = set(extra) - known
        if unknown:
            raise ValueError(f"unknown kv_connector_extra_config keys {sorted(unknown)}; "
                             f"known: {sorted(known)}")
        transports = extra.get("transports")
        if isinstance(transports, str):
            transports = [t.strip() for t in transports.split(",") if t.strip()]
        for key in ("store", "secret_file"):
            value = extra.get(key)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"{key} must be a non-empty string, got {value!r:.80}")
        return cls(host=str(extra.get("host", cls.host)), port=int(extra.get("port", 0)),
                   transports=tuple(transports) if transports else None,
                   lease_s=float(extra.get("lease_s", cls.lease_s)),
                   timeout_s=float(extra.get("timeout_s", cls.timeout_s)),
                   serve=extra.get("serve"),
                   store=extra.get("store"),
                   store_timeout_s=float(extra.get("store_timeout_s", cls.store_timeout_s)),
                   secret_file=extra.get("secret_file"),
                   load=str(extra.get("load", cls.load)),
                   push=_flag(extra.get("push", cls.push), "push"),
                   push_mib=int(extra.get("push_mib", cls.push_mib)))


def _flag(value: Any, key: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false", "1", "0"):
        return value.lower() in ("true", "1")
    raise ValueError(f"{key} must be true or false, got {value!r:.40}")


def _check_store_address(address: str) -> None:
    """Raises ValueError unless ``address`` is ``tcp://host:port`` (the master's ZeroMQ
    endpoint), saying what is wrong."""
    scheme, sep, rest = address.partition("://")
    if not sep or scheme != "tcp":
        raise ValueError(f"store must be the master's tcp://host:port, got {address!r:.80}")
    host, colon, port = rest.rpartition(":")
    if not colon or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"store {address!r:.80} needs a host and a port in [1, 65535] "
                         "(tcp://host:port)")


def log_with(host: logging.Logger, names: tuple[str, ...] = ("transfer_engine", "kvstore"),
             root: logging.Logger | None = None) -> None:
    """Our loggers write through ``host``'s handlers (vLLM's, in its format), from its
    level, unless the application configured logging itself (a handler of ours or of
    the root logger). vLLM gives only its own logger a handler, so ours reached Python's
    last resort: warnings and up, bare, and no info line (a prompt computed locally
    where a transfer was expected said so nowhere)."""
    root = logging.getLogger() if root is None else root
    if not host.handlers or root.handlers:
        return
    for name in names:
        ours = logging.getLogger(name)
        if ours.handlers:
            continue
        for handler in host.handlers:
            ours.addHandler(handler)
        if ours.level == logging.NOTSET:
            ours.setLevel(host.getEffectiveLevel())
