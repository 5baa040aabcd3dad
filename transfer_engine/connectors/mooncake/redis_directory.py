"""Mooncake's keys in redis (``redis://[[user]:password@]host[:port][/db]``), over a RESP2
connection written by hand (:class:`RespConnection`)."""

from __future__ import annotations

import os
import socket
import threading
import urllib.parse
from typing import Any

from .directory import HTTP_TIMEOUT, DirectoryError
from .store_directory import StoreDirectory

__all__ = ["RedisError", "RespConnection", "RedisDirectory"]


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


class RedisDirectory(StoreDirectory):
    """Mooncake's keys in redis: ``redis://[[user]:password@]host[:port][/db]``.

    Credentials and database as Mooncake takes them, from ``$MC_REDIS_USERNAME``,
    ``$MC_REDIS_PASSWORD`` and ``$MC_REDIS_DB_INDEX``, or from the URL (which wins).
    The port defaults to redis's 6379 (Mooncake's to its handshake port, 12001).
    """

    mode = "redis"

    def __init__(self, url: str, timeout: float = HTTP_TIMEOUT) -> None:
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
