"""Mooncake's metadata modes on our control plane, and an HTTP metadata server.

Mooncake engines find each other by *segment name* (``local_hostname`` given to
``initialize``) through a metadata service:

- ``P2PHANDSHAKE``: no service; the name is ``host:rpc_port`` and says where the peer
  listens (:class:`P2PDirectory`).
- ``http://host:port/metadata``: a key-value service; ``GET``/``PUT``/``DELETE
  /metadata?key=K``, 200 on success, 404 for a missing key, 400 for a second ``PUT`` of
  a ``rpc_meta`` key (:class:`HttpDirectory` is the client, :class:`MetadataServer` the
  server, wire-compatible with Mooncake's ``mooncake_http_metadata_server``).
- ``etcd://host:port`` (or a bare ``host:port``, Mooncake's default; several endpoints
  separated by ``,`` or ``;``): the same keys in etcd, through its v3 JSON gateway
  (:class:`EtcdDirectory`).
- ``redis://[[user]:password@]host[:port][/db]``: the same keys in redis, over RESP by
  hand (:class:`RedisDirectory`; credentials also from Mooncake's ``$MC_REDIS_USERNAME``,
  ``$MC_REDIS_PASSWORD``, ``$MC_REDIS_DB_INDEX``).

Keys, as Mooncake writes them (``<prefix>`` is ``mooncake/`` plus
``$MC_METADATA_CLUSTER_ID/`` when set):

- ``<prefix>rpc_meta/<name>`` -> ``{"ip_or_host_name": ..., "rpc_port": ...}``: where the
  engine's handshake listens. Here that is our control endpoint.
- ``<prefix>ram/<name>`` -> ``{"name", "protocol", "buffers": [{"name", "addr",
  "length"}]}``: the registered memory, for people and tools; our peers learn segments
  from the handshake itself.

In etcd and redis the values are byte for byte what Mooncake's plugins write (compact
JSON, keys sorted, a trailing newline: :func:`mooncake_json`), without a lease or TTL,
so Mooncake's engines and ours read each other's entries. Mooncake's plugins overwrite
an ``rpc_meta`` key; here it is created only when absent (etcd: a transaction on the
key's create revision; redis: ``SET NX``) and replaced only when it is stale, as the
HTTP server's first-writer rule has it. Closing deletes our keys while they still hold
what we wrote (etcd: a transaction on the value; redis: a short Lua script).

Authentication: with a control secret (``TE_CONTROL_SECRET``) the server answers only
requests carrying ``X-TE-Signature``: our HMAC frame head (``control/auth.py``) over
``METHOD\\nKEY\\nsha256(body)``, with its timestamp window and replay check. Replies are
not signed: a forged reply can at most point a client to an endpoint, whose handshake
is signed. Without a secret the server serves loopback only (``TE_ALLOW_INSECURE=1`` to
opt out), like every other port of the project.
etcd and redis are the operator's to secure (etcd's TLS and users are not spoken here;
redis's ``AUTH`` is); their entries are not signed, and as with a forged HTTP reply, a
forged entry can only point an engine at an endpoint whose handshake is signed.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import http.client
import http.server
import json
import logging
import os
import signal
import socket
import threading
import urllib.parse
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from transfer_engine.control.auth import OVERHEAD, AuthConfig, Signer, check_exposure
from transfer_engine.control.etcd_store import etcd_request
from transfer_engine.errors import (
    AuthenticationError,
    ConnectError,
    TransferEngineError,
    TransferTimeout,
)

__all__ = ["P2PHANDSHAKE", "Location", "DirectoryError", "Directory", "P2PDirectory",
           "HttpDirectory", "EtcdDirectory", "RedisDirectory", "RespConnection",
           "RedisError", "MetadataServer", "mooncake_json", "open_directory",
           "split_hostport", "main"]

log = logging.getLogger(__name__)

P2PHANDSHAKE = "P2PHANDSHAKE"
SIGNATURE_HEADER = "X-TE-Signature"
_HTTP_TIMEOUT = 3.0  # seconds per metadata request (Mooncake: 1.5 s connect, 3 s total)


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


class HttpDirectory(Directory):
    """The client of a Mooncake HTTP metadata server (``http://host:port/path``)."""

    mode = "http"

    def __init__(self, url: str, signer: Signer | None = None,
                 timeout: float = _HTTP_TIMEOUT) -> None:
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) metadata url: {url!r}")
        self.url = url
        self._scheme = parts.scheme
        self._host = parts.hostname
        self._port = parts.port or (443 if parts.scheme == "https" else 80)
        self._path = parts.path or "/metadata"
        self._signer = signer
        self._timeout = timeout
        self._prefix = key_prefix()

    def _request(self, method: str, key: str, body: bytes = b"") -> tuple[int, bytes]:
        """One request; returns (status, body). Raises ``OSError`` when unreachable."""
        cls = (http.client.HTTPSConnection if self._scheme == "https"
               else http.client.HTTPConnection)
        conn = cls(self._host, self._port, timeout=self._timeout)
        headers = {"Content-Type": "application/json"}
        if self._signer is not None:
            headers[SIGNATURE_HEADER] = sign_request(self._signer, method, key, body)
        try:
            conn.request(method, f"{self._path}?key={urllib.parse.quote(key, safe='')}",
                         body=body if method == "PUT" else None, headers=headers)
            resp = conn.getresponse()
            return resp.status, resp.read(1 << 24)
        finally:
            conn.close()

    def check(self) -> None:
        self.get(f"{self._prefix}rpc_meta/")  # no such key: only reaching it counts

    def get(self, key: str) -> bytes | None:
        """The value of ``key`` or None when absent. Raises ``DirectoryError``."""
        try:
            status, body = self._request("GET", key)
        except OSError as exc:
            raise DirectoryError(-200, f"metadata server {self.url} unreachable: {exc}"
                               ) from None
        if status == 404:
            return None
        if status != 200:
            raise DirectoryError(-200, f"GET {key}: HTTP {status} {body[:200]!r}")
        return body

    def put(self, key: str, value: bytes) -> tuple[int, bytes]:
        try:
            return self._request("PUT", key, value)
        except OSError as exc:
            raise DirectoryError(-200, f"metadata server {self.url} unreachable: {exc}"
                               ) from None

    def delete(self, key: str) -> None:
        try:
            self._request("DELETE", key)
        except OSError as exc:
            log.warning("metadata server %s: DELETE %s: %s", self.url, key, exc)

    def lookup(self, name: str) -> Location:
        raw = self.get(f"{self._prefix}rpc_meta/{name}")
        if raw is None:
            raise DirectoryError(-200, f"{name!r} is not in the metadata server {self.url}")
        try:
            meta = json.loads(raw)
            return Location(str(meta["ip_or_host_name"]), int(meta["rpc_port"]))
        except (ValueError, KeyError, TypeError) as exc:
            raise DirectoryError(-200, f"bad rpc_meta for {name!r}: {exc}") from None

    def publish(self, name: str, location: Location) -> None:
        key = f"{self._prefix}rpc_meta/{name}"
        value = json.dumps({"ip_or_host_name": location.host,
                            "rpc_port": location.port}).encode()
        status, body = self.put(key, value)
        if status == 400 and self._stale(name, location):
            self.delete(key)  # a dead engine's entry: take the name over
            status, body = self.put(key, value)
        if status != 200:
            raise DirectoryError(-1, f"cannot publish {name!r} at {self.url}: HTTP {status} "
                                   f"{body[:200]!r} (the name is taken by a live engine?)")
        self.publish_buffers(name, [])

    def publish_buffers(self, name: str, buffers: Sequence[tuple[int, int]]) -> None:
        desc = {"name": name, "protocol": "transfer_engine",
                "buffers": [{"name": name, "addr": a, "length": n} for a, n in buffers]}
        try:
            status, body = self.put(f"{self._prefix}ram/{name}", json.dumps(desc).encode())
        except DirectoryError as exc:
            log.warning("%s", exc)
            return
        if status != 200:
            log.warning("metadata server %s: PUT ram/%s: HTTP %d", self.url, name, status)

    def withdraw(self, name: str) -> None:
        self.delete(f"{self._prefix}rpc_meta/{name}")
        self.delete(f"{self._prefix}ram/{name}")


def mooncake_json(value: Any) -> bytes:
    """``value`` as Mooncake's etcd and redis plugins write it (jsoncpp's FastWriter:
    compact, keys sorted, a newline at the end), so both engines write the same bytes."""
    return (json.dumps(value, sort_keys=True, separators=(",", ":")) + "\n").encode()


def _rpc_meta(raw: bytes, name: str, where: str) -> Location:
    try:
        meta = json.loads(raw)
        return Location(str(meta["ip_or_host_name"]), int(meta["rpc_port"]))
    except (ValueError, KeyError, TypeError) as exc:
        raise DirectoryError(-200, f"bad rpc_meta for {name!r} in {where}: {exc}") from None


class _StoreDirectory(Directory):
    """Mooncake's keys in a plain key-value store (etcd, redis).

    Mooncake's plugins overwrite ``rpc_meta`` unconditionally; here a name is created
    only when absent, and an existing entry is replaced only when it is stale (see
    :meth:`Directory._stale`), as with the HTTP server: a live engine keeps its name.
    :meth:`withdraw` deletes a key only while it holds what we wrote, so an engine that
    took the name over keeps its entry.
    """

    where = ""

    def __init__(self) -> None:
        self._prefix = key_prefix()
        self._written: dict[str, bytes] = {}  # key -> the value we last wrote there
        self._lock = threading.Lock()
        self._publishing = threading.Lock()  # one publish_buffers at a time

    # the store's primitives; each raises DirectoryError when the store fails

    def get(self, key: str) -> bytes | None:
        raise NotImplementedError

    def create(self, key: str, value: bytes) -> bool:
        """Writes ``value`` unless ``key`` exists; whether it did."""
        raise NotImplementedError

    def put(self, key: str, value: bytes) -> None:
        raise NotImplementedError

    def delete_if(self, key: str, value: bytes) -> None:
        """Deletes ``key`` while it holds ``value``."""
        raise NotImplementedError

    # Directory

    def check(self) -> None:
        self.get(f"{self._prefix}rpc_meta/")  # no such key: only reaching it counts

    def lookup(self, name: str) -> Location:
        raw = self.get(f"{self._prefix}rpc_meta/{name}")
        if raw is None:
            raise DirectoryError(-200, f"{name!r} is not in {self.where}")
        return _rpc_meta(raw, name, self.where)

    def publish(self, name: str, location: Location) -> None:
        key = f"{self._prefix}rpc_meta/{name}"
        value = mooncake_json({"ip_or_host_name": location.host,
                               "rpc_port": location.port})
        try:
            if not self.create(key, value):
                if not self._stale(name, location):
                    raise DirectoryError(-1, f"cannot publish {name!r} in {self.where}: "
                                             "the name is held by a live engine")
                self.put(key, value)  # a dead engine's entry: take the name over
        except DirectoryError as exc:
            raise DirectoryError(-1, str(exc)) from None
        with self._lock:
            self._written[key] = value
        self.publish_buffers(name, [])

    def publish_buffers(self, name: str, buffers: Sequence[tuple[int, int]]) -> None:
        key = f"{self._prefix}ram/{name}"
        value = mooncake_json({
            "name": name, "protocol": "transfer_engine",
            "buffers": [{"name": name, "addr": a, "length": n} for a, n in buffers]})
        with self._publishing:  # what we record is what the store holds last
            try:
                self.put(key, value)
            except DirectoryError as exc:
                log.warning("%s", exc)
                return
            with self._lock:
                self._written[key] = value

    def withdraw(self, name: str) -> None:
        with self._lock:
            written, self._written = self._written, {}
        for key, value in written.items():
            try:
                self.delete_if(key, value)
            except DirectoryError as exc:
                log.warning("%s: cannot remove %s: %s", self.where, key, exc)
        self.close()


def _b64(data: bytes | str) -> str:
    return base64.b64encode(data.encode() if isinstance(data, str) else data).decode()


class EtcdDirectory(_StoreDirectory):
    """Mooncake's keys in etcd (``etcd://host:port``; several endpoints separated by
    ``,`` or ``;`` as Mooncake takes them, tried in turn), over etcd's v3 JSON gateway.
    Keys carry no lease, as Mooncake's: a crashed engine's entry stays until taken
    over or deleted."""

    mode = "etcd"

    def __init__(self, endpoints: str, timeout: float = _HTTP_TIMEOUT) -> None:
        super().__init__()
        text = endpoints[len("etcd://"):] if endpoints.startswith("etcd://") else endpoints
        self.endpoints: list[tuple[str, int]] = []
        for item in text.replace(",", ";").split(";"):
            item = item.strip().rstrip("/")
            if not item:
                continue
            scheme, sep, rest = item.partition("://")
            if sep and scheme != "http":
                raise ValueError(f"etcd endpoint {item!r}: only plain http endpoints are "
                                 "supported (no TLS)")
            host, port = split_hostport(rest if sep else item)
            if not host:
                raise ValueError(f"etcd endpoint {item!r} has no host")
            self.endpoints.append((host, port or 2379))
        if not self.endpoints:
            raise ValueError(f"no etcd endpoint in {endpoints!r}")
        self.where = "etcd at " + ",".join(f"{h}:{p}" for h, p in self.endpoints)
        self._timeout = timeout

    def _call(self, path: str, body: dict[str, Any], op: str) -> dict[str, Any]:
        """The request on the first endpoint that answers (the last one that did is
        tried first)."""
        failures = []
        for host, port in list(self.endpoints):
            try:
                reply = etcd_request(host, port, path, body, self._timeout, op)
            except (ConnectError, TransferTimeout) as exc:
                failures.append(str(exc))
                continue
            except TransferEngineError as exc:
                raise DirectoryError(-200, f"{self.where}: {op}: {exc}") from None
            if (host, port) != self.endpoints[0]:
                with self._lock:
                    self.endpoints.remove((host, port))
                    self.endpoints.insert(0, (host, port))
            return reply
        raise DirectoryError(-200, f"{self.where} unreachable: {'; '.join(failures)}")

    def get(self, key: str) -> bytes | None:
        kvs = self._call("/v3/kv/range", {"key": _b64(key)}, "get").get("kvs") or []
        return base64.b64decode(kvs[0].get("value", "")) if kvs else None

    def create(self, key: str, value: bytes) -> bool:
        reply = self._call("/v3/kv/txn", {
            "compare": [{"key": _b64(key), "target": "CREATE", "result": "EQUAL",
                         "create_revision": "0"}],
            "success": [{"request_put": {"key": _b64(key), "value": _b64(value)}}]},
            "create")
        return bool(reply.get("succeeded"))

    def put(self, key: str, value: bytes) -> None:
        self._call("/v3/kv/put", {"key": _b64(key), "value": _b64(value)}, "put")

    def delete_if(self, key: str, value: bytes) -> None:
        self._call("/v3/kv/txn", {
            "compare": [{"key": _b64(key), "target": "VALUE", "result": "EQUAL",
                         "value": _b64(value)}],
            "success": [{"request_delete_range": {"key": _b64(key)}}]}, "delete")


class RedisError(Exception):
    """An error reply from redis (``-ERR ...``)."""


class RespConnection:
    """One connection to redis speaking RESP2: enough for GET, SET, DEL, EVAL, AUTH and
    SELECT. Not thread-safe (:class:`RedisDirectory` serialises it)."""

    MAX_REPLY = 64 << 20

    def __init__(self, host: str, port: int, timeout: float,
                 connect_timeout: float = 1.5) -> None:
        self._sock = socket.create_connection((host, port), timeout=connect_timeout)
        self._sock.settimeout(timeout)
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._file = self._sock.makefile("rb")

    def command(self, *args: str | bytes | int) -> Any:
        """Sends one command; returns its reply (bytes, int, list, None), raises
        ``RedisError`` for an error reply and ``OSError`` when the connection fails."""
        parts = [a if isinstance(a, bytes) else str(a).encode() for a in args]
        out = [b"*%d\r\n" % len(parts)]
        for part in parts:
            out += [b"$%d\r\n" % len(part), part, b"\r\n"]
        self._sock.sendall(b"".join(out))
        return self._reply()

    def _reply(self) -> Any:
        line = self._file.readline(self.MAX_REPLY)
        if not line.endswith(b"\r\n"):
            raise ConnectionError("redis closed the connection" if not line
                                  else "malformed redis reply")
        kind, rest = line[:1], line[1:-2]
        if kind == b"+":
            return rest
        if kind == b"-":
            raise RedisError(rest.decode(errors="replace"))
        if kind == b":":
            return int(rest)
        if kind == b"$":
            size = int(rest)
            if size < 0:
                return None
            if size > self.MAX_REPLY:
                raise ConnectionError(f"redis reply of {size} bytes is too large")
            data = self._file.read(size + 2)
            if len(data) != size + 2:
                raise ConnectionError("redis closed the connection")
            return data[:-2]
        if kind == b"*":
            count = int(rest)
            return None if count < 0 else [self._reply() for _ in range(count)]
        raise ConnectionError(f"malformed redis reply {line[:40]!r}")

    def close(self) -> None:
        self._file.close()
        self._sock.close()


_DELETE_IF = ("if redis.call('GET', KEYS[1]) == ARGV[1] then "
              "return redis.call('DEL', KEYS[1]) end return 0")


class RedisDirectory(_StoreDirectory):
    """Mooncake's keys in redis: ``redis://[[user]:password@]host[:port][/db]``.

    Credentials and database as Mooncake takes them, from ``$MC_REDIS_USERNAME``,
    ``$MC_REDIS_PASSWORD`` and ``$MC_REDIS_DB_INDEX``, or from the URL (which wins).
    The port defaults to redis's 6379 (Mooncake's to its handshake port, 12001).
    """

    mode = "redis"

    def __init__(self, url: str, timeout: float = _HTTP_TIMEOUT) -> None:
        super().__init__()
        parts = urllib.parse.urlsplit(url if "://" in url else "redis://" + url)
        if parts.scheme != "redis" or not parts.hostname:
            raise ValueError(f"not a redis url: {url!r}")
        self._host, self._port = parts.hostname, parts.port or 6379  # port: ValueError
        self._user = urllib.parse.unquote(parts.username or "") or os.environ.get(
            "MC_REDIS_USERNAME", "")
        self._password = urllib.parse.unquote(parts.password or "") or os.environ.get(
            "MC_REDIS_PASSWORD", "")
        db = parts.path.strip("/") or os.environ.get("MC_REDIS_DB_INDEX", "") or "0"
        if not db.isdigit() or int(db) > 255:
            raise ValueError(f"redis database {db!r} is not a number in 0..255")
        self._db = int(db)
        host = f"[{self._host}]" if ":" in self._host else self._host
        self.where = f"redis at {host}:{self._port}"
        self._timeout = timeout
        self._conn: RespConnection | None = None
        self._io = threading.Lock()  # one command at a time on the connection

    def _connect(self) -> RespConnection:
        try:
            conn = RespConnection(self._host, self._port, self._timeout)
        except OSError as exc:
            raise DirectoryError(-200, f"{self.where} unreachable: {exc}") from None
        try:
            if self._password:
                auth = (self._user, self._password) if self._user else (self._password,)
                conn.command("AUTH", *auth)
            if self._db:
                conn.command("SELECT", self._db)
        except RedisError as exc:
            conn.close()
            raise DirectoryError(-200, f"{self.where}: {exc}") from None
        except OSError as exc:
            conn.close()
            raise DirectoryError(-200, f"{self.where} unreachable: {exc}") from None
        return conn

    def _command(self, verb: str, *args: str | bytes | int) -> Any:
        """One command; a connection the server dropped is opened again once."""
        with self._io:
            for attempt in (0, 1):
                fresh = self._conn is None
                if self._conn is None:
                    self._conn = self._connect()
                try:
                    return self._conn.command(verb, *args)
                except RedisError as exc:
                    hint = (" (give the password as MC_REDIS_PASSWORD or "
                            "redis://:password@host:port)" if "NOAUTH" in str(exc) else "")
                    raise DirectoryError(-200, f"{self.where}: {verb}: {exc}{hint}"
                                         ) from None
                except (OSError, ValueError) as exc:
                    self._conn.close()
                    self._conn = None
                    if fresh or attempt:
                        raise DirectoryError(-200, f"{self.where}: {verb}: {exc}"
                                             ) from None
        raise AssertionError("unreachable")

    def get(self, key: str) -> bytes | None:
        value = self._command("GET", key)
        return value if isinstance(value, bytes) else None

    def create(self, key: str, value: bytes) -> bool:
        return self._command("SET", key, value, "NX") is not None

    def put(self, key: str, value: bytes) -> None:
        self._command("SET", key, value)

    def delete_if(self, key: str, value: bytes) -> None:
        try:
            self._command("EVAL", _DELETE_IF, 1, key, value)
        except DirectoryError:  # scripting disabled: a GET then a DEL
            if self.get(key) == value:
                self._command("DEL", key)

    def close(self) -> None:
        with self._io:
            if self._conn is not None:
                self._conn.close()
                self._conn = None


def open_directory(conn_string: str, signer: Signer | None) -> Directory:
    """The directory for a Mooncake metadata connection string: ``P2PHANDSHAKE``,
    ``http(s)://``, ``etcd://`` (also a bare ``host:port``, as Mooncake) or
    ``redis://``. Raises ``ValueError`` for other schemes and malformed strings. The
    signer authenticates requests to our HTTP server; etcd and redis have their own."""
    if conn_string == P2PHANDSHAKE:
        return P2PDirectory()
    scheme, sep, _ = conn_string.partition("://")
    if not sep:
        scheme = "etcd"  # Mooncake's default for a bare host:port
    if scheme in ("http", "https"):
        return HttpDirectory(conn_string, signer)
    if scheme == "etcd":
        return EtcdDirectory(conn_string)
    if scheme == "redis":
        return RedisDirectory(conn_string)
    raise ValueError(
        f"metadata server {conn_string!r}: {scheme} is not supported; use P2PHANDSHAKE, "
        "http://host:port/metadata (`te-mooncake metadata-server`), etcd://host:port or "
        "redis://host:port")


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


# --- request signing ----------------------------------------------------------------


def _canonical(method: str, key: str, body: bytes) -> bytes:
    return f"{method}\n{key}\n{hashlib.sha256(body).hexdigest()}".encode()


def sign_request(signer: Signer, method: str, key: str, body: bytes) -> str:
    """The ``X-TE-Signature`` value for a request."""
    frame = signer.sign(_canonical(method, key, body))
    return base64.b64encode(frame[:OVERHEAD]).decode()


def verify_request(signer: Signer, header: str | None, method: str, key: str,
                   body: bytes) -> None:
    """Raises ``AuthenticationError`` unless ``header`` signs this request."""
    if not header:
        raise AuthenticationError("request is not signed")
    try:
        head = base64.b64decode(header, validate=True)
    except ValueError:
        raise AuthenticationError("malformed signature") from None
    if len(head) != OVERHEAD:
        raise AuthenticationError("malformed signature")
    signer.verify(head + _canonical(method, key, body))


# --- the server ---------------------------------------------------------------------


class MetadataServer:
    """Mooncake's HTTP metadata protocol, served from a thread.

    :param host: address to serve; ``0.0.0.0``/``""`` without a secret serves loopback
        instead (with a warning), any other non-loopback address needs a secret or the
        insecure opt-in (``ValueError`` otherwise).
    :param port: TCP port; 0 picks a free one (see :attr:`port`).
    :param path: the URL path (Mooncake: ``/metadata``).
    :param auth: the control secret (default ``AuthConfig.from_env()``).
    :param insecure: serve a network address without a secret anyway.
    :param max_keys: keys held at most (``507`` beyond it).
    :param max_value: bytes per value at most (``413`` beyond it).
    :param max_connections: connections served at once (``503`` beyond it).
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 8080, *, path: str = "/metadata",
                 auth: AuthConfig | str | bytes | None = None, insecure: bool | None = None,
                 max_keys: int = 100_000, max_value: int = 4 << 20,
                 max_connections: int = 256) -> None:
        if not isinstance(auth, AuthConfig):
            auth = AuthConfig(secret=auth) if auth is not None else AuthConfig.from_env()
        self._signer = auth.signer()
        if host in ("", "0.0.0.0", "::") and self._signer is None:
            log.warning("metadata server: no control secret, serving 127.0.0.1 instead of "
                        "%r (set TE_CONTROL_SECRET to serve the network)", host or "*")
            host = "127.0.0.1"
        check_exposure(host, self._signer is not None, insecure, what="metadata server")
        self.path = path
        self.max_keys, self.max_value = max_keys, max_value
        self._store: dict[str, bytes] = {}
        self._lock = threading.Lock()
        self._slots = threading.BoundedSemaphore(max_connections)
        handler = _handler_for(self)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        server_cls = type("_Server", (http.server.ThreadingHTTPServer,),
                          {"address_family": family, "daemon_threads": True})
        self._httpd = server_cls((host, port), handler)
        self.host = host
        self.port = int(self._httpd.server_address[1])
        self._thread = threading.Thread(target=self._httpd.serve_forever,
                                        kwargs={"poll_interval": 0.1}, daemon=True,
                                        name=f"te-mc-metadata-{self.port}")
        self._thread.start()
        self._closed = False

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}{self.path}"

    def keys(self) -> list[str]:
        with self._lock:
            return sorted(self._store)

    # one method per verb, called by the handler; each returns (status, body)

    def get(self, key: str) -> tuple[int, bytes]:
        with self._lock:
            value = self._store.get(key)
        return (200, value) if value is not None else (404, b"metadata not found")

    def put(self, key: str, value: bytes) -> tuple[int, bytes]:
        with self._lock:
            if "rpc_meta" in key and key in self._store:
                return 400, b"Duplicate rpc_meta key not allowed"
            if key not in self._store and len(self._store) >= self.max_keys:
                return 507, b"metadata server full"
            self._store[key] = value
        return 200, b"metadata updated"

    def delete(self, key: str) -> tuple[int, bytes]:
        with self._lock:
            if self._store.pop(key, None) is None:
                return 404, b"metadata not found"
        return 200, b"metadata deleted"

    def close(self) -> None:
        """Stops serving and joins the thread. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(5)

    def __enter__(self) -> MetadataServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "CLOSED" if self._closed else "SERVING"
        return f"<MetadataServer {self.url} keys={len(self._store)} {state}>"


def _handler_for(server: MetadataServer) -> type[http.server.BaseHTTPRequestHandler]:
    class Handler(http.server.BaseHTTPRequestHandler):
        timeout = 10  # seconds a connection may stall
        disable_nagle_algorithm = True  # headers and body go out as two writes
        protocol_version = "HTTP/1.1"
        server_version = "te-metadata"

        def _serve(self, method: str) -> None:
            if not server._slots.acquire(blocking=False):
                self._reply(503, b"too many connections")
                return
            try:
                self._dispatch(method)
            finally:
                server._slots.release()

        def _dispatch(self, method: str) -> None:
            url = urllib.parse.urlsplit(self.path)
            if url.path != server.path:
                self._reply(404, b"not found")
                return
            key = urllib.parse.parse_qs(url.query).get("key", [""])[0].strip()
            try:
                length = int(self.headers.get("Content-Length") or 0)
            except ValueError:
                length = -1
            if length < 0 or length > server.max_value:
                self.close_connection = True
                self._reply(413, b"value too large")
                return
            body = self.rfile.read(length) if length else b""
            if not key:
                self._reply(400, b"metadata key is required")
                return
            if server._signer is not None:
                try:
                    verify_request(server._signer, self.headers.get(SIGNATURE_HEADER),
                                   method, key, body)
                except AuthenticationError as exc:
                    log.warning("metadata server: refused %s %s from %s: %s", method, key,
                                self.client_address[0], exc)
                    self._reply(401, b"unauthenticated")
                    return
            if method == "GET":
                status, out = server.get(key)
            elif method == "PUT":
                status, out = server.put(key, body)
            elif method == "DELETE":
                status, out = server.delete(key)
            else:
                status, out = 405, b"Method not allowed"
            self._reply(status, out)

        def _reply(self, status: int, body: bytes) -> None:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:  # noqa: N802 (http.server's names)
            self._serve("GET")

        def do_PUT(self) -> None:  # noqa: N802
            self._serve("PUT")

        def do_DELETE(self) -> None:  # noqa: N802
            self._serve("DELETE")

        def do_POST(self) -> None:  # noqa: N802
            self._serve("POST")

        def log_message(self, format: str, *args: Any) -> None:
            log.debug("metadata server: " + format, *args)

    return Handler


def main(argv: Sequence[str] | None = None) -> int:
    """``te-mooncake metadata-server``: Mooncake's ``mooncake_http_metadata_server``
    flags (``--port``, ``--host``, ``--log-level``); runs until SIGINT/SIGTERM."""
    parser = argparse.ArgumentParser(
        prog="te-mooncake metadata-server",
        description="HTTP metadata server speaking Mooncake's protocol")
    parser.add_argument("--port", type=int, default=8080)
    parser.add_argument("--host", default="0.0.0.0",
                        help="without TE_CONTROL_SECRET a wildcard serves loopback only")
    parser.add_argument("--path", default="/metadata")
    parser.add_argument("--insecure", action="store_true", default=None,
                        help="serve a network address without a control secret")
    parser.add_argument("--log-level", default="INFO",
                        choices=["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"])
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        server = MetadataServer(args.host, args.port, path=args.path, insecure=args.insecure)
    except (ValueError, OSError) as exc:
        print(f"te-mooncake metadata-server: {exc}", flush=True)
        return 1
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    print(f"metadata server at {server.url}", flush=True)
    stop.wait()
    server.close()
    return 0
