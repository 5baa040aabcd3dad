"""The ``mooncake`` package name over the transfer-engine project (a shim, not Mooncake).

``mooncake.engine`` is :mod:`transfer_engine.connectors.mooncake`; ``mooncake.store``
and ``BufferPool`` come from the project's KV store where it provides them. The shim
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


def __getattr__(name: str) -> Any:
    if name in ("BufferPool", "RegisteredBufferPool"):
        from mooncake import store

        value = getattr(store, name, None)
        if value is not None:
            return value
        raise AttributeError(f"mooncake.{name}: the project's KV store does not provide "
                             "it (yet)")
    raise AttributeError(f"module 'mooncake' has no attribute {name!r}")
