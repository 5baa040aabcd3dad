"""Mooncake Store's Python API over this store: code written against
``mooncake.store.MooncakeDistributedStore`` runs on ours by changing its import to
``from kvstore.mooncake_store import MooncakeDistributedStore, ReplicateConfig``.

Same method names, arguments and return conventions: calls return status integers (0 or
a count for success, Mooncake's negative error codes for failure) instead of raising,
``get`` answers ``b""`` for a missing key, ``is_exist`` answers 1 / 0. How ``setup``'s
arguments map:

* ``master_server_addr`` (``host:port`` or ``tcp://host:port``): our master
  (:mod:`kvstore.master`, ``kvstore-master --bind ...``).
* ``global_segment_size`` > 0: this process also lends that much DRAM to the pool, as a
  Mooncake client does (a :class:`~kvstore.node.StorageNode` on the same engine).
* ``local_buffer_size``: the staging memory for ``put``/``get`` of plain bytes.
* ``local_hostname``: the address this process's engine listens on.
* ``metadata_server``, ``protocol``, ``rdma_devices``: accepted and ignored (our master is
  the metadata service; the engine picks shm / RDMA / TCP per peer by itself).

As in Mooncake, ``put`` of a key that is already stored leaves the stored value and
succeeds (keys name immutable KV blocks); ``remove`` then ``put`` replaces one.
``BufferPool`` (:mod:`kvstore.buffer_pool`) leases registered scratch memory for
``get_into`` / ``put_from``, as Mooncake's does.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvstore.buffer_pool import (
    BufferLease,
    BufferLeaseView,
    BufferPool,
    RegisteredBufferLease,
    RegisteredBufferLeaseView,
    RegisteredBufferPool,
)
from kvstore.client import Client
from kvstore.errors import (
    CapacityError,
    InvalidArgumentError,
    MasterUnavailableError,
    ObjectUnavailableError,
    PutError,
)
from kvstore.node import StorageNode
from transfer_engine import Engine
from transfer_engine.errors import TransferEngineError

__all__ = ["MooncakeDistributedStore", "ReplicateConfig", "ErrorCode", "BufferPool",
           "BufferLease", "BufferLeaseView", "RegisteredBufferPool", "RegisteredBufferLease",
           "RegisteredBufferLeaseView"]

log = logging.getLogger(__name__)


class ErrorCode:
    """The Mooncake error codes these calls return (its ``types.h`` values)."""

    OK = 0
    INTERNAL_ERROR = -1
    NO_AVAILABLE_HANDLE = -200  # no space
    INVALID_PARAMS = -600
    OBJECT_NOT_FOUND = -704
    TRANSFER_FAIL = -800
    RPC_FAIL = -900


@dataclass
class ReplicateConfig:
    """Per-put options; ``replica_num`` copies on distinct nodes."""

    replica_num: int = 1
    with_soft_pin: bool = False  # accepted; no pinning here
    # placement groups Mooncake may prefer for the replicas; accepted, while placement
    # here follows the nodes' pods and zones
    group_ids: list[str] | None = None


def _code(exc: BaseException) -> int:
    """One translation of our errors into Mooncake's codes."""
    if isinstance(exc, InvalidArgumentError):
        return ErrorCode.INVALID_PARAMS
    if isinstance(exc, MasterUnavailableError):
        return ErrorCode.RPC_FAIL
    if isinstance(exc, CapacityError):
        return ErrorCode.NO_AVAILABLE_HANDLE
    if isinstance(exc, PutError):
        return (ErrorCode.NO_AVAILABLE_HANDLE if "NO_SPACE" in str(exc)
                else ErrorCode.TRANSFER_FAIL)
    if isinstance(exc, ObjectUnavailableError):
        return ErrorCode.TRANSFER_FAIL
    return ErrorCode.INTERNAL_ERROR


class MooncakeDistributedStore:
    """A store client with Mooncake's method names; see the module docstring."""

    def __init__(self) -> None:
        self._client: Client | None = None
        self._node: StorageNode | None = None
        self._engine: Engine | None = None
        self._buffers: dict[int, Any] = {}
        self._local_buffer_size: int | None = None

    def setup(self, local_hostname: str, metadata_server: str = "",
              global_segment_size: int = 0, local_buffer_size: int = 16 << 20,
              protocol: str = "tcp", rdma_devices: str = "",
              master_server_addr: str = "127.0.0.1:50051") -> int:
        if self._client is not None:
            return ErrorCode.INVALID_PARAMS
        host = local_hostname.rsplit(":", 1)[0] if local_hostname.count(":") == 1 \
            else local_hostname
        master = master_server_addr if "://" in master_server_addr \
            else f"tcp://{master_server_addr}"
        try:
            self._engine = Engine(f"mooncake-{id(self):x}", host=host or "127.0.0.1")
            if global_segment_size > 0:
                self._node = StorageNode(master, global_segment_size, engine=self._engine,
                                         name=self._engine.name)
                if not self._node.wait_registered(10):
                    raise MasterUnavailableError(f"no master at {master}")
            self._client = Client(master, engine=self._engine,
                                  staging_bytes=max(1 << 20, local_buffer_size))
        except (TransferEngineError, ValueError, OSError) as exc:
            log.warning("mooncake store setup failed: %s", exc)
            self.close()
            return _code(exc) if isinstance(exc, TransferEngineError) else \
                ErrorCode.INVALID_PARAMS
        self._local_buffer_size = local_buffer_size
        return ErrorCode.OK

    def _local_buffer_bytes(self) -> int | None:
        """``setup``'s ``local_buffer_size`` (None before setup): the size of a
        :class:`BufferPool`'s local area over this store."""
        return self._local_buffer_size

    def _c(self) -> Client:
        if self._client is None:
            raise InvalidArgumentError("setup() has not succeeded")
        return self._client

    def close(self) -> int:
        for part in (self._client, self._node, self._engine):
            if part is not None:
                part.close()
        self._client = self._node = self._engine = None
        self._buffers.clear()
        self._local_buffer_size = None
        return ErrorCode.OK

    # -- bytes -------------------------------------------------------------------------

    def put(self, key: str, value: bytes, config: ReplicateConfig | None = None) -> int:
        return self.put_batch([key], [value], config)

    def put_batch(self, keys: Sequence[str], values: Sequence[bytes],
                  config: ReplicateConfig | None = None) -> int:
        try:
            self._c().batch_put(list(keys), list(values), if_absent=True,
                                replicas=(config or ReplicateConfig()).replica_num)
        except TransferEngineError as exc:
            return _code(exc)
        return ErrorCode.OK

    def get(self, key: str) -> bytes:
        """The value, or ``b""`` when the key is missing or unreadable."""
        return self.get_batch([key])[0]

    def get_batch(self, keys: Sequence[str]) -> list[bytes]:
        try:
            return [v or b"" for v in self._c().batch_get(list(keys))]
        except TransferEngineError as exc:
            log.info("mooncake get failed: %s", exc)
            return [b""] * len(keys)

    def get_size(self, key: str) -> int:
        value = self.get_batch([key])[0]
        return len(value) if value or self.is_exist(key) == 1 else ErrorCode.OBJECT_NOT_FOUND

    def is_exist(self, key: str) -> int:
        return self.batch_is_exist([key])[0]

    def batch_is_exist(self, keys: Sequence[str]) -> list[int]:
        try:
            return [int(x) for x in self._c().batch_exists(list(keys))]
        except TransferEngineError as exc:
            return [_code(exc)] * len(keys)

    def remove(self, key: str) -> int:
        return self.batch_remove([key])[0]

    def batch_remove(self, keys: Sequence[str]) -> list[int]:
        try:
            found = self._c().batch_remove(list(keys))
        except TransferEngineError as exc:
            return [_code(exc)] * len(keys)
        return [ErrorCode.OK if f else ErrorCode.OBJECT_NOT_FOUND for f in found]

    # -- zero copy ---------------------------------------------------------------------

    def register_buffer(self, buffer_ptr: int, size: int) -> int:
        try:
            self._buffers[buffer_ptr] = self._c().register_buffer((buffer_ptr, size))
        except TransferEngineError as exc:
            return _code(exc)
        return ErrorCode.OK

    @property
    def registered_buffers(self) -> dict[int, Any]:
        """The buffers :meth:`register_buffer` registered and nothing unregistered yet,
        by address (a copy)."""
        return dict(self._buffers)

    def unregister_buffer(self, buffer_ptr: int) -> int:
        seg = self._buffers.pop(buffer_ptr, None)
        if seg is None:
            return ErrorCode.INVALID_PARAMS
        seg.close()
        return ErrorCode.OK

    def put_from(self, key: str, buffer_ptr: int, size: int,
                 config: ReplicateConfig | None = None) -> int:
        return self.batch_put_from([key], [buffer_ptr], [size], config)[0]

    def batch_put_from(self, keys: Sequence[str], buffer_ptrs: Sequence[int],
                       sizes: Sequence[int], config: ReplicateConfig | None = None
                       ) -> list[int]:
        """0 per stored key, a negative code per key that was not."""
        try:
            self._c().put_from_addresses(list(keys), buffer_ptrs, sizes, if_absent=True,
                                         replicas=(config or ReplicateConfig()).replica_num)
        except PutError as exc:
            failed = {k for k in exc.keys if isinstance(k, int)}
            rows = [_key_value(k) for k in keys]
            code = _code(exc)
            return [code if r in failed else ErrorCode.OK for r in rows]
        except TransferEngineError as exc:
            return [_code(exc)] * len(keys)
        return [ErrorCode.OK] * len(keys)

    def get_into(self, key: str, buffer_ptr: int, size: int) -> int:
        return self.batch_get_into([key], [buffer_ptr], [size])[0]

    def batch_get_into(self, keys: Sequence[str], buffer_ptrs: Sequence[int],
                       sizes: Sequence[int]) -> list[int]:
        """Bytes read per key, or a negative code (OBJECT_NOT_FOUND for a miss)."""
        try:
            got = self._c().get_into_addresses(list(keys), buffer_ptrs, sizes)
        except TransferEngineError as exc:
            return [_code(exc)] * len(keys)
        return [ErrorCode.OBJECT_NOT_FOUND if n is None else n for n in got]


def _key_value(key: object) -> int:
    from kvstore.client import key_rows

    row = key_rows([key])[0]
    return int(row[0]) | int(row[1]) << 64
