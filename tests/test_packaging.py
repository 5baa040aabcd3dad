"""What the installed distribution declares: its console script and the SGLang plugin
entry point, each naming something that imports (SGLang itself is not needed)."""

from __future__ import annotations

from importlib.metadata import entry_points


def test_console_script_and_sglang_plugin_are_declared() -> None:
    scripts = {ep.name: ep for ep in entry_points(group="console_scripts")}
    assert scripts["transfer_engine_bench"].value == "bench.transfer_engine_bench:main"
    assert callable(scripts["transfer_engine_bench"].load())
    plugins = {ep.name: ep for ep in entry_points(group="sglang.srt.plugins")}
    plugin = plugins["transfer_engine"]
    assert plugin.value == "transfer_engine.connectors.sglang.plugin:register"
    assert callable(plugin.load())  # imports SGLang only when called
