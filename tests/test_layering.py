"""The package's shape, as docs/architecture.md draws it: layers that import only
downwards, no import circles (counting imports made only for type checking or inside
functions: a circle there is still two modules that cannot be read apart), and modules
small enough to read in one sitting."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("transfer_engine", "kvstore", "scheduler")
MAX_LINES = 600
MAX_ENGINE_LINES = 400

# transfer_engine's top-level modules that make up the engine (layer 4); every other
# top-level module of it is a word the layers share (layer 1)
ENGINE_PARTS = {"engine", "transfer", "peers", "peer", "membership", "state", "validate",
                "watchdog", "endpoint", "metrics"}
LAYER_NAMES = {1: "words", 2: "control plane", 3: "transports", 4: "engine",
               5: "users of the engine"}


def _modules() -> dict[str, Path]:
    mods: dict[str, Path] = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            mods[".".join(parts)] = path
    return mods


def _imports(name: str, path: Path, mods: dict[str, Path]) -> set[str]:
    """The package modules ``name`` imports, anywhere in its source."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([node.module] if node.module else []))
            # the names imported when they are modules, else the module they come from
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in mods else base
                       for alias in node.names]
        for target in targets:
            while target and target not in mods:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    return {name: _imports(name, path, mods) for name, path in mods.items()}


def layer(name: str) -> int:
    parts = name.split(".")
    if parts[0] != "transfer_engine" or (len(parts) > 1 and parts[1] in (
            "connectors", "lab", "registry")):
        return 5
    if len(parts) == 1 or parts[1] in ENGINE_PARTS:
        return 4
    return {"control": 2, "transport": 3}.get(parts[1], 1)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_import_circles() -> None:
    graph = _graph()
    circles = _cycles(graph)
    detail = [" <-> ".join(c) + ": " + "; ".join(
        f"{a} -> {b}" for a in c for b in sorted(graph[a]) if b in c) for c in circles]
    assert not circles, "import circles:\n" + "\n".join(detail)


def test_layers_import_only_downwards() -> None:
    upward = [f"{a} ({LAYER_NAMES[layer(a)]}) imports {b} ({LAYER_NAMES[layer(b)]})"
              for a, deps in sorted(_graph().items()) for b in sorted(deps)
              if layer(b) > layer(a)]
    assert not upward, "\n".join(upward)


def test_the_layer_table_knows_every_engine_part() -> None:
    top = {name.split(".")[1] for name in _modules() if name.count(".") == 1
           and name.startswith("transfer_engine.")}
    assert ENGINE_PARTS <= top, ENGINE_PARTS - top


def test_modules_are_small() -> None:
    paths = [p for d in (*PACKAGES, "bench", "scripts", "tests")
             for p in sorted((ROOT / d).rglob("*.py"))]
    big = {str(p.relative_to(ROOT)): n for p in paths
           if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not big, f"modules over {MAX_LINES} lines: {big}"
    engine = len((ROOT / "transfer_engine" / "engine.py").read_text().splitlines())
    assert engine < MAX_ENGINE_LINES, f"engine.py has {engine} lines"


def test_the_circle_finder_finds_circles() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"e"}}
    assert _cycles(graph) == [["a", "b", "c"]]
