"""Mooncake's ``mooncake.engine.TransferEngine`` on top of :class:`transfer_engine.Engine`.

Code written for Mooncake's Python engine runs on ours unchanged through the
``mooncake`` shim (``te-mooncake run script.py``, see docs/mooncake.md), or by changing
one import::

    from transfer_engine.connectors.mooncake import TransferEngine, TransferOpcode

Method names, arguments, return values and failure values are Mooncake's (the table in
docs/mooncake.md lists them): methods never raise, ``0`` is success, sync transfers fail
with ``-1``, async submissions fail with ``0`` (a batch id is never 0), a probe fails
with ``-101`` (name does not resolve), ``-102`` (refused) or ``-200`` (not in the
metadata service). This is the one place in the project where errors become integers;
each failure's reason is logged at WARNING level.

How Mooncake's ideas map onto ours:

- *Segment name* (``local_hostname``, ``target_hostname``): with ``P2PHANDSHAKE`` it is
  ``host:rpc_port`` (the port our engine chose: :meth:`get_rpc_port`); with an HTTP
  metadata server it is any name, published there with our control endpoint
  (:mod:`.metadata`). Peers are handshaken on first use and cached; an unknown or
  refused peer fails at once (a TCP probe precedes the handshake).
- *Raw peer addresses*: Mooncake names remote memory by the peer's virtual address; we
  name it by (segment, offset). Memory registered here gets a segment named
  ``mc:<hex base address>`` so that a peer maps an address to the segment holding it.
- *Local buffers* that were never registered are registered for one transfer (as
  Mooncake's TCP transport allows).
- *Protocol*: ``"tcp"`` (or ``$MC_FORCE_TCP``) uses TCP only; ``"rdma"`` and Mooncake's
  other fabrics (``efa``, ``cxi``, ...) use RDMA where a device exists and fall back to
  TCP with one warning where none does, as Mooncake; ``"shm"`` same-host shared memory
  then TCP; ``""``/``"auto"`` our default choice.
- *Timeouts*: ``$MC_TRANSFER_TIMEOUT`` (seconds, at least 5, default 30) plus one second
  per GB bounds each transfer, as Mooncake.
- *Notifications*: ``TransferNotify(name, msg)`` comes out of the peer's
  ``get_notifies()`` once every byte has landed (on every transport, TCP included).

Where the API lives: :mod:`.engine_base` (state, peers), :mod:`.memory`,
:mod:`.transfers`; :mod:`.codes`, :mod:`.api_types` and :mod:`.address_map` hold what
they share. This module starts and closes the engine.
"""

from __future__ import annotations

import json
import os
import socket
import uuid
import warnings

from transfer_engine.control.auth import AuthConfig
from transfer_engine.engine import Engine
from transfer_engine.errors import TransferEngineError
from transfer_engine.handle import TransferState as TransferState

from .address_map import AddressMap
from .api_types import Read, TransferNotify, TransferOpcode, Write
from .codes import (
    ERR_ADDRESS_NOT_REGISTERED,
    ERR_ADDRESS_OVERLAPPED,
    ERR_DNS,
    ERR_INVALID_ARGUMENT,
    ERR_METADATA,
    ERR_SOCKET,
    Failed,
    log,
)
from .codes import STATUS_COMPLETED as STATUS_COMPLETED
from .codes import STATUS_FAILED as STATUS_FAILED
from .codes import STATUS_PENDING as STATUS_PENDING
from .codes import STATUS_TIMEOUT as STATUS_TIMEOUT
from .memory import MemoryAPI
from .metadata import (
    P2PHANDSHAKE,
    Directory,
    DirectoryError,
    Location,
    open_directory,
    split_hostport,
)
from .transfers import TransferAPI

__all__ = ["TransferEngine", "TransferOpcode", "TransferNotify", "Read", "Write",
           "ERR_INVALID_ARGUMENT", "ERR_ADDRESS_NOT_REGISTERED", "ERR_ADDRESS_OVERLAPPED",
           "ERR_DNS", "ERR_SOCKET", "ERR_METADATA", "SUPPORT_CUDA"]


SUPPORT_CUDA = False  # the *_on_cuda calls are absent, as in Mooncake's non-CUDA build

_FABRICS = ("rdma", "efa", "cxi", "ub", "ubshmem", "barex", "ascend")


def _transports(protocol: str) -> tuple[str, ...] | None:
    """Our transports for a Mooncake protocol name."""
    if os.environ.get("MC_FORCE_TCP"):
        return ("tcp",)
    key = protocol.strip().lower()
    if key == "tcp":
        return ("tcp",)
    if key in _FABRICS:
        return ("rdma", "tcp")
    if key == "shm":
        return ("shm", "tcp")
    if key not in ("", "auto"):
        log.warning("initialize: protocol %r is not available here; choosing among "
                    "shm, rdma and tcp as for \"auto\"", protocol)
    return None


def _timeout() -> float:
    """``$MC_TRANSFER_TIMEOUT`` as Mooncake reads it: whole seconds, at least 5."""
    try:
        return float(max(5, int(os.environ.get("MC_TRANSFER_TIMEOUT", "30"))))
    except ValueError:
        return 30.0


class TransferEngine(MemoryAPI, TransferAPI):
    """Mooncake's ``mooncake.engine.TransferEngine`` API over our :class:`Engine`.

    Construct, then :meth:`initialize`; calls before that fail with their failure value.
    :meth:`close` (or a ``with`` block) releases the engine and withdraws its name from
    the metadata server; Mooncake code never closes, so garbage collection does it too.
    """

    # --- initialisation ---------------------------------------------------------------

    def initialize(self, local_hostname: str, metadata_server: str, protocol: str,
                   device_name: str) -> int:
        """Starts the engine. ``metadata_server``: ``"P2PHANDSHAKE"``, an
        ``http://host:port/metadata`` URL, ``etcd://host:port`` (or a bare
        ``host:port``, Mooncake's default) or ``redis://host:port``. Returns 0, or -1
        with the reason logged (at once for a metadata service nobody serves)."""
        scheme, sep, rest = metadata_server.partition("://")
        if sep:
            return self.initialize_ext(local_hostname, rest, protocol, device_name, scheme)
        if metadata_server == P2PHANDSHAKE:
            return self.initialize_ext(local_hostname, metadata_server, protocol,
                                       device_name, "")
        return self.initialize_ext(local_hostname, metadata_server, protocol, device_name,
                                   "etcd")

    def initialize_ext(self, local_hostname: str, metadata_server: str, protocol: str,
                       device_name: str, metadata_type: str) -> int:
        """:meth:`initialize` with the metadata type apart (``"http"``, ``"etcd"``,
        ``"redis"``; ``"p2p"`` or a ``"P2PHANDSHAKE"`` server for the handshake)."""
        with self._lock:
            if self._engine is not None:
                log.warning("initialize: already initialised")
                return -1
            if protocol.strip().lower() == "xgmi":
                log.warning("initialize: protocol 'xgmi' is not exposed in the Python API")
                return -1
            if metadata_server == P2PHANDSHAKE or metadata_type.lower() == "p2p":
                conn = P2PHANDSHAKE
            elif "://" in metadata_server:
                conn = metadata_server
            else:
                conn = f"{metadata_type or 'etcd'}://{metadata_server}"
            try:
                return self._start(local_hostname, conn, protocol)
            except Failed as exc:
                log.warning("initialize: %s", exc)
                return -1

    def _start(self, local_hostname: str, conn: str, protocol: str) -> int:
        auth = AuthConfig.from_env()
        try:
            directory = open_directory(conn, auth.signer())
        except ValueError as exc:
            raise Failed(-1, str(exc)) from None
        try:
            return self._start_with(directory, local_hostname, protocol, auth)
        except Failed:
            directory.close()
            raise

    def _start_with(self, directory: Directory, local_hostname: str, protocol: str,
                    auth: AuthConfig) -> int:
        try:
            host, port = split_hostport(local_hostname)
        except ValueError as exc:
            raise Failed(-1, f"bad local_hostname {local_hostname!r}: {exc}") from None
        bind = os.environ.get("MC_TCP_BIND_ADDRESS") or host or "127.0.0.1"
        try:
            bind = str(socket.getaddrinfo(bind, None)[0][4][0])
        except (OSError, UnicodeError):
            if directory.mode == "p2p":
                raise Failed(-1, f"cannot resolve {bind!r}") from None
            bind = "127.0.0.1"  # a plain name in a metadata service: serve loopback
        try:
            directory.check()  # before starting an engine (and its serving processes)
        except DirectoryError as exc:
            raise Failed(-1, str(exc)) from None
        transports = _transports(protocol)
        self._timeout = _timeout()
        engine_name = f"mooncake-{host or bind}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        try:
            # the port is ours to choose, as Mooncake's: peers learn it from the name
            # (P2P, via get_rpc_port) or from the metadata server
            # served from a serving process unless TE_SERVE says otherwise: Mooncake's
            # engine moves bytes on threads of its own, never waiting for the caller's
            # Python, and code written for it expects as much
            engine = Engine(engine_name, host=bind, port=0, transports=transports,
                            timeout=min(self._timeout, 10.0), auth=auth,
                            serve=os.environ.get("TE_SERVE") or "process")
        except (ValueError, TransferEngineError, OSError) as exc:
            raise Failed(-1, str(exc)) from None
        if transports is not None and "rdma" in transports and "rdma" not in \
                engine.metadata()["transports"]:
            log.warning("initialize: no RDMA device here; protocol %r runs over TCP",
                        protocol)
        port = int(engine.endpoint.rsplit(":", 1)[1])
        wrapped = f"[{bind}]" if ":" in bind else bind
        name = f"{wrapped}:{port}" if directory.mode == "p2p" else local_hostname
        try:
            directory.publish(name, Location(bind, port))
        except DirectoryError as exc:
            engine.close()
            raise Failed(-1, str(exc)) from None
        self._engine, self._directory, self._name = engine, directory, name
        return 0

    def get_engine(self) -> Engine | None:
        """The engine underneath (ours, not Mooncake's C++ engine)."""
        return self._engine

    def get_engine_ptr(self) -> int:
        """An opaque non-zero handle of the engine underneath (0 before
        :meth:`initialize`); Mooncake hands out its C++ pointer here."""
        return id(self._engine) if self._engine is not None else 0

    def get_rpc_port(self) -> int:
        """The port our handshake listens on; -1 before :meth:`initialize`."""
        if self._engine is None:
            return -1
        return int(self._engine.endpoint.rsplit(":", 1)[1])

    def get_local_topology(self, device_name: str | None = None) -> str:
        """Mooncake's topology JSON: ``{"cpu:<numa>": [[preferred NICs], [others]]}``."""
        nics: list[str] = []
        engine = self._engine
        if engine is not None:
            nics = [str(n.get("name", n)) if isinstance(n, dict) else str(n)
                    for n in engine.metadata().get("nics", [])]
        if device_name:
            wanted = set(device_name.split(","))
            nics = [n for n in nics if n in wanted]
        return json.dumps({"cpu:0": [nics, []]}, indent="\t")

    # --- closing ----------------------------------------------------------------------

    def close(self) -> None:
        """Closes the engine, frees managed buffers and withdraws our name from the
        metadata server. Idempotent."""
        with self._lock:
            engine, self._engine = self._engine, None
            directory, self._directory = self._directory, None
            batches = list(self._batches.values())
            self._batches.clear()
            self._peers.clear()
            self._maps.clear()
        if directory is not None:
            directory.withdraw(self._name)
        if engine is not None:
            engine.close()  # fails in-flight transfers, then deregisters every segment
        for batch in batches:
            batch.temps = []
        with self._lock:
            self._local.clear()
            self._local_map = AddressMap()
            self._managed.clear()

    def __enter__(self) -> TransferEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        if getattr(self, "_engine", None) is None:
            return
        try:
            warnings.warn("mooncake TransferEngine was not closed", ResourceWarning,
                          stacklevel=2)
            self.close()
        except Exception:
            pass

    def __repr__(self) -> str:
        where = self._name if self._engine is not None else "uninitialised"
        mode = self._directory.mode if self._directory is not None else "-"
        return (f"<mooncake TransferEngine {where} metadata={mode} "
                f"regions={len(self._local)} peers={len(self._peers)} "
                f"batches={len(self._batches)}>")


setattr(TransferEngine, "TransferOpcode", TransferOpcode)  # noqa: B010 (as Mooncake's class)
