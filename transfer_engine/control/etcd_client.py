"""etcd's v3 JSON gateway over HTTP, for one member or a cluster.

A cluster address lists its members (``etcd://10.0.0.1:2379,10.0.0.2:2379/prefix``).
Requests go to the member that answered last; one that is down (refused, silent past
half the caller's timeout, or answering that it has no leader) is left for the next, so
losing a minority of members costs a caller one slow request, not an error. Connections
are kept alive between requests, a few per member, because a fleet's keep-alives are
many small requests.

Every request here may be sent twice (a member that timed out may still have applied
it), so callers send only requests that are safe to repeat: puts of the same value,
lease grants (a spare lease runs out by itself), keep-alives, revokes that treat
"not found" as done.
"""

from __future__ import annotations

import base64
import http.client
import json
import socket
import threading
import time
from typing import Any

from transfer_engine.errors import ConnectError, ProtocolError, TransferTimeout

__all__ = ["ETCD_SCHEME", "EtcdClient", "Endpoint", "b64", "etcd_request", "key_prefix",
           "parse_etcd_address", "unb64"]

ETCD_SCHEME = "etcd://"
Endpoint = tuple[str, int]
_MAX_RESPONSE = 64 << 20
_IDLE_PER_MEMBER = 4  # kept-alive connections per member
# error texts of a member that cannot serve now while others may (etcdserver's words)
_UNAVAILABLE = ("no leader", "timed out", "leader changed", "server stopped",
                "not capable", "too many requests", "unhealthy")


def b64(data: bytes | str) -> str:
    """Keys and values as the JSON gateway takes them (a ``str`` as UTF-8)."""
    return base64.b64encode(data.encode() if isinstance(data, str) else data).decode("ascii")


def unb64(text: Any) -> bytes:
    """Keys and values as the JSON gateway gives them (missing: empty)."""
    return base64.b64decode(text) if isinstance(text, str) else b""


def key_prefix(path: str) -> str:
    """The key prefix an address's path names (``/te`` when it names none)."""
    return path.rstrip("/") or "/te"


def parse_etcd_address(address: str) -> tuple[list[Endpoint], str]:
    """``etcd://host:port[,host:port...][/prefix]`` (or ``http://``) -> the members and
    the path. IPv6 hosts go in brackets (``[::1]:2379``); the port defaults to 2379."""
    for scheme in (ETCD_SCHEME, "http://"):
        if address.startswith(scheme):
            rest = address[len(scheme):]
            break
    else:
        raise ValueError(f"etcd address must be etcd://host:port[,host:port...][/prefix],"
                         f" got {address!r}")
    hosts, slash, path = rest.partition("/")
    endpoints: list[Endpoint] = []
    for item in hosts.split(","):
        host, port = _host_port(item.strip(), address)
        if (host, port) not in endpoints:
            endpoints.append((host, port))
    return endpoints, slash + path


def _host_port(item: str, address: str) -> Endpoint:
    if item.startswith("["):
        host, bracket, tail = item[1:].partition("]")
        port_text = tail[1:] if tail.startswith(":") else ""
        if not bracket or (tail and not tail.startswith(":")):
            host = ""
    else:
        host, _, port_text = item.partition(":")
    try:
        port = int(port_text) if port_text else 2379
    except ValueError:
        port = 0
    if not host or not 0 < port < 65536:
        raise ValueError(f"bad etcd member {item!r} in {address!r}")
    return host, port


def _error_text(reply: Any) -> str:
    if isinstance(reply, dict):
        return str(reply.get("error") or reply.get("message") or reply)
    return str(reply)


class _Unavailable(ConnectError):
    """This member cannot serve now; another may."""


class EtcdClient:
    """Requests to whichever member of an etcd cluster serves.

    :param endpoints: the members, ``(host, port)``, in the order to try first.
    :param timeout: seconds for a request when the caller gives none.
    """

    def __init__(self, endpoints: list[Endpoint], timeout: float = 5.0) -> None:
        if not endpoints:
            raise ValueError("an etcd client needs at least one member")
        self.endpoints = list(endpoints)
        self.timeout = timeout
        self._lock = threading.Lock()
        self._first = 0  # the member that answered last
        self._idle: dict[Endpoint, list[http.client.HTTPConnection]] = {}
        self._closed = False
        self.answered: dict[Endpoint, float] = {}  # member -> when it last answered

    @property
    def current(self) -> Endpoint:
        """The member the next request goes to first."""
        with self._lock:
            return self.endpoints[self._first]

    def demote(self, endpoint: Endpoint) -> None:
        """``endpoint`` failed someone: later requests start at the member after it."""
        with self._lock:
            if self.endpoints[self._first] == endpoint:
                self._first = (self._first + 1) % len(self.endpoints)
            idle = self._idle.pop(endpoint, [])
        for conn in idle:
            conn.close()

    def call(self, path: str, body: dict[str, Any], timeout: float | None, op: str
             ) -> dict[str, Any]:
        """POSTs ``body`` to ``path`` on the first member that serves; returns its reply.

        The whole call takes at most ``timeout`` (the client's own when None); with
        several members, one that is silent gets half of it before the next is tried.
        Raises ``ConnectError`` (no member served), ``TransferTimeout`` (out of time)
        and ``ProtocolError`` (etcd refused the request itself)."""
        budget = timeout or self.timeout
        deadline = time.monotonic() + budget
        with self._lock:
            order = self.endpoints[self._first:] + self.endpoints[:self._first]
        failures: list[str] = []
        last: Exception | None = None
        for i, endpoint in enumerate(order):
            left = deadline - time.monotonic()
            if left <= 0:
                break
            share = left if i == len(order) - 1 else max(min(left, budget / 2), 0.05)
            try:
                reply = self._request(endpoint, path, body, share, op)
            except (ConnectError, TransferTimeout) as exc:
                failures.append(f"{endpoint[0]}:{endpoint[1]}: {exc}")
                last = exc
                self.demote(endpoint)
                continue
            return reply
        if len(order) == 1 and last is not None:
            raise last
        if isinstance(last, TransferTimeout) and len(failures) < len(order):
            raise TransferTimeout(f"etcd {path}: no member answered in {budget}s "
                                  f"({'; '.join(failures)})", peer="etcd", op=op)
        raise ConnectError(f"no etcd member served {path}: {'; '.join(failures)}",
                           peer="etcd", op=op) from last

    def _request(self, endpoint: Endpoint, path: str, body: dict[str, Any],
                 timeout: float, op: str) -> dict[str, Any]:
        payload = json.dumps(body)
        for attempt in range(2):
            conn, reused = self._connection(endpoint, timeout)
            try:
                conn.request("POST", path, payload, {"Content-Type": "application/json"})
                resp = conn.getresponse()
                data = resp.read(_MAX_RESPONSE)
            except TimeoutError as exc:
                conn.close()
                raise TransferTimeout(f"etcd {path} took over {timeout:.3g}s at "
                                      f"{endpoint[0]}:{endpoint[1]}", peer="etcd",
                                      op=op) from exc
            except (OSError, http.client.HTTPException) as exc:
                conn.close()
                if reused and attempt == 0:
                    continue  # the member closed an idle connection: once more, fresh
                if isinstance(exc, OSError):
                    raise ConnectError(f"etcd at {endpoint[0]}:{endpoint[1]}: {exc}",
                                       peer="etcd", op=op) from exc
                raise _Unavailable(f"etcd at {endpoint[0]}:{endpoint[1]}: {exc!r}",
                                   peer="etcd", op=op) from exc
            self._release(endpoint, conn, resp)
            reply = self._decode(endpoint, path, resp.status, data, op)
            self.answered[endpoint] = time.monotonic()
            return reply
        raise AssertionError("unreachable")

    @staticmethod
    def _decode(endpoint: Endpoint, path: str, status: int, data: bytes, op: str
                ) -> dict[str, Any]:
        try:
            reply = json.loads(data)
        except ValueError as exc:
            raise ProtocolError(f"etcd {path} answered {status} with no JSON: "
                                f"{data[:200]!r}", peer="etcd", op=op) from exc
        if status == 200 and isinstance(reply, dict) and "error" not in reply:
            return reply
        text = _error_text(reply)
        if status in (502, 503, 504) or any(word in text for word in _UNAVAILABLE):
            raise _Unavailable(f"etcd member {endpoint[0]}:{endpoint[1]} cannot serve "
                               f"{path}: {text[:200]}", peer="etcd", op=op)
        raise ProtocolError(f"etcd {path} answered {status}: {text[:300]}", peer="etcd",
                            op=op)

    def _connection(self, endpoint: Endpoint, timeout: float
                    ) -> tuple[http.client.HTTPConnection, bool]:
        with self._lock:
            if self._closed:
                raise ConnectError("etcd client is closed", peer="etcd")
            idle = self._idle.get(endpoint)
            conn = idle.pop() if idle else None
        if conn is None:
            return http.client.HTTPConnection(endpoint[0], endpoint[1],
                                              timeout=timeout), False
        conn.timeout = timeout
        if conn.sock is not None:
            conn.sock.settimeout(timeout)
        return conn, True

    def _release(self, endpoint: Endpoint, conn: http.client.HTTPConnection,
                 resp: http.client.HTTPResponse) -> None:
        if resp.will_close or conn.sock is None:
            conn.close()
            return
        with self._lock:
            idle = self._idle.setdefault(endpoint, [])
            if self._closed or len(idle) >= _IDLE_PER_MEMBER:
                conn.close()
            else:
                idle.append(conn)

    def open_stream(self, path: str, body: dict[str, Any], timeout: float | None = None
                    ) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse,
                               Endpoint]:
        """Opens a long-lived response (a watch) on the first member that serves; the
        caller reads it line by line and closes the connection."""
        budget = timeout or self.timeout
        with self._lock:
            order = self.endpoints[self._first:] + self.endpoints[:self._first]
        failures: list[str] = []
        for endpoint in order:
            conn = http.client.HTTPConnection(endpoint[0], endpoint[1], timeout=budget)
            try:
                conn.request("POST", path, json.dumps(body),
                             {"Content-Type": "application/json"})
                resp = conn.getresponse()
                if resp.status != 200:
                    raise ProtocolError(f"answered {resp.status}", peer="etcd")
            except (OSError, http.client.HTTPException, ProtocolError) as exc:
                conn.close()
                failures.append(f"{endpoint[0]}:{endpoint[1]}: {exc}")
                self.demote(endpoint)
                continue
            if conn.sock is not None:
                conn.sock.settimeout(None)  # events come when they come
            return conn, resp, endpoint
        raise ConnectError(f"no etcd member opened {path}: {'; '.join(failures)}",
                           peer="etcd", op="watch")

    def revoke(self, lease: int, timeout: float | None, op: str) -> None:
        """Revokes ``lease``; one that etcd no longer knows (it ran out, or a repeat
        of this request landed) is gone already, which is what was asked."""
        try:
            self.call("/v3/lease/revoke", {"ID": str(lease)}, timeout, op)
        except ProtocolError as exc:
            if "not found" not in str(exc):
                raise

    def serves(self, endpoint: Endpoint, timeout: float) -> bool:
        """Whether ``endpoint`` answers a read that needs its cluster's quorum."""
        try:
            self._request(endpoint, "/v3/kv/range", {"key": "AA==", "count_only": True},
                          timeout, "probe")
        except (ConnectError, TransferTimeout, ProtocolError):
            self.demote(endpoint)
            return False
        return True

    def release(self) -> None:
        """Closes the kept-alive connections; a later request opens a new one."""
        with self._lock:
            idle = [c for conns in self._idle.values() for c in conns]
            self._idle.clear()
        for conn in idle:
            conn.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
        self.release()


def etcd_request(host: str, port: int, path: str, body: dict[str, Any], timeout: float,
                 op: str) -> dict[str, Any]:
    """One POST of ``body`` to one member's gateway (``/v3/kv/range``, ...); returns the
    decoded reply. Raises ``ConnectError`` (unreachable), ``TransferTimeout`` and
    ``ProtocolError`` (an error reply, or one that is not JSON)."""
    client = EtcdClient([(host, port)], timeout)
    try:
        return client.call(path, body, timeout, op)
    finally:
        client.close()


def shut(conn: http.client.HTTPConnection | None) -> None:
    """Wakes a thread blocked reading ``conn`` (its stream ends at once)."""
    if conn is not None and conn.sock is not None:
        try:
            conn.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
