"""Mounting the backend in SGLang: ``--disaggregation-transfer-backend transfer_engine``.

SGLang picks a transfer backend by name: the CLI checks the name against a list of
choices, converts it to its ``TransferBackend`` enum and asks ``get_kv_class(backend,
KVClassType.X)`` for the manager, sender, receiver and bootstrap server classes. SGLang
loads *general plugins* (entry points of group ``sglang.srt.plugins``) in every process
before it parses arguments; :func:`register` is ours. It

1. adds ``transfer_engine`` to the CLI choices (SGLang's
   ``add_disagg_transfer_backend_choices``),
2. adds a ``TRANSFER_ENGINE`` member to ``TransferBackend`` in place, so every module
   that already holds the enum sees it and existing members keep their identity,
3. wraps ``get_kv_class`` with an AROUND hook through SGLang's ``HookRegistry`` (which
   also rebinds the copies other modules imported) that answers our classes for our
   member and defers to SGLang for every other backend.

The package declares the entry point (``pyproject.toml``)::

    [project.entry-points."sglang.srt.plugins"]
    transfer_engine = "transfer_engine.connectors.sglang.plugin:register"
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Callable
from types import ModuleType
from typing import Any

__all__ = ["BACKEND_NAME", "register", "mount", "extend_enum", "kv_class"]

BACKEND_NAME = "transfer_engine"
_MOUNTED: set[str] = set()


def register() -> None:
    """Entry point of group ``sglang.srt.plugins`` (runs inside SGLang)."""
    from sglang.srt.arg_groups.choices import add_disagg_transfer_backend_choices
    from sglang.srt.disaggregation import utils
    from sglang.srt.plugins import hook_registry

    mount(utils, hook_registry, add_disagg_transfer_backend_choices)


def mount(utils: ModuleType, hook_registry: ModuleType,
          add_choices: Callable[[list[str]], Any], name: str = BACKEND_NAME) -> Any:
    """Makes ``name`` a transfer backend of the SGLang whose disaggregation ``utils``
    module, ``hook_registry`` module and choice-adding function are given; returns the
    enum member. Idempotent."""
    choices = getattr(add_choices, "__self__", None)
    if not isinstance(choices, list) or name not in choices:
        add_choices([name])
    member = extend_enum(utils.TransferBackend, name.upper(), name)
    target = f"{utils.__name__}.get_kv_class"
    if target not in _MOUNTED:
        hook_registry.HookRegistry.register(target, functools.partial(kv_class, member),
                                            hook_registry.HookType.AROUND)
        _MOUNTED.add(target)
    return member


def extend_enum(cls: type[enum.Enum], name: str, value: Any) -> enum.Enum:
    """Adds member ``name = value`` to the enum ``cls`` in place (or returns the member
    that has ``value``): ``cls(value)``, ``cls[name]``, ``cls.name`` and iteration all
    see it."""
    try:
        return cls(value)
    except ValueError:
        pass
    if name in cls.__members__:
        raise ValueError(f"{cls.__name__}.{name} exists with another value")
    member = object.__new__(cls)
    member._name_ = name
    member._value_ = value
    member.__objclass__ = cls  # type: ignore[attr-defined]
    cls._member_names_.append(name)
    cls._member_map_[name] = member
    cls._value2member_map_[value] = member
    type.__setattr__(cls, name, member)
    return member


def kv_class(member: enum.Enum, original: Callable[..., Any], transfer_backend: Any,
             class_type: Any) -> Any:
    """AROUND hook of ``get_kv_class``: our classes for ``member``, SGLang's otherwise
    (``KVArgs`` is shared by every backend)."""
    kind = getattr(class_type, "value", class_type)
    if transfer_backend is not member or kind == "kvargs":
        return original(transfer_backend, class_type)
    from transfer_engine.connectors.sglang import (
        TransferEngineKVBootstrapServer,
        TransferEngineKVManager,
        TransferEngineKVReceiver,
        TransferEngineKVSender,
    )

    classes = {"manager": TransferEngineKVManager, "sender": TransferEngineKVSender,
               "receiver": TransferEngineKVReceiver,
               "bootstrap_server": TransferEngineKVBootstrapServer}
    if kind not in classes:
        raise ValueError(f"the transfer_engine backend has no {kind!r} class")
    return classes[kind]
