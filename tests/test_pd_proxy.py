"""The disaggregation proxy against two stand-in servers speaking vLLM's completions
API: prefill gets max_tokens=1 and do_remote_decode, decode gets the prefill's
kv_transfer_params, and decode's streamed answer comes back chunk by chunk."""

from __future__ import annotations

import http.client
import json
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
import pd_proxy  # noqa: E402

SEEN: list[tuple[str, dict[str, Any]]] = []


class Upstream(BaseHTTPRequestHandler):
    role = ""

    def do_POST(self) -> None:  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        SEEN.append((self.role, body))
        if self.role == "prefill":
            data = json.dumps({"choices": [{"text": "x"}],
                               "kv_transfer_params": {"remote_block_ids": [1, 2]}}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for i in range(3):
            self.wfile.write(f"data: {{\"tok\": {i}}}\n\n".encode())
            self.wfile.flush()
        self.wfile.write(b"data: [DONE]\n\n")

    def log_message(self, *args: Any) -> None:
        pass


def _serve(handler: type[BaseHTTPRequestHandler]) -> tuple[ThreadingHTTPServer, threading.Thread]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    return server, thread


@pytest.fixture
def proxy() -> Iterator[int]:
    pre = type("Pre", (Upstream,), {"role": "prefill"})
    dec = type("Dec", (Upstream,), {"role": "decode"})
    servers = [_serve(pre), _serve(dec)]
    pd_proxy.Proxy.prefill = f"http://127.0.0.1:{servers[0][0].server_port}"
    pd_proxy.Proxy.decode = f"http://127.0.0.1:{servers[1][0].server_port}"
    pd_proxy.Proxy.log_message = lambda *a: None  # type: ignore[method-assign]
    servers.append(_serve(pd_proxy.Proxy))
    yield servers[2][0].server_port
    for server, thread in servers:
        server.shutdown()
        server.server_close()
        thread.join(5)


def test_proxy_prefills_then_streams_decode(proxy: int) -> None:
    SEEN.clear()
    conn = http.client.HTTPConnection("127.0.0.1", proxy, timeout=10)
    conn.request("POST", "/v1/completions", json.dumps(
        {"model": "m", "prompt": "hi", "max_tokens": 16, "stream": True}).encode(),
        {"Content-Type": "application/json"})
    resp = conn.getresponse()
    body = resp.read().decode()
    conn.close()
    assert resp.status == 200 and body.count("data:") == 4 and body.endswith("[DONE]\n\n")
    (r1, pre), (r2, dec) = SEEN
    assert r1 == "prefill" and pre["max_tokens"] == 1 and pre["stream"] is False
    assert pre["kv_transfer_params"] == {"do_remote_decode": True}
    assert r2 == "decode" and dec["max_tokens"] == 16 and dec["stream"] is True
    assert dec["kv_transfer_params"] == {"remote_block_ids": [1, 2]}


def test_proxy_rejects_bad_requests(proxy: int) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", proxy, timeout=10)
    conn.request("POST", "/v1/completions", b"{not json", {"Content-Type": "x"})
    resp = conn.getresponse()
    assert resp.status == 400 and b"bad JSON" in resp.read()
    conn.close()
