"""The import guard of the tests that drive the vLLM connector in this process."""

from __future__ import annotations

import os
from types import ModuleType

import pytest

__all__ = ["vllm_torch"]


def vllm_torch() -> ModuleType:
    """torch, once vllm imports. Under ``scripts/test.sh`` (``TE_VLLM_REQUIRED=1``) a
    missing vllm fails the test module, so that CI never passes by skipping it;
    elsewhere it skips the module. Call it at import, inside the caller's
    ``warnings.catch_warnings()`` (vLLM and torch warn at import)."""
    if os.environ.get("TE_VLLM_REQUIRED") == "1":
        import torch
        import vllm  # noqa: F401
        return torch
    pytest.importorskip("vllm", reason="vllm is not installed (scripts/setup_vllm.sh)")
    return pytest.importorskip("torch")
