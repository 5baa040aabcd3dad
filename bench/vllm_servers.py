"""Real vLLM servers for the benches and tests that need them: tiny random Llama models
built offline, processes started in their own session and ended with it, and the HTTP
helpers that talk to them (vLLM itself is imported only inside the model builders)."""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import re
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from bench.fleet import end_process

ROOT = Path(__file__).resolve().parent.parent
WORDS = ("the a of to and in is it that for on was with as by at from this be are or "
         "prefill decode cache block token page layer engine transfer memory model fast "
         "slow red green blue one two three four five six seven eight nine ten").split()


def build_model(path: Path, kv_heads: int = 1) -> None:
    """A 2-layer Llama (hidden 128, two attention heads of dim 64 sharing ``kv_heads``
    KV heads) with random weights and a word-level tokenizer, saved in Hugging Face
    format."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for word in WORDS:
        vocab.setdefault(word, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                            eos_token="</s>").save_pretrained(path)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(vocab), hidden_size=128, intermediate_size=256,
                         num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=kv_heads,
                         max_position_embeddings=512, bos_token_id=1, eos_token_id=2,
                         initializer_range=0.2)
    LlamaForCausalLM(config).save_pretrained(path)


def core_halves() -> tuple[str, str]:
    """Two disjoint CPU lists for VLLM_CPU_OMP_THREADS_BIND. vLLM's CPU worker pins its
    compute thread to the cores it binds and busy-polls between steps; two engines on
    one host left to bind automatically take the same cores and starve each other
    (steps and transfers then stall for seconds)."""
    cpus = sorted(os.sched_getaffinity(0))
    half = max(1, len(cpus) // 2)
    first, second = cpus[:half], cpus[half:] or cpus[:half]
    return ",".join(map(str, first)), ",".join(map(str, second))


def http_json(port: int, method: str, path: str, body: dict[str, Any] | None = None,
              timeout: float = 60.0) -> tuple[int, str]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request(method, path, json.dumps(body).encode() if body else None,
                     {"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, resp.read().decode()
    finally:
        conn.close()


def stream_times(port: int, body: dict[str, Any], timeout: float = 120.0
                 ) -> list[float]:
    """Arrival times (``perf_counter``) of a streamed completion's data lines (one per
    token, but for text a token leaves unfinished); the first entry is when it was
    sent."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        seen = [time.perf_counter()]
        conn.request("POST", "/v1/completions", json.dumps(dict(body, stream=True)).encode(),
                     {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {resp.read()[:200]!r}")
        for line in iter(resp.readline, b""):
            if line.startswith(b"data: ") and not line.startswith(b"data: [DONE]"):
                seen.append(time.perf_counter())
        if len(seen) < 2:
            raise RuntimeError("no data line")
        return seen
    finally:
        conn.close()


def by_source(port: int) -> dict[str, float]:
    """vLLM's own accounting of prompt tokens on a server: loaded or computed."""
    metrics = http_json(port, "GET", "/metrics")[1]
    return {k: float(v) for k, v in re.findall(
        r'^vllm:prompt_tokens_by_source_total\{[^}]*source="(\w+)"[^}]*\} ([\d.]+)$',
        metrics, re.M)}


def vllm_metrics(port: int, prefix: str) -> dict[str, float]:
    """A server's series ``vllm:<prefix>*`` on its /metrics, each summed over its
    labels."""
    out: dict[str, float] = {}
    for name, value in re.findall(rf"^vllm:({re.escape(prefix)}\w*?)(?:\{{[^}}]*\}})? "
                                  r"([\d.e+-]+)$",
                                  http_json(port, "GET", "/metrics")[1], re.M):
        out[name] = out.get(name, 0.0) + float(value)
    return out


def te_metrics(port: int) -> dict[str, float]:
    """The connector's series (``vllm:te_kv_*``) on a server's /metrics."""
    return vllm_metrics(port, "te_kv_")


def wait_in_log(log: Path, pattern: str, timeout: float = 60.0) -> re.Match[str]:
    """The first match of ``pattern`` in the file ``log``, waited for (a process's line
    saying it is ready); AssertionError with the log after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not (found := re.search(pattern, log.read_text())):
        assert time.monotonic() < deadline, log.read_text()
        time.sleep(0.1)
    return found


def te_grown(port: int, before: dict[str, float], key: str, least: float,
             model: str, timeout: float = 20.0) -> float:
    """How much a connector counter of the server grew since ``before``, waiting a
    bounded while for it to reach ``least`` (vLLM publishes a step's stats after the
    step: a one-token request makes the next one)."""
    deadline = time.monotonic() + timeout
    while True:
        grown = te_metrics(port).get(key, 0) - before.get(key, 0)
        if grown >= least or time.monotonic() > deadline:
            return grown
        http_json(port, "POST", "/v1/completions",
                  {"model": model, "prompt": "tick", "max_tokens": 1})
        time.sleep(0.1)


@contextlib.contextmanager
def launched(cmd: list[str], log: Path, env: dict[str, str]) -> Iterator[subprocess.Popen[bytes]]:
    """A process in its own session (vLLM's server starts engine processes under it),
    ended with its whole group."""
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env,
                                cwd=ROOT, start_new_session=True)
        try:
            yield proc
        finally:
            end_process(proc, timeout=30, group=True)


def wait_healthy(port: int, proc: subprocess.Popen[bytes], log: Path,
                 timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited ({proc.returncode}):\n"
                               + log.read_text()[-4000:])
        with contextlib.suppress(OSError):
            if http_json(port, "GET", "/health", timeout=5)[0] == 200:
                return
        time.sleep(1)
    raise TimeoutError(f"server on {port} not healthy in {timeout}s:\n"
                       + log.read_text()[-4000:])


CHAT_TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"


def build_byte_model(path: Path) -> None:
    """Like :func:`build_model`, with a byte-level BPE tokenizer: most of its tokens
    are single bytes, so a random model's tokens often end inside a UTF-8 character."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator([" ".join(WORDS)] * 20 + ["héllo wörld 日本語 ünïcode"] * 5,
                            trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)
    torch.manual_seed(1)
    config = LlamaConfig(vocab_size=tok.get_vocab_size(), hidden_size=128,
                         intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=1, max_position_embeddings=1024,
                         bos_token_id=1, eos_token_id=2, initializer_range=0.2)
    LlamaForCausalLM(config).save_pretrained(path)
