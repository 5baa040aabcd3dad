"""The ``mooncake`` package shim and the ``te-mooncake`` command: unchanged
``import mooncake.engine`` code runs on our engine, and a real Mooncake is never
shadowed."""

from __future__ import annotations

import importlib
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

from transfer_engine.connectors.mooncake.cli import SHIM_DIR, find_real_mooncake

ROOT = Path(__file__).resolve().parent.parent


def _te_mooncake(*args: str, pythonpath: str = "", cwd: Path | None = None
                 ) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), pythonpath)
                                                       if p)}
    return subprocess.run([sys.executable, "-m", "transfer_engine.connectors.mooncake",
                           *args], env=env, cwd=cwd, capture_output=True, text=True,
                          timeout=60)


MOONCAKE_CODE = """
import numpy as np
import mooncake
from mooncake.engine import TransferEngine, TransferOpcode, TransferNotify, Read, Write
import mooncake.engine as engine
assert mooncake.IS_SHIM and engine.RpcInterface is engine.CoroRPCInterface
a, b = TransferEngine(), TransferEngine()
assert a.initialize("127.0.0.1", "P2PHANDSHAKE", "rdma", "") == 0
assert b.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
dst = b.allocate_managed_buffer(4096)
src = np.arange(64, dtype=np.uint8)
assert a.transfer_sync_write(f"127.0.0.1:{b.get_rpc_port()}", src.ctypes.data, dst, 64) == 0
assert b.read_bytes_from_buffer(dst, 64) == src.tobytes()
print("ran on the shim", int(Write))
"""


def test_run_executes_unchanged_mooncake_code() -> None:
    assert find_real_mooncake() is None, "these tests expect no real Mooncake here"
    done = _te_mooncake("run", "-c", MOONCAKE_CODE)
    assert done.returncode == 0, done.stderr
    assert "ran on the shim 1" in done.stdout


def test_path_install_and_uninstall(tmp_path: Path) -> None:
    done = _te_mooncake("path")
    assert done.returncode == 0 and done.stdout.strip() == SHIM_DIR
    assert _te_mooncake("install", str(tmp_path)).returncode == 0
    assert (tmp_path / "te_mooncake_shim.pth").read_text().strip() == SHIM_DIR
    assert _te_mooncake("uninstall", str(tmp_path)).returncode == 0
    assert not (tmp_path / "te_mooncake_shim.pth").exists()
    assert _te_mooncake("uninstall", str(tmp_path)).returncode == 0  # nothing to remove
    assert _te_mooncake("no-such-command").returncode == 2


def test_a_real_mooncake_is_never_shadowed(tmp_path: Path) -> None:
    real = tmp_path / "site" / "mooncake"
    real.mkdir(parents=True)
    (real / "__init__.py").write_text("")
    (real / "engine.cpython-311-x86_64-linux-gnu.so").write_bytes(b"")  # its compiled engine
    site = str(tmp_path / "site")
    for args in (("run", "-c", "import mooncake"), ("path",), ("install", str(tmp_path))):
        done = _te_mooncake(*args, pythonpath=site)
        assert done.returncode == 2, args
        assert "refusing to shadow" in done.stderr
    assert not (tmp_path / "te_mooncake_shim.pth").exists()
    # the shim put first on the path by hand refuses to load
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([SHIM_DIR, str(ROOT), site])}
    done = subprocess.run([sys.executable, "-c", "import mooncake.engine"], env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "refuses to shadow" in done.stderr


def test_store_names_come_from_the_kv_store() -> None:
    code = ("import mooncake\n"
            "try:\n    from mooncake.store import MooncakeDistributedStore\n"
            "except ImportError as exc:\n    print('store:', exc)\n"
            "else:\n    print('store: ok')\n"
            "try:\n    from mooncake import BufferPool\n"
            "except ImportError as exc:\n    print('pool:', exc)\n"
            "else:\n    print('pool: ok')\n")
    done = _te_mooncake("run", "-c", code)
    assert done.returncode == 0, done.stderr
    if importlib.util.find_spec("kvstore.mooncake_store") is None:
        assert "store: mooncake.store: this install of the project has no Mooncake" in \
            done.stdout
        assert "pool: cannot import name 'BufferPool'" in done.stdout
        return
    try:
        importlib.import_module("kvstore.mooncake_store")
    except ImportError:
        return  # a store module that does not import here fails the same way there
    assert "store: ok" in done.stdout


def test_pyproject_declares_the_command() -> None:
    tomllib = importlib.import_module("tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    module, _, attr = project["scripts"]["te-mooncake"].partition(":")
    assert callable(getattr(importlib.import_module(module), attr))
