"""SGLang's disaggregation classes without the SGLang runtime, and a rank in a process.

SGLang's runtime needs CUDA-only packages, so ``import sglang`` cannot succeed here.
:func:`load_sglang` imports from the pinned wheel (``scripts/setup_sglang.sh`` installs
it with ``--no-deps`` into ``.venv-sglang/site``; ``TE_SGLANG_SITE`` overrides) exactly:

- ``sglang/srt/disaggregation/base/conn.py`` (``BaseKVManager``, ``BaseKVSender``,
  ``BaseKVReceiver``, ``BaseKVBootstrapServer``, ``KVArgs``, ``KVPoll``, ...), executed
  verbatim except for its ``from sglang.srt.server_args import ServerArgs``: that
  module pulls in the whole runtime, and the file uses ``ServerArgs`` only in an
  annotation (under ``from __future__ import annotations``, never evaluated), which is
  checked on the syntax tree before the line is dropped;
- ``sglang/srt/disaggregation/base/__init__.py``, ``sglang/srt/environ.py``,
  ``sglang/srt/plugins/__init__.py``, ``sglang/srt/plugins/hook_registry.py`` and
  ``sglang/srt/arg_groups/choices.py``, verbatim;
- from ``sglang/srt/disaggregation/utils.py`` (which imports torch.distributed and the
  model configs) only the definitions of ``DisaggregationMode``, ``TransferBackend``,
  ``KVClassType`` and ``get_kv_class``, taken from its syntax tree into a module of
  their own.

The package ``sglang`` itself is entered without running its ``__init__.py`` (it
imports the runtime); ``sglang.srt`` and ``sglang.srt.disaggregation`` are namespace
packages in the wheel.

Run as ``python -m tests.helpers.sglang_worker ROLE BOOTSTRAP_PORT SEED [SPEC_JSON]``: builds a
rank (``prefill`` or ``decode``) with an MHA-style pool of real torch CPU tensors and
answers JSON commands, one per line, on stdin (see :func:`serve`).
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import json
import os
import sys
import time
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SGLANG_VERSION = "0.5.23"
SITE = Path(os.environ.get("TE_SGLANG_SITE")
            or Path(__file__).resolve().parents[2] / ".venv-sglang" / "site")

_DISAGG_UTILS_DEFS = ("DisaggregationMode", "TransferBackend", "KVClassType", "get_kv_class")


def skip_reason() -> str | None:
    """Why SGLang's classes cannot be loaded here, or None."""
    if not (SITE / "sglang" / "srt" / "disaggregation" / "base" / "conn.py").is_file():
        return (f"the sglang wheel is not installed in {SITE} "
                "(run scripts/setup_sglang.sh)")
    if not (SITE / f"sglang-{SGLANG_VERSION}.dist-info").is_dir():
        return f"{SITE} does not hold sglang {SGLANG_VERSION} (run scripts/setup_sglang.sh)"
    try:
        import torch  # noqa: F401
    except ImportError:
        return "torch is not importable"
    return None


@dataclass
class SGLang:
    base: types.ModuleType  # sglang.srt.disaggregation.base.conn
    utils: types.ModuleType  # the four definitions of sglang.srt.disaggregation.utils
    hook_registry: types.ModuleType  # sglang.srt.plugins.hook_registry
    choices: types.ModuleType  # sglang.srt.arg_groups.choices


_LOADED: SGLang | None = None


def load_sglang() -> SGLang:
    """Loads the modules named in this module's docstring (once per process)."""
    global _LOADED
    if _LOADED is not None:
        return _LOADED
    root = SITE / "sglang"
    if "sglang" not in sys.modules:
        pkg = types.ModuleType("sglang")
        pkg.__path__ = [str(root)]
        pkg.__file__ = str(root / "__init__.py")
        pkg.__spec__ = importlib.util.spec_from_file_location(
            "sglang", root / "__init__.py", submodule_search_locations=[str(root)])
        sys.modules["sglang"] = pkg
    conn_path = root / "srt" / "disaggregation" / "base" / "conn.py"
    tree = ast.parse(conn_path.read_text(), str(conn_path))
    _drop_annotation_only_import(tree, "sglang.srt.server_args", "ServerArgs")
    importlib.import_module("sglang.srt.disaggregation")
    conn = types.ModuleType("sglang.srt.disaggregation.base.conn")
    conn.__file__ = str(conn_path)
    sys.modules[conn.__name__] = conn
    exec(compile(tree, str(conn_path), "exec"), conn.__dict__)
    base = importlib.import_module("sglang.srt.disaggregation.base")
    assert base.BaseKVManager is conn.BaseKVManager
    hook_registry = importlib.import_module("sglang.srt.plugins.hook_registry")
    importlib.import_module("sglang.srt.plugins")
    choices = importlib.import_module("sglang.srt.arg_groups.choices")
    _LOADED = SGLang(conn, _utils_subset(root / "srt" / "disaggregation" / "utils.py"),
                     hook_registry, choices)
    return _LOADED


def _drop_annotation_only_import(tree: ast.Module, module: str, name: str) -> None:
    """Removes ``from module import name`` after checking that ``name`` appears only
    inside annotations, and that annotations are not evaluated."""
    assert any(isinstance(n, ast.ImportFrom) and n.module == "__future__"
               and any(a.name == "annotations" for a in n.names) for n in tree.body)
    annotations = set()
    for node in ast.walk(tree):
        for ann in ([getattr(node, "annotation", None), getattr(node, "returns", None)]):
            if ann is not None:
                annotations.update(id(n) for n in ast.walk(ann))
    uses = [n for n in ast.walk(tree) if isinstance(n, ast.Name) and n.id == name]
    outside = [n.lineno for n in uses if id(n) not in annotations]
    if outside:
        raise RuntimeError(f"{name} is used outside annotations on lines {outside}; the "
                           "base module can no longer be loaded without the runtime")
    imports = [n for n in tree.body if isinstance(n, ast.ImportFrom) and n.module == module
               and [a.name for a in n.names] == [name]]
    if len(imports) != 1:
        raise RuntimeError(f"expected one 'from {module} import {name}' in the base module")
    tree.body.remove(imports[0])


def _utils_subset(path: Path) -> types.ModuleType:
    tree = ast.parse(path.read_text(), str(path))
    keep: dict[str, ast.stmt] = {}
    for node in tree.body:
        if isinstance(node, ast.ClassDef | ast.FunctionDef) and node.name in _DISAGG_UTILS_DEFS:
            if isinstance(node, ast.FunctionDef) and any(
                    isinstance(d, ast.Name) and d.id == "overload" for d in node.decorator_list):
                continue
            keep[node.name] = node
    missing = set(_DISAGG_UTILS_DEFS) - set(keep)
    if missing:
        raise RuntimeError(f"{path} no longer defines {sorted(missing)}")
    header = ast.parse("from __future__ import annotations\nfrom enum import Enum\n"
                       "from typing import Literal, Optional, Type\n")
    module = ast.Module(body=header.body + [keep[n] for n in _DISAGG_UTILS_DEFS],
                        type_ignores=[])
    mod = types.ModuleType("sglang_disaggregation_utils_subset")
    mod.__file__ = str(path)
    sys.modules[mod.__name__] = mod
    exec(compile(module, str(path), "exec"), mod.__dict__)
    return mod


# --- an MHA token-to-KV pool like SGLang's, and a rank serving commands ---------------


@dataclass(frozen=True)
class PoolSpec:
    """MHATokenToKVPool geometry: per layer a K and a V buffer of shape
    ``[(pages + 1) * page_size, heads, head_dim]`` (SGLang keeps one padded page), page
    ``p`` is rows ``[p*page_size, (p+1)*page_size)``; plus metadata rows like
    ``MetadataBuffers`` (int32 output ids, float32 logprobs)."""

    layers: int = 4
    heads: int = 2
    head_dim: int = 64
    page_size: int = 16
    pages: int = 64
    dtype: str = "bfloat16"
    aux_rows: int = 8


def build_pool(spec: PoolSpec, seed: int | None) -> tuple[list[Any], list[Any]]:
    """K buffers then V buffers, and the aux buffers: seeded random bytes, or zeros
    when ``seed`` is None."""
    import torch

    dtype = getattr(torch, spec.dtype)
    rows = (spec.pages + 1) * spec.page_size
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    kv = []
    for _ in range(2 * spec.layers):
        t = torch.zeros((rows, spec.heads, spec.head_dim), dtype=dtype)
        if gen is not None:
            raw = t.view(torch.uint8).view(-1)
            raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=gen))
        kv.append(t)
    aux = [torch.zeros((spec.aux_rows, 16), dtype=torch.int32),
           torch.zeros((spec.aux_rows, 16), dtype=torch.float32)]
    if gen is not None:
        for t in aux:
            raw = t.view(torch.uint8).view(-1)
            raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=gen))
    return kv, aux


def kv_args(sg: SGLang, spec: PoolSpec, kv: list[Any], aux: list[Any], rank: int = 0) -> Any:
    """SGLang's ``KVArgs`` filled the way its prefill/decode queues fill it."""
    args = sg.base.KVArgs()
    args.engine_rank = rank
    args.kv_data_ptrs = [t.data_ptr() for t in kv]
    args.kv_data_lens = [t.nbytes for t in kv]
    args.kv_item_lens = [t[0].nbytes * spec.page_size for t in kv]
    args.kv_layer_ids = list(range(spec.layers)) * 2
    args.kv_cache_dtype_str = spec.dtype
    args.aux_data_ptrs = [t.data_ptr() for t in aux]
    args.aux_data_lens = [t.nbytes for t in aux]
    args.aux_item_lens = [t[0].nbytes for t in aux]
    args.page_size = spec.page_size
    args.kv_head_num = spec.heads
    args.total_kv_head_num = spec.heads
    args.gpu_id = 0
    args.ib_device = ""
    return args


def server_args(bootstrap_port: int) -> Any:
    """The fields of SGLang's ``ServerArgs`` the backend reads. A plain namespace: the
    real class lives in the module that needs the whole runtime."""
    return types.SimpleNamespace(host="127.0.0.1", device="cpu",
                                 disaggregation_bootstrap_port=bootstrap_port)


def serve(role: str, bootstrap_port: int, seed: int | None, spec: PoolSpec,
          config: dict[str, Any]) -> None:
    """Commands (JSON objects, one per line) and their answers (one JSON line each):

    ``{"op": "sender"|"receiver", "room": R, "addr": "host:port"}`` creates one;
    ``{"op": "init", "room": R, ...}`` calls init (prefill: ``pages``, ``aux``;
    decode: ``dp_rank``); ``{"op": "send", "room": R, "pages": [...]}``;
    ``{"op": "send_metadata", "room": R, "pages": [...], "aux": A}``;
    ``{"op": "poll", "room": R}`` -> state; ``{"op": "wait", "room": R, "until": [...],
    "timeout": s}`` polls until the state is one of ``until`` -> state and the states
    seen so far; ``{"op": "failure", "room": R}`` -> the error's type and text;
    ``{"op": "dump", "path": P}`` saves every buffer's bytes to P (npz);
    ``{"op": "stats"}`` -> engine counters; ``{"op": "exit"}``.
    """
    import numpy as np

    sg = load_sglang()  # before the backend, which imports SGLang's base module

    from transfer_engine.connectors.sglang import (
        SGLangBackendConfig,
        TransferEngineKVManager,
        TransferEngineKVReceiver,
        TransferEngineKVSender,
    )

    kv, aux = build_pool(spec, seed)
    mode = sg.utils.DisaggregationMode(role)
    cfg = SGLangBackendConfig(**config)
    names = {v: k for k, v in vars(sg.base.KVPoll).items() if isinstance(v, int)}
    with TransferEngineKVManager(kv_args(sg, spec, kv, aux), mode, server_args(bootstrap_port),
                                 False, config=cfg) as mgr:
        conns: dict[int, Any] = {}
        seen: dict[int, list[str]] = {}

        def poll(room: int) -> str:
            state = names[conns[room].poll()]
            if not seen[room] or seen[room][-1] != state:
                seen[room].append(state)
            return state

        print(json.dumps({"ready": mgr.name}), flush=True)
        for line in sys.stdin:
            cmd = json.loads(line)
            op, room = cmd["op"], cmd.get("room")
            out: dict[str, Any] = {"ok": True}
            if op == "sender":
                conns[room] = TransferEngineKVSender(mgr, cmd["addr"], room)
                seen[room] = []
                out["state"] = poll(room)
            elif op == "receiver":
                conns[room] = TransferEngineKVReceiver(mgr, cmd["addr"], room)
                seen[room] = []
                out["state"] = poll(room)
            elif op == "init" and role == "prefill":
                conns[room].init(cmd["pages"], cmd.get("aux"))
            elif op == "init":
                conns[room].init(cmd.get("dp_rank", 0))
                out["state"] = poll(room)
            elif op == "send":
                conns[room].send(np.array(cmd["pages"], dtype=np.int32))
                out["state"] = poll(room)
            elif op == "send_metadata":
                conns[room].send_metadata(np.array(cmd["pages"], dtype=np.int32),
                                          cmd.get("aux"))
                out["state"] = poll(room)
            elif op == "poll":
                out["state"] = poll(room)
            elif op == "wait":
                deadline = time.monotonic() + cmd.get("timeout", 10.0)
                while poll(room) not in cmd["until"] and time.monotonic() < deadline:
                    time.sleep(0.005)
                out["state"] = poll(room)
                out["seen"] = seen[room]
            elif op == "failure":
                try:
                    conns[room].failure_exception()
                except Exception as exc:
                    out["error"] = [type(exc).__name__, str(exc)]
            elif op == "dump":
                import torch

                arrays = {f"kv{i}": t.view(torch.uint8).numpy() for i, t in enumerate(kv)}
                arrays.update({f"aux{i}": t.view(torch.uint8).numpy()
                               for i, t in enumerate(aux)})
                np.savez(cmd["path"], **arrays)
            elif op == "stats":
                out["stats"] = dict(mgr.engine.stats)
            elif op == "exit":
                print(json.dumps(out), flush=True)
                break
            else:
                out = {"ok": False, "error": f"unknown op {op!r}"}
            print(json.dumps(out), flush=True)


def main() -> None:
    role, port = sys.argv[1], int(sys.argv[2])
    seed = None if sys.argv[3] == "-" else int(sys.argv[3])
    extra = json.loads(sys.argv[4]) if len(sys.argv) > 4 else {}
    spec = PoolSpec(**extra.get("pool", {}))
    serve(role, port, seed, spec, extra.get("config", {}))


if __name__ == "__main__":
    main()
