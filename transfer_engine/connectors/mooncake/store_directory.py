"""Mooncake's keys in a plain key-value store (the base of the etcd and redis modes): the
values byte for byte as Mooncake's plugins write them (:func:`mooncake_json`), a name
created only when absent and replaced only when stale, and deleted on withdrawal only
while it holds what we wrote."""

from __future__ import annotations

import json
import threading
from collections.abc import Sequence
from typing import Any

from .directory import Directory, DirectoryError, Location, key_prefix, log

__all__ = ["StoreDirectory", "mooncake_json"]


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


class StoreDirectory(Directory):
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
