"""Stand-in prefill and decode servers speaking vLLM's completions API with token ids,
and a router (``scripts/pd_proxy.py``, first-token hand-off) in front of them: the
router's tests drive the hand-off without a vLLM server."""

from __future__ import annotations

import contextlib
import http.client
import json
import socket
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
import pd_proxy  # noqa: E402

SEEN: list[tuple[str, dict[str, Any]]] = []  # (role, request body) as the servers got them


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 1024  # as a real server's: a burst of connections waits


def serve(handler: type[BaseHTTPRequestHandler]) -> tuple[ThreadingHTTPServer, threading.Thread]:
    """``handler`` served on a loopback port (the router's own server class for the
    router), in a thread."""
    server_class = pd_proxy.BoundedServer if issubclass(handler, pd_proxy.Proxy) else _Server
    server = server_class(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    return server, thread


def post(port: int, body: dict[str, Any], timeout: float = 10.0,
         path: str = "/v1/completions") -> tuple[int, str]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("POST", path, json.dumps(body).encode(),
                     {"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, resp.read().decode()
    finally:
        conn.close()


def exchange(port: int, data: bytes, timeout: float = 10.0) -> bytes:
    """Sends ``data`` (raw HTTP, as a hand-written client would) and returns all the
    router sends back until it closes the connection."""
    got = b""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(data)
        while chunk := s.recv(65536):
            got += chunk
    return got


def byte_tokenizer() -> Any:
    """A byte-level BPE tokenizer, built offline: multi-byte characters split over
    several tokens."""
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import decoders, models, pre_tokenizers, trainers  # noqa: PLC0415

    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(["the cache block of the engine"] * 10, trainer)
    return tok


def parsed(handler: BaseHTTPRequestHandler) -> Any:
    """A stand-in server's reading of a request: its JSON body, or None once it
    answered as vLLM's server does (404 for a path it does not serve, 400 for a body
    that is not a JSON object)."""
    data = handler.rfile.read(int(handler.headers.get("Content-Length") or 0))
    path = handler.requestline.split()[1].split("?", 1)[0]  # "//" kept, as uvicorn does
    json_type = (handler.headers.get("Content-Type") or "").startswith("application/json")
    try:
        body = json.loads(data) if json_type and path in ("/v1/completions",
                                                          "/v1/chat/completions") else None
    except (ValueError, RecursionError):
        body = None
    if isinstance(body, dict):
        return body
    status, answer = (400, b'{"detail":"There was an error parsing the body"}') \
        if path.startswith("/v1/c") else (404, b'{"detail":"Not Found"}')
    handler.send_response(status)
    handler.send_header("Content-Type", "application/json")
    handler.send_header("Content-Length", str(len(answer)))
    handler.end_headers()
    handler.wfile.write(answer)
    return None


class Scripted(BaseHTTPRequestHandler):
    """Prefill and decode speaking vLLM's token-id fields, generating ``gen``: prefill
    its first token, decode the rest after the prompt plus that token."""

    role = ""
    tok: Any = None
    gen: list[int] = []
    eos = 2
    refuse: dict[str, tuple[int, dict[str, Any]]] = {}  # role -> (status, error answer)
    delay = 0.0  # seconds each answer waits first (a prefill that computes)

    def do_POST(self) -> None:  # noqa: N802
        body = parsed(self)
        if body is None:
            return
        SEEN.append((self.role, body))
        time.sleep(self.delay)
        if self.role in self.refuse:  # the request's own error, as vLLM answers it
            status, error = self.refuse[self.role]
            data = json.dumps(error).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
            return
        if self.role == "prefill":
            chat = "messages" in body  # the last message's content is the prompt
            prompt = self.tok.encode(body["messages"][-1]["content"] if chat
                                     else body["prompt"]).ids
            t = self.gen[0]
            c = {"index": 0, "text": "?", "finish_reason": "stop" if t == self.eos
                 else "length", "stop_reason": None, "prompt_token_ids": prompt,
                 "token_ids": [t]}
            held = body.get("kv_transfer_params") and t != self.eos
            answer = {"id": "cmpl-1", "created": 1, "model": "m", "choices": [c],
                      "usage": {}, "kv_transfer_params": {"p": 1} if held else None}
            if chat:
                c["message"] = {"role": "assistant", "content": c.pop("text")}
                answer["prompt_token_ids"] = c.pop("prompt_token_ids")
            data = json.dumps(answer).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
            return
        rest = self.gen[1:1 + (body.get("max_tokens") or 99)]
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for i, t in enumerate(rest):
            last = i == len(rest) - 1
            fin = "stop" if t == self.eos else ("length" if last else None)
            chunk = {"choices": [{"index": 0, "text": "?", "token_ids": [t],
                                  "finish_reason": fin, "stop_reason": None}]}
            self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
            self.wfile.flush()
            if fin:
                break
        self.wfile.write(b"data: [DONE]\n\n")

    def log_message(self, *args: Any) -> None:
        pass


@contextlib.contextmanager
def scripted_proxy(tok: Any, gen: list[int], max_model_len: int | None = None,
                   refuse: dict[str, tuple[int, dict[str, Any]]] | None = None
                   ) -> Iterator[int]:
    """A router (first-token hand-off) in front of scripted prefill and decode servers
    generating ``gen`` (or refusing, per role, as ``refuse`` says), decode's tokenizer
    ``tok`` and context length known without asking it; its port."""
    pre, dec = (type(role.title(), (Scripted,), {"role": role, "tok": tok, "gen": gen,
                                                  "refuse": refuse or {}})
                for role in ("prefill", "decode"))
    servers = [serve(pre), serve(dec)]
    urls = [f"http://127.0.0.1:{s.server_port}" for s, _ in servers]
    pd_proxy.Proxy.router = pd_proxy.make_router([urls[0]], [urls[1]])
    pd_proxy.Proxy.handoff = "first"

    class Known(pd_proxy.Tokenizers):
        def get(self, url: str, auth: str | None = None) -> Any:
            return tok if url == urls[1] else super().get(url)

        def max_model_len(self, url: str) -> int | None:
            return max_model_len if url == urls[1] else None

    pd_proxy.Proxy.tokenizers = Known()
    pd_proxy.Proxy.log_message = lambda *a: None  # type: ignore[method-assign]
    servers.append(serve(pd_proxy.Proxy))
    try:
        yield servers[2][0].server_port
    finally:
        pd_proxy.Proxy.tokenizers = pd_proxy.Tokenizers()
        for server, thread in servers:
            server.shutdown()
            server.server_close()
            thread.join(5)
