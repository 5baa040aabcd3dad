"""Mooncake's keys in etcd (``etcd://host:port``, or a bare ``host:port``), spoken over
etcd's v3 JSON gateway."""

from __future__ import annotations

from typing import Any

from transfer_engine.control.etcd_client import EtcdClient, b64, unb64
from transfer_engine.errors import ConnectError, TransferEngineError, TransferTimeout

from .directory import HTTP_TIMEOUT, DirectoryError, split_hostport
from .store_directory import StoreDirectory

__all__ = ["EtcdDirectory"]


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
        self._client = EtcdClient(self.endpoints, timeout)

    def _call(self, path: str, body: dict[str, Any], op: str) -> dict[str, Any]:
        """The request on the first endpoint that serves (the last one that did is
        tried first; see :class:`~transfer_engine.control.etcd_client.EtcdClient`)."""
        try:
            return self._client.call(path, body, None, op)
        except (ConnectError, TransferTimeout) as exc:
            raise DirectoryError(-200, f"{self.where} unreachable: {exc}") from None
        except TransferEngineError as exc:
            raise DirectoryError(-200, f"{self.where}: {op}: {exc}") from None

    def close(self) -> None:
        self._client.release()  # usable again afterwards, as every directory is

    def get(self, key: str) -> bytes | None:
        kvs = self._call("/v3/kv/range", {"key": b64(key)}, "get").get("kvs") or []
        return unb64(kvs[0].get("value", "")) if kvs else None

    def create(self, key: str, value: bytes) -> bool:
        reply = self._call("/v3/kv/txn", {
            "compare": [{"key": b64(key), "target": "CREATE", "result": "EQUAL",
                         "create_revision": "0"}],
            "success": [{"request_put": {"key": b64(key), "value": b64(value)}}]},
            "create")
        return bool(reply.get("succeeded"))

    def put(self, key: str, value: bytes) -> None:
        self._call("/v3/kv/put", {"key": b64(key), "value": b64(value)}, "put")

    def delete_if(self, key: str, value: bytes) -> None:
        self._call("/v3/kv/txn", {
            "compare": [{"key": b64(key), "target": "VALUE", "result": "EQUAL",
                         "value": b64(value)}],
            "success": [{"request_delete_range": {"key": b64(key)}}]}, "delete")
