"""Where a Mooncake segment name points: the :class:`Directory` interface every metadata
mode implements, its ``P2PHANDSHAKE`` form (the name is the address), and what the modes
share: :class:`Location`, :class:`DirectoryError`, the key prefix, ``host:port``
parsing and the TCP probe that tells a live entry from a dead engine's.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["P2PHANDSHAKE", "HTTP_TIMEOUT", "Location", "DirectoryError", "Directory",
           "P2PDirectory", "key_prefix", "split_hostport", "probe", "log"]

log = logging.getLogger("transfer_engine.connectors.mooncake.metadata")
"""The logger of every metadata mode and of the server: one name to tune them by."""

P2PHANDSHAKE = "P2PHANDSHAKE"
HTTP_TIMEOUT = 3.0  # seconds per metadata request (Mooncake: 1.5 s connect, 3 s total)


def key_prefix() -> str:
    """``mooncake/`` plus ``$MC_METADATA_CLUSTER_ID/`` when set, as Mooncake."""
    cluster = os.environ.get("MC_METADATA_CLUSTER_ID", "")
    if cluster and not cluster.endswith("/"):
        cluster += "/"
    return "mooncake/" + cluster


def split_hostport(text: str) -> tuple[str, int]:
    """``"host"``, ``"host:port"``, ``"[v6]:port"`` -> (host, port or 0). Raises
    ``ValueError`` for a port that is not a number in 0..65535."""
    text = text.strip()
    if text.startswith("["):
        host, _, rest = text[1:].partition("]")
        port = int(rest[1:]) if rest.startswith(":") and rest[1:] else 0
    elif text.count(":") == 1:
        host, _, digits = text.partition(":")
        port = int(digits) if digits else 0
    else:
        host, port = text, 0  # a bare host or a bare IPv6 address
    if not 0 <= port <= 65535:
        raise ValueError(f"port {port} out of range")
    return host, port


@dataclass(frozen=True)
class Location:
    """Where a peer's handshake listens."""

    host: str
    port: int

    @property
    def endpoint(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"tcp://{host}:{self.port}"


class DirectoryError(Exception):
    """A name could not be turned into a :class:`Location`; ``code`` is Mooncake's
    (-101 name does not resolve, -200 not in the metadata service, -1 malformed)."""

    def __init__(self, code: int, reason: str) -> None:
        super().__init__(reason)
        self.code = code


class Directory:
    """Maps segment names to locations, and publishes ours. Thread-safe."""

    mode = "p2p"

    def lookup(self, name: str) -> Location:
        raise NotImplementedError

    def publish(self, name: str, location: Location) -> None:
        """Announces ``name``; raises ``DirectoryError`` when it cannot."""

    def publish_buffers(self, name: str, buffers: Sequence[tuple[int, int]]) -> None:
        """Announces the registered ``(address, length)`` regions of ``name``."""

    def withdraw(self, name: str) -> None:
        """Removes what :meth:`publish` announced (best effort, never raises)."""

    def check(self) -> None:
        """Raises ``DirectoryError`` when the service cannot be reached: asked before an
        engine is started for nothing."""

    def close(self) -> None:
        """Releases connections to the service (:meth:`withdraw` does too)."""

    def _stale(self, name: str, location: Location) -> bool:
        """Whether the entry under ``name`` is ours already or names an endpoint nobody
        listens on (a dead engine's, which a restarted one may take over)."""
        try:
            old = self.lookup(name)
        except DirectoryError:
            return False
        if old == location:
            return True
        return probe(old, 0.5) == -102


class P2PDirectory(Directory):
    """``P2PHANDSHAKE``: a name is the peer's ``host:port``."""

    def lookup(self, name: str) -> Location:
        try:
            host, port = split_hostport(name)
        except ValueError as exc:
            raise DirectoryError(-1, f"bad segment name {name!r}: {exc}") from None
        if not host or not port:
            raise DirectoryError(-1, f"segment name {name!r} needs the peer's rpc port "
                                   "(host:port, see get_rpc_port())")
        return Location(host, port)


def probe(location: Location, timeout: float) -> int:
    """0 when something accepts TCP connections at ``location``; -101 when its host does
    not resolve, -102 when the connection is refused or times out."""
    try:
        infos = socket.getaddrinfo(location.host, location.port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return -101
    family, kind, proto, _, addr = infos[0]
    try:
        with socket.socket(family, kind, proto) as sock:
            sock.settimeout(timeout)
            sock.connect(addr)
    except OSError:
        return -102
    return 0

