"""What the package declares: its console script and the SGLang plugin entry point, in
pyproject.toml and in the installed distribution (scripts/setup.sh reinstalls one that
is stale), each naming something that imports (SGLang itself is not needed)."""

from __future__ import annotations

import importlib
from importlib.metadata import distribution
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib", reason="tomllib needs Python 3.11")

ROOT = Path(__file__).resolve().parent.parent
WANT = {("console_scripts", "transfer_engine_bench"): "bench.transfer_engine_bench:main",
        ("sglang.srt.plugins", "transfer_engine"):
            "transfer_engine.connectors.sglang.plugin:register"}


def _load(value: str) -> object:
    module, _, attr = value.partition(":")
    return getattr(importlib.import_module(module), attr)


def test_pyproject_declares_the_script_and_the_sglang_plugin() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = {("console_scripts", k): v for k, v in project["scripts"].items()}
    for group, entries in project["entry-points"].items():
        declared.update({(group, k): v for k, v in entries.items()})
    for key, value in WANT.items():
        assert declared.get(key) == value, key
        assert callable(_load(value))  # the plugin imports SGLang only when called


def test_installed_distribution_matches() -> None:
    installed = {(ep.group, ep.name): ep.value
                 for ep in distribution("transfer-engine").entry_points}
    for key, value in WANT.items():
        assert installed.get(key) == value, f"{key}: reinstall (scripts/setup.sh)"
