"""The SGLang backend inside real SGLang servers: a prefill and a decode server started
with ``--disaggregation-transfer-backend transfer_engine`` answer every prompt, one at a
time and several at once, token for token as one server alone does (decode computes no
prompt: the KV crosses our engine); a request whose prefill server cannot be reached,
or whose prefill never comes, is failed by decode within the backend's timeouts and
the servers go on serving.

SGLang's runtime is not part of this project's set-up (on CPU it needs SGLang's CPU
kernels built from source; on a GPU host, SGLang as usual), so these tests run only
where ``TE_SGLANG_PYTHON`` names a Python whose SGLang serves and imports this package:

- ``TE_SGLANG_PYTHON``: that interpreter;
- ``TE_SGLANG_SERVER_ARGS``: arguments for every server (default, for SGLang's CPU
  engine: ``--device cpu --disable-overlap-schedule --attention-backend torch_native
  --max-total-tokens 4096 --sleep-on-idle``: an idle scheduler otherwise polls without
  pause and starves the other server's start-up on a small host; on CPU each server's
  compute threads also get their own half of the cores);
- ``TE_SGLANG_DECODE_ARGS``: more for the decode server (default on CPU:
  ``--disaggregation-decode-retraction-backup cpu_tensor``);
- ``TE_SGLANG_ENV``: ``NAME=VALUE`` pairs for the servers only (on CPU, SGLang's
  ``SGLANG_USE_CPU_ENGINE=1`` and its ``LD_PRELOAD``).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shlex
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from bench.fleet import free_port
from bench.vllm_servers import ROOT, core_halves, http_json, launched, wait_healthy

PYTHON = os.environ.get("TE_SGLANG_PYTHON", "")
pytestmark = pytest.mark.skipif(
    not PYTHON, reason="no SGLang that serves here: set TE_SGLANG_PYTHON to its python "
    "(see this module's docstring)")

CPU_ARGS = ("--device cpu --disable-overlap-schedule --attention-backend torch_native "
            "--max-total-tokens 4096 --sleep-on-idle")
PROMPTS = ["the cache of one prefill", "decode reads a block of tokens from memory",
           "one two three four five six seven eight nine ten " * 6,
           "red green blue"]


def _server_env(cores: str | None = None) -> dict[str, str]:
    env = dict(os.environ, SGLANG_HOST_IP="127.0.0.1", HOST_IP="127.0.0.1",
               TE_SGLANG_HOST="127.0.0.1", PYTHONPATH=str(ROOT),
               TE_SGLANG_WAITING_TIMEOUT="30", TE_SGLANG_BOOTSTRAP_TIMEOUT="30",
               TE_SGLANG_HEARTBEAT_INTERVAL="1")
    if cores is not None:  # SGLang's CPU engine: its compute threads on these cores
        env["SGLANG_CPU_OMP_THREADS_BIND"] = cores
    for pair in shlex.split(os.environ.get("TE_SGLANG_ENV", "")):
        name, _, value = pair.partition("=")
        env[name] = value
    return env


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("sglang-model")
    subprocess.run([PYTHON, "-c", "import sys, pathlib; from bench.vllm_servers import "
                    "build_model; build_model(pathlib.Path(sys.argv[1]), kv_heads=2)",
                    str(path)], cwd=ROOT, check=True, timeout=300)
    return path


@contextlib.contextmanager
def _servers(model: Path, *servers: tuple[Path, str | None, list[str]]
             ) -> Iterator[list[int]]:
    """SGLang servers ``(log, cores or None, extra arguments)``, started together;
    their ports once every one is healthy."""
    args = shlex.split(os.environ.get("TE_SGLANG_SERVER_ARGS", CPU_ARGS))
    with contextlib.ExitStack() as stack:
        running = []
        for log, cores, extra in servers:
            port = free_port()
            cmd = [PYTHON, "-m", "sglang.launch_server", "--model-path", str(model),
                   "--host", "127.0.0.1", "--port", str(port), "--dtype", "bfloat16",
                   *args, *extra]
            running.append((port, stack.enter_context(launched(cmd, log, _server_env(
                cores if "--device" in args else None))), log))
        for port, proc, log in running:
            wait_healthy(port, proc, log, timeout=900)
        yield [port for port, _, _ in running]


def _ask(port: int, prompt: str, **extra: Any) -> tuple[int, Any]:
    status, body = http_json(port, "POST", "/generate", {
        "text": prompt, "sampling_params": {"max_new_tokens": 12, "temperature": 0,
                                            "ignore_eos": True}, **extra}, timeout=300)
    with contextlib.suppress(ValueError):
        return status, json.loads(body)
    return status, body


def _generate(port: int, prompt: str, **extra: Any) -> dict[str, Any]:
    status, out = _ask(port, prompt, **extra)
    assert status == 200 and isinstance(out, dict), out
    return out


def _failed(status: int, out: Any) -> bool:
    """Whether SGLang answered a request as failed (an error status or an abort)."""
    finish = out.get("meta_info", {}).get("finish_reason") if isinstance(out, dict) else None
    return status != 200 or (isinstance(finish, dict) and finish.get("type") == "abort")


def _disaggregated(prefill: int, decode: int, bootstrap: int, prompt: str,
                   room: int | None = None) -> dict[str, Any]:
    """What SGLang's router does: the request to both servers at once, one room."""
    params = {"bootstrap_host": "127.0.0.1", "bootstrap_port": bootstrap,
              "bootstrap_room": random.getrandbits(62) if room is None else room}
    out: dict[str, Any] = {}

    def ask(port: int, key: str) -> None:
        out[key] = _generate(port, prompt, **params)

    threads = [threading.Thread(target=ask, args=(p, k))
               for p, k in ((prefill, "prefill"), (decode, "decode"))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert set(out) == {"prefill", "decode"}, out
    return out["decode"]


def test_prefill_and_decode_servers_answer_as_one_server(model: Path, tmp_path: Path
                                                         ) -> None:
    with _servers(model, (tmp_path / "alone.log", None, [])) as (alone,):
        expected = [_generate(alone, p)["output_ids"] for p in PROMPTS]
    bootstrap = free_port()
    backend = ["--disaggregation-transfer-backend", "transfer_engine"]
    decode_args = shlex.split(os.environ.get(
        "TE_SGLANG_DECODE_ARGS", "--disaggregation-decode-retraction-backup cpu_tensor"))
    first, second = core_halves()
    with _servers(model, (tmp_path / "prefill.log", first,
                          [*backend, "--disaggregation-mode", "prefill",
                           "--disaggregation-bootstrap-port", str(bootstrap)]),
                  (tmp_path / "decode.log", second,
                   [*backend, "--disaggregation-mode", "decode", *decode_args])
                  ) as (prefill, decode):
        for prompt, ids in zip(PROMPTS, expected, strict=True):
            got = _disaggregated(prefill, decode, bootstrap, prompt)
            assert got["output_ids"] == ids, (prompt, got["output_ids"], ids)
        # the same prompts again (prefill's radix cache now holds them) and concurrently
        results: dict[int, list[int]] = {}
        threads = [threading.Thread(target=lambda i=i: results.__setitem__(
            i, _disaggregated(prefill, decode, bootstrap, PROMPTS[i])["output_ids"]))
            for i in range(len(PROMPTS))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        assert [results.get(i) for i in range(len(PROMPTS))] == expected
        for name in ("prefill", "decode"):
            log = (tmp_path / f"{name}.log").read_text(errors="replace")
            assert "Traceback" not in log, log[-3000:]
        # decode told of a prefill server that is not there: failed, bounded
        started = time.monotonic()
        status, out = _ask(decode, PROMPTS[0], bootstrap_host="127.0.0.1",
                           bootstrap_port=free_port(), bootstrap_room=random.getrandbits(62))
        assert _failed(status, out), out
        assert time.monotonic() - started < 90
        # decode alone, with a room its prefill never gets: failed once decode's wait ends
        started = time.monotonic()
        status, out = _ask(decode, PROMPTS[1], bootstrap_host="127.0.0.1",
                           bootstrap_port=bootstrap, bootstrap_room=random.getrandbits(62))
        assert _failed(status, out), out
        assert time.monotonic() - started < 120
        # and both servers go on serving
        got = _disaggregated(prefill, decode, bootstrap, PROMPTS[2])
        assert got["output_ids"] == expected[2]
