"""Transports by name, imported only when chosen.

``TE_TRANSPORTS`` (comma-separated) overrides the engine's default choice.
Out-of-tree transports register with :func:`register_transport` or are named as
``"package.module:ClassName"``.
"""

from __future__ import annotations

import importlib
from typing import Any

from transfer_engine.errors import NotSupportedError
from transfer_engine.transport.base import Transport

__all__ = ["register_transport", "load_transport", "available_transports", "Transport"]

_REGISTRY: dict[str, tuple[str, str]] = {}


def register_transport(name: str, module: str, class_name: str) -> None:
    if name in _REGISTRY:
        raise ValueError(f"transport {name!r} is already registered")
    _REGISTRY[name] = (module, class_name)


register_transport("tcp", "transfer_engine.transport.tcp", "TcpTransport")
register_transport("shm", "transfer_engine.transport.shm", "ShmTransport")
register_transport("rdma", "transfer_engine.transport.rdma", "RdmaTransport")


def available_transports() -> list[str]:
    return list(_REGISTRY)


def load_transport(name: str, **kwargs: Any) -> Transport:
    """Imports and builds the transport ``name``; raises ``NotSupportedError`` with the
    reason when its library or device is missing."""
    if ":" in name:
        module, class_name = name.split(":", 1)
    elif name in _REGISTRY:
        module, class_name = _REGISTRY[name]
    else:
        raise NotSupportedError(f"unknown transport {name!r}; known: {sorted(_REGISTRY)}",
                                transport=name)
    try:
        cls = getattr(importlib.import_module(module), class_name)
    except ImportError as exc:
        raise NotSupportedError(f"transport {name!r} cannot be imported: {exc}",
                                transport=name) from exc
    transport: Transport = cls(**kwargs)
    return transport
