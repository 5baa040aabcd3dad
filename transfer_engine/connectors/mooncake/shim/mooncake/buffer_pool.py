"""``mooncake.buffer_pool`` on the project's KV store (``kvstore.buffer_pool``)."""

from mooncake.store import BufferPool

RegisteredBufferPool = BufferPool

__all__ = ["BufferPool", "RegisteredBufferPool"]
