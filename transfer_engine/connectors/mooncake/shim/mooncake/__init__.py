"""The ``mooncake`` package name over the transfer-engine project (a shim, not Mooncake).

``mooncake.engine`` is :mod:`transfer_engine.connectors.mooncake`; ``mooncake.store``,
``mooncake.buffer_pool`` and ``BufferPool`` come from the project's KV store where it
provides them. The shim
refuses to load where a real Mooncake is installed: it never shadows one.
"""

from __future__ import annotations

from typing import Any

from transfer_engine.connectors.mooncake.cli import find_real_mooncake

_real = find_real_mooncake()
if _real is not None:
    raise ImportError(
        f"a real Mooncake is installed ({_real}); the transfer-engine 'mooncake' shim "
        "refuses to shadow it: remove the shim from the path (te-mooncake uninstall) or "
        "uninstall Mooncake")

IS_SHIM = True  # how code (and tests) tell the shim from Mooncake


__all__ = ["BufferPool", "RegisteredBufferPool"]


def __getattr__(name: str) -> Any:
    # lazily: ``import mooncake.engine`` should not load the KV store
    if name in ("BufferPool", "RegisteredBufferPool"):
        try:
            from mooncake import buffer_pool
        except ImportError as exc:
            raise AttributeError(f"mooncake.{name}: {exc}") from None
        value = getattr(buffer_pool, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'mooncake' has no attribute {name!r}")
