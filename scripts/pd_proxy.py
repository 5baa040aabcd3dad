"""Disaggregation proxy: an OpenAI-style ``/v1/completions`` endpoint in front of a
prefill vLLM server and a decode vLLM server joined by our connector.

For each request it asks the prefill server for one token with
``kv_transfer_params={"do_remote_decode": true}``, passes the ``kv_transfer_params`` the
prefill server answers to the decode server with the original request, and relays the
decode server's answer (streamed chunk by chunk when ``"stream": true``). Standard
library only.

Start the pair and the proxy (one host; add ``"host"`` in the extra config for others)::

    CFG='"kv_connector":"TransferEngineConnector","kv_connector_module_path":"transfer_engine.connectors.vllm","kv_load_failure_policy":"recompute"'
    VLLM_CPU_OMP_THREADS_BIND=0 vllm serve MODEL --port 8100 \\
        --kv-transfer-config "{$CFG,\\"kv_role\\":\\"kv_producer\\"}" &
    VLLM_CPU_OMP_THREADS_BIND=1 vllm serve MODEL --port 8200 \\
        --kv-transfer-config "{$CFG,\\"kv_role\\":\\"kv_consumer\\"}" &
    python3 scripts/pd_proxy.py --port 8000 --prefill http://127.0.0.1:8100 \\
        --decode http://127.0.0.1:8200
    curl -s localhost:8000/v1/completions -H 'content-type: application/json' \\
        -d '{"model": "MODEL", "prompt": "Hello", "max_tokens": 16, "stream": true}'

With vLLM's CPU build on one host, give each engine cores of its own
(``VLLM_CPU_OMP_THREADS_BIND``, e.g. ``0-7`` and ``8-15``): left to bind automatically,
both take the same cores, busy-poll there, and stall each other for seconds. That
build's ``vllm`` command fails looking up its own version; start the server as
``python -m vllm.entrypoints.openai.api_server --model MODEL ...`` instead.
"""

from __future__ import annotations

import argparse
import http.client
import json
import sys
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

MAX_BODY = 16 << 20


def _post(base: str, path: str, body: dict[str, Any], timeout: float
          ) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
    url = urllib.parse.urlsplit(base)
    conn = http.client.HTTPConnection(url.hostname or "127.0.0.1", url.port or 80,
                                      timeout=timeout)
    conn.request("POST", path, json.dumps(body).encode(),
                 {"Content-Type": "application/json"})
    return conn, conn.getresponse()


class Proxy(BaseHTTPRequestHandler):
    prefill = ""
    decode = ""
    timeout = 600.0
    protocol_version = "HTTP/1.1"

    def _error(self, code: int, message: str) -> None:
        data = json.dumps({"error": {"message": message, "code": code}}).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_POST(self) -> None:  # noqa: N802 - http.server's naming
        if self.path not in ("/v1/completions", "/v1/chat/completions"):
            self._error(404, f"unknown path {self.path}")
            return
        length = int(self.headers.get("Content-Length") or 0)
        if length <= 0 or length > MAX_BODY:
            self._error(400, "a JSON body of at most 16 MiB is required")
            return
        try:
            request = json.loads(self.rfile.read(length))
            if not isinstance(request, dict):
                raise ValueError("body is not an object")
        except ValueError as exc:
            self._error(400, f"bad JSON: {exc}")
            return
        pre = dict(request, max_tokens=1, stream=False,
                   kv_transfer_params={"do_remote_decode": True})
        pre.pop("max_completion_tokens", None)
        pre.pop("stream_options", None)
        try:
            conn, resp = _post(self.prefill, self.path, pre, self.timeout)
            try:
                answer = json.loads(resp.read())
            finally:
                conn.close()
            if resp.status != 200:
                self._error(502, f"prefill server answered {resp.status}: {answer}")
                return
            params = answer.get("kv_transfer_params")
            if not params:
                self._error(502, "prefill server returned no kv_transfer_params: is the "
                            "connector mounted with kv_role kv_producer?")
                return
            conn, resp = _post(self.decode, self.path,
                               dict(request, kv_transfer_params=params), self.timeout)
        except (OSError, ValueError, http.client.HTTPException) as exc:
            self._error(502, f"upstream failed: {exc}")
            return
        try:
            self.send_response(resp.status)
            self.send_header("Content-Type", resp.getheader("Content-Type",
                                                            "application/json"))
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            while True:
                chunk = resp.read1(65536)
                if not chunk:
                    break
                self.wfile.write(f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n")
                self.wfile.flush()
            self.wfile.write(b"0\r\n\r\n")
        finally:
            conn.close()

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
        sys.stderr.write(f"pd_proxy: {format % args}\n")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--prefill", required=True, help="base URL of the prefill server")
    ap.add_argument("--decode", required=True, help="base URL of the decode server")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per upstream call")
    args = ap.parse_args(argv)
    Proxy.prefill, Proxy.decode, Proxy.timeout = args.prefill, args.decode, args.timeout
    with ThreadingHTTPServer((args.host, args.port), Proxy) as server:
        print(f"pd_proxy on http://{args.host}:{server.server_port} -> prefill "
              f"{args.prefill}, decode {args.decode}", flush=True)
        try:
            server.serve_forever()
        except KeyboardInterrupt:
            pass


if __name__ == "__main__":
    main()
