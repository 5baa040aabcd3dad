"""How the disaggregation proxy routes: the scheduler's router over the prefill and
decode servers, the scheduler's view of a request (prefix keys, prompt length), and the
served model's tokenizer per decode server. (A helper of ``scripts/pd_proxy.py``,
imported from the scripts folder once the repository root is on ``sys.path``.)"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

from pd_proxy_upstream import KeyRefused, get_json

from scheduler.fleet import Fleet
from scheduler.handoff import load_tokenizer
from scheduler.policy import BreakerBoard, TrafficPolicy
from scheduler.prefix import text_keys
from scheduler.router import DEFAULT_POLICY, Request, Router

__all__ = ["CHARS_PER_TOKEN", "LOCAL_BELOW", "arguments", "make_router", "request_of",
           "Tokenizers"]

CHARS_PER_TOKEN = 4  # without the model's tokenizer: a rough, model-free estimate
TOKENIZE_CHARS = 16384  # characters of a prompt counted with the tokenizer (the head)
LOCAL_BELOW = 64  # prompts this short prefill on decode: measured cheaper (README)


def make_router(prefill: Sequence[str] = (), decode: Sequence[str] = (), *,
                policy: str = DEFAULT_POLICY, local_prefill_tokens: int = 0,
                threshold: int = 2, cooldown: float = 1.0) -> Router:
    """A router over the servers at these URLs (more may join from a registry).

    :param threshold: consecutive failures that eject a server.
    :param cooldown: seconds of the first ejection (doubling on each repeat).
    """
    traffic = TrafficPolicy(breakers=BreakerBoard(threshold=threshold,
                                                  base_cooldown=cooldown))
    fleet = Fleet(traffic=traffic, require_url=True)
    for role, urls in (("prefill", prefill), ("decode", decode)):
        for url in urls:
            fleet.add(url, role, url=url)
    # vLLM servers read prefixes from their own cache or the store, not from one
    # another's: the router must not count on reads from a busy holder
    return Router(fleet, policy, local_prefill_tokens=local_prefill_tokens,
                  peer_fetch=False)


def request_of(body: dict[str, Any], block_chars: int, tokenizer: Any = None) -> Request:
    """The scheduler's view of a request: prefix keys and its prompt's length in
    tokens (counted with the model's tokenizer when the router has it, else
    estimated from the characters)."""
    prompt = body.get("prompt", body.get("messages", ""))
    text = prompt if isinstance(prompt, str) else json.dumps(prompt, sort_keys=True)
    out = body.get("max_completion_tokens") or body.get("max_tokens") or 256
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        tokens = len(prompt)
    elif isinstance(prompt, str) and tokenizer is not None:
        # counted on a bounded head (a tokenizer keeps the GIL: a prompt of megabytes
        # would stop every other request of the router for seconds), the rest estimated
        try:
            tokens = len(tokenizer.encode(prompt[:TOKENIZE_CHARS]).ids)
        except Exception:  # noqa: BLE001 - text it cannot take (a lone surrogate): the
            tokens = min(len(prompt), TOKENIZE_CHARS) // CHARS_PER_TOKEN  # server says
        tokens += max(0, len(prompt) - TOKENIZE_CHARS) // CHARS_PER_TOKEN
    else:
        tokens = len(text) // CHARS_PER_TOKEN
    return Request(text_keys(text, block_chars), max(1, tokens),
                   int(out) if isinstance(out, int) and out > 0 else 256)


class Tokenizers:
    """The served model's tokenizer, per decode server: from ``--tokenizer`` or the
    model path its ``/v1/models`` names; a server without one is asked again a minute
    later (until then its requests take the sequential hand-off). Also the context
    length ``/v1/models`` names (:meth:`max_model_len`). A server started with an API key
    is asked with ``auth`` (the router's own ``--api-key``), else with the key of the
    request that needs the answer; a refused key is no answer (asked again)."""

    RETRY_S = 60.0

    def __init__(self, path: str | None = None, auth: str | None = None) -> None:
        self.path = path
        self.auth = auth
        self._by_path: dict[str, Any] = {}
        self._by_url: dict[str, tuple[float, Any]] = {}
        self._limits: dict[str, int] = {}
        self._lock = threading.Lock()

    def _load(self, path: str) -> Any:
        with self._lock:
            tok = self._by_path.get(path)
        if tok is None:  # loaded outside the lock (seconds, maybe)
            tok = load_tokenizer(path)
            with self._lock:
                tok = self._by_path.setdefault(path, tok)
        return tok

    def get(self, url: str, auth: str | None = None) -> Any:
        with self._lock:
            now = time.monotonic()
            known = self._by_url.get(url)
            if known is not None and (known[1] is not None or now < known[0]):
                return known[1]
            # asked by one request at a time; the others take the sequential hand-off
            # meanwhile rather than wait for a server that may be slow to answer
            self._by_url[url] = (now + self.RETRY_S, None)
        tok = None
        retry = self.RETRY_S
        try:
            model: Any = {}
            try:
                model = get_json(url, "/v1/models", 10.0, self.auth or auth)["data"][0]
                limit = model.get("max_model_len")
                if type(limit) is int and limit > 0:
                    with self._lock:
                        self._limits[url] = limit
            except Exception as exc:  # noqa: BLE001 - no limit known; a path may be given
                if isinstance(exc, KeyRefused):
                    retry = 0.0  # the next request's key may be the right one
                if not self.path:
                    raise
            tok = self._load(str(self.path or model["root"]))
        except Exception as exc:  # noqa: BLE001 - no tokenizer: sequential hand-off
            sys.stderr.write(f"pd_proxy: no tokenizer for {url} ({exc!r:.200}); "
                             "its requests take the sequential hand-off\n")
        with self._lock:
            self._by_url[url] = (time.monotonic() + retry, tok)
        return tok

    def max_model_len(self, url: str) -> int | None:
        """The server's context length, once :meth:`get` has asked it."""
        with self._lock:
            return self._limits.get(url)


def arguments(argv: list[str] | None, description: str) -> argparse.Namespace:
    """The proxy's command line."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--prefill", nargs="*", default=[], help="base URLs of prefill servers")
    ap.add_argument("--decode", nargs="*", default=[], help="base URLs of decode servers")
    ap.add_argument("--registry", help="find servers in this registry (tcp://HOST:PORT)")
    ap.add_argument("--policy", default=DEFAULT_POLICY,
                    help="round_robin, least_loaded, prefix_only or cache_aware (default)")
    ap.add_argument("--local-below", "--local-prefill-tokens", type=int,
                    default=LOCAL_BELOW,
                    dest="local_below", metavar="TOKENS",
                    help="send prompts of at most this many uncached tokens straight to "
                         "decode (policy cache_aware; see the README for the break-even)")
    ap.add_argument("--handoff", choices=("first", "sequential"), default="first",
                    help="first (default): prefill's first token goes to the client at "
                         "once and decode continues after it; sequential: decode "
                         "answers the whole request after prefill")
    ap.add_argument("--push", action="store_true",
                    help="prefill pushes the KV layer by layer into decode's staging "
                         "memory (default: decode reads it from prefill's blocks; see "
                         "the README for which is faster where)")
    ap.add_argument("--tokenizer", help="the served model's tokenizer (a path or hub "
                    "name; default: the model path decode's /v1/models names)")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per upstream call")
    ap.add_argument("--api-key", default=os.environ.get("VLLM_API_KEY"),
                    help="the servers' API key, for the router's own queries (the model's "
                         "name and context, decode's workers; default $VLLM_API_KEY, else "
                         "the key of the client's request); clients' requests carry "
                         "their own")
    args = ap.parse_args(argv)
    if not (args.prefill or args.decode or args.registry):
        ap.error("give --prefill/--decode URLs or --registry")
    return args
