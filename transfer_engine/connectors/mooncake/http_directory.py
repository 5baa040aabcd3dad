"""The client of a Mooncake HTTP metadata server (``http://host:port/metadata``):
``GET``/``PUT``/``DELETE /metadata?key=K``, signed when a control secret is set."""

from __future__ import annotations

import http.client
import json
import urllib.parse
from collections.abc import Sequence

from transfer_engine.control.auth import Signer

from .directory import HTTP_TIMEOUT, Directory, DirectoryError, Location, key_prefix, log
from .signing import SIGNATURE_HEADER, sign_request

__all__ = ["HttpDirectory"]


class HttpDirectory(Directory):
    """The client of a Mooncake HTTP metadata server (``http://host:port/path``)."""

    mode = "http"

    def __init__(self, url: str, signer: Signer | None = None,
                 timeout: float = HTTP_TIMEOUT) -> None:
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

