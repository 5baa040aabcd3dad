"""Mooncake's keys in etcd (``etcd://host:port``, or a bare ``host:port``), spoken over
etcd's v3 JSON gateway."""

from __future__ import annotations

import base64
from typing import Any

from transfer_engine.control.etcd_store import etcd_request
from transfer_engine.errors import ConnectError, TransferEngineError, TransferTimeout

from .directory import HTTP_TIMEOUT, DirectoryError, split_hostport
from .store_directory import StoreDirectory

__all__ = ["EtcdDirectory"]


def _b64(data: bytes | str) -> str:
    return base64.b64encode(data.encode() if isinstance(data, str) else data).decode()


class EtcdDirectory(StoreDirectory):
    """Mooncake's keys in etcd (``etcd://host:port``; several endpoints separated by
    ``,`` or ``;`` as Mooncake takes them, tried in turn), over etcd's v3 JSON gateway.
    Keys carry no lease, as Mooncake's: a crashed engine's entry stays until taken
    over or deleted."""

    mode = "etcd"

    def __init__(self, endpoints: str, timeout: float = HTTP_TIMEOUT) -> None:
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
