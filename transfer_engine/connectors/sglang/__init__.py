"""SGLang disaggregation transfer backend on our engine.

Mount it in SGLang (both the prefill and the decode server)::

    pip install transfer-engine          # declares the sglang.srt.plugins entry point
    python -m sglang.launch_server --model-path MODEL --disaggregation-mode prefill \\
        --disaggregation-transfer-backend transfer_engine \\
        --disaggregation-bootstrap-port 8998
    python -m sglang.launch_server --model-path MODEL --disaggregation-mode decode \\
        --disaggregation-transfer-backend transfer_engine

and route requests with SGLang's router as for any other backend (it hands both sides the
prefill's bootstrap host, port and a room). Settings come from the environment
(:class:`~.config.SGLangBackendConfig`): ``TE_SGLANG_HOST`` (the address this rank's
engine listens on; default ``SGLANG_HOST_IP`` or the host's outbound address),
``TE_SGLANG_BOOTSTRAP_HOST``, ``TE_SGLANG_TRANSPORTS``, ``TE_CONTROL_SECRET`` and the
timeouts (SGLang's ``SGLANG_DISAGGREGATION_*`` timeout variables are honoured;
``TE_SGLANG_FENCE_TIMEOUT`` bounds how long a failed room's pages wait for prefill to
say its writes ended before decode cuts it off, :mod:`.fences`).

Classes (SGLang's disaggregation base classes, from ``sglang.srt.disaggregation.base``):

- :class:`TransferEngineKVManager` (``BaseKVManager``): one per scheduler rank,
  :mod:`.manager`;
- :class:`TransferEngineKVSender` / :class:`TransferEngineKVReceiver`
  (``BaseKVSender`` / ``BaseKVReceiver``): one per request, :mod:`.conn`, which also
  describes the protocol;
- :class:`TransferEngineKVBootstrapServer` (``BaseKVBootstrapServer``): :mod:`.bootstrap`;
- the mount itself: :mod:`.plugin`;
- underneath: :mod:`.messages` (wire messages), :mod:`.channel` (side channels),
  :mod:`.rooms` (per-request state, chunk notifications), :mod:`.fences` (no late
  write in pages given back), :mod:`.config`.

Scope: MHA and MLA token-to-KV pools (any pool that hands SGLang page-indexed buffers),
equal tensor-parallel sizes on both sides, no data-parallel attention; state pools
(mamba, SWA, DSA) and host destinations are refused with ``NotSupportedError``.

Importing this package imports nothing from SGLang; the classes import its base module
when first used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from transfer_engine.connectors.sglang.config import SGLangBackendConfig

if TYPE_CHECKING:
    from transfer_engine.connectors.sglang.bootstrap import TransferEngineKVBootstrapServer
    from transfer_engine.connectors.sglang.conn import (
        TransferEngineKVReceiver,
        TransferEngineKVSender,
    )
    from transfer_engine.connectors.sglang.manager import TransferEngineKVManager

__all__ = ["SGLangBackendConfig", "TransferEngineKVManager", "TransferEngineKVSender",
           "TransferEngineKVReceiver", "TransferEngineKVBootstrapServer"]

_LAZY = {"TransferEngineKVManager": "manager", "TransferEngineKVSender": "conn",
         "TransferEngineKVReceiver": "conn", "TransferEngineKVBootstrapServer": "bootstrap"}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
