"""``te-mooncake``: run unchanged Mooncake transfer-engine code on this project.

    te-mooncake run script.py [args]      run a script with ``import mooncake`` -> ours
    te-mooncake run -m package.module     the same for a module
    te-mooncake path                      print the folder to put on PYTHONPATH
    te-mooncake install | uninstall       add (remove) the shim to this environment
                                          (a .pth file in site-packages)
    te-mooncake metadata-server [--port 8080] [--host ...]
                                          Mooncake's HTTP metadata server, ours

Every command that puts the shim on a path refuses (exit status 2) where a real
Mooncake is installed: the shim never shadows it.
"""

from __future__ import annotations

import glob
import importlib.metadata
import os
import sys
import sysconfig
from collections.abc import Sequence
from pathlib import Path

__all__ = ["SHIM_DIR", "find_real_mooncake", "main"]

SHIM_DIR = str(Path(__file__).resolve().parent / "shim")
_PTH = "te_mooncake_shim.pth"
_DISTRIBUTIONS = ("mooncake-transfer-engine", "mooncake-transfer-engine-non-cuda",
                  "mooncake-transfer-engine-cuda13")


def find_real_mooncake() -> str | None:
    """Where a real Mooncake is installed (a distribution, or a ``mooncake`` package
    with its compiled engine on ``sys.path``), or None."""
    for dist in _DISTRIBUTIONS:
        try:
            return f"{dist} {importlib.metadata.version(dist)}"
        except importlib.metadata.PackageNotFoundError:
            continue
    for entry in sys.path:
        folder = Path(entry or ".") / "mooncake"
        try:
            if folder.resolve().parent == Path(SHIM_DIR):
                continue
        except OSError:
            continue
        if glob.glob(str(folder / "engine*.so")) or glob.glob(str(folder / "store*.so")):
            return str(folder)
    return None


def _refuse() -> int | None:
    real = find_real_mooncake()
    if real is not None:
        print(f"te-mooncake: a real Mooncake is installed ({real}); refusing to shadow it",
              file=sys.stderr)
        return 2
    return None


def _run(args: Sequence[str]) -> int:
    if not args:
        print("te-mooncake run: give a script (or -m module) and its arguments",
              file=sys.stderr)
        return 2
    refused = _refuse()
    if refused is not None:
        return refused
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (SHIM_DIR, env.get("PYTHONPATH")) if p)
    os.execvpe(sys.executable, [sys.executable, *args], env)
    return 0  # not reached


def _site() -> Path:
    return Path(sysconfig.get_paths()["purelib"])


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    command = args.pop(0) if args else "help"
    if command == "run":
        return _run(args)
    if command == "path":
        refused = _refuse()
        if refused is not None:
            return refused
        print(SHIM_DIR)
        return 0
    if command == "install":
        refused = _refuse()
        if refused is not None:
            return refused
        target = Path(args[0]) if args else _site()
        (target / _PTH).write_text(SHIM_DIR + "\n")
        print(f"installed {target / _PTH}: `import mooncake` now loads the shim")
        return 0
    if command == "uninstall":
        target = Path(args[0]) if args else _site()
        try:
            (target / _PTH).unlink()
        except FileNotFoundError:
            print(f"nothing to remove at {target / _PTH}")
            return 0
        print(f"removed {target / _PTH}")
        return 0
    if command == "metadata-server":
        from transfer_engine.connectors.mooncake.metadata import main as serve
        return serve(args)
    print(__doc__)
    return 0 if command in ("help", "-h", "--help") else 2


if __name__ == "__main__":
    raise SystemExit(main())
