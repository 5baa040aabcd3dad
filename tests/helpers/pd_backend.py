"""A stand-in for a vLLM server behind the disaggregation proxy, in its own process:
the subset of the OpenAI completions API the proxy uses.

Usage: python -m tests.helpers.pd_backend ROLE NAME [REGISTRY] [DELAY_S]
Serves on a free loopback port; prefill answers one token and ``kv_transfer_params``
naming itself, decode streams three tokens that name the prefill it got the KV from.
With REGISTRY it announces itself there (``scheduler.announce``). Prints 'READY <url>'
when it serves, then counts requests on stdout ('SERVED <n>'). Exits when stdin closes.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from scheduler.announce import Announcement, http_record

ROLE, NAME = sys.argv[1], sys.argv[2]
REGISTRY = sys.argv[3] if len(sys.argv) > 3 and sys.argv[3] != "-" else None
DELAY = float(sys.argv[4]) if len(sys.argv) > 4 else 0.0
_count = [0]
_lock = threading.Lock()


class Backend(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_POST(self) -> None:  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        time.sleep(DELAY)
        with _lock:
            _count[0] += 1
            sys.stdout.write(f"SERVED {_count[0]}\n")
            sys.stdout.flush()
        if ROLE == "prefill":
            assert body["max_tokens"] == 1 and body["stream"] is False
            data = json.dumps({"choices": [{"text": "x"}],
                               "kv_transfer_params": {"prefill": NAME}}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
            return
        source = body.get("kv_transfer_params", {}).get("prefill", "none")
        chunks = [f"data: {json.dumps({'tok': i, 'from': source, 'by': NAME})}\n\n"
                  for i in range(3)] + ["data: [DONE]\n\n"]
        data = "".join(chunks).encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: Any) -> None:
        pass


def main() -> None:
    server = ThreadingHTTPServer(("127.0.0.1", 0), Backend)
    url = f"http://127.0.0.1:{server.server_port}"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    announced = None
    if REGISTRY:
        announced = Announcement(REGISTRY, http_record(NAME, ROLE, url, pod="pod-a",
                                                       zone="z1"), timeout=5.0)
    print(f"READY {url}", flush=True)
    sys.stdin.read()
    if announced is not None:
        announced.close()
    server.shutdown()
    server.server_close()


if __name__ == "__main__":
    main()
