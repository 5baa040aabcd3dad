"""vLLM engines in child processes (:mod:`tests.helpers.vllm_pd_worker`), as the vLLM
end-to-end tests drive them, and the geometry of the tiny model they serve
(``bench.vllm_servers.build_model``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).resolve().with_name("vllm_pd_worker.py")
MAX_TOKENS = 12
BLOCK_SIZE = 32
BLOCK_BYTES = 2 * 2 * BLOCK_SIZE * 64 * 4  # layers x K/V x tokens x head dim x fp32


class EngineProcess:
    """One vLLM engine in a child process, spoken to in JSON lines."""

    def __init__(self, role: str, model: Path, log: Path, extra: dict[str, Any],
                 cores: str) -> None:
        env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0",
                   VLLM_CPU_KVCACHE_SPACE="1", PYTHONPATH=str(ROOT),
                   VLLM_CPU_OMP_THREADS_BIND=cores, TE_VLLM_EXTRA=json.dumps(extra))
        self.role = role
        self._log = open(log, "w")  # noqa: SIM115 - closed in close()
        self.proc = subprocess.Popen(
            [sys.executable, str(WORKER), role, str(model)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, text=True,
            env=env)

    def recv(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("@@TE@@ "):
                reply: dict[str, Any] = json.loads(line[7:])
                return reply
        raise RuntimeError(f"{self.role} engine exited; its log: {self._log.name}\n"
                           + Path(self._log.name).read_text()[-4000:])

    def call(self, **cmd: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self.recv()

    def generate(self, prompt: str, max_tokens: int,
                 params: dict[str, Any] | None = None) -> dict[str, Any]:
        """One request: its tokens, kv_transfer_params, wall time and TTFT (seconds)."""
        out = self.call(op="generate", prompts=[prompt], max_tokens=max_tokens,
                        params=[params])
        return {k: v[0] for k, v in out.items()}

    def close(self) -> None:
        try:
            if self.proc.poll() is None and self.proc.stdin is not None:
                self.proc.stdin.write('{"op": "quit"}\n')
                self.proc.stdin.flush()
            self.proc.wait(60)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait(10)
        finally:
            for stream in (self.proc.stdin, self.proc.stdout):
                if stream is not None:
                    stream.close()
            self._log.close()
