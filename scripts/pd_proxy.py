"""Disaggregation router: an OpenAI-style ``/v1/completions`` endpoint in front of any
number of prefill and decode vLLM servers joined by our connector.

For each request the scheduler (:mod:`scheduler.router`, policy ``--policy``) picks a
prefill server (the one caching the longest prefix of the prompt, weighed against its
queue) and a decode server (room for the KV, nearest to the prefill server). The proxy
asks the prefill server for one token with ``kv_transfer_params={"do_remote_decode":
true}``, passes the ``kv_transfer_params`` it answers to the decode server with the
original request, and relays the decode server's answer (streamed chunk by chunk when
``"stream": true``).

Servers come from the command line (``--prefill URL ... --decode URL ...``) and/or from
the registry (``--registry tcp://HOST:PORT``: members announced with
``python -m scheduler.announce``, joining and leaving while the proxy runs). A server
that refuses, fails, or dies before the decode answer starts is counted against its
circuit breaker (ejected after repeated failures, at most half of a pool at once) and
the request is retried on another one; once the answer has started streaming, a
failure ends that response.

Start the pair and the proxy (one host; add ``"host"`` in the extra config for others)::

    CFG='"kv_connector":"TransferEngineConnector","kv_connector_module_path":"transfer_engine.connectors.vllm","kv_load_failure_policy":"recompute"'
    VLLM_CPU_OMP_THREADS_BIND=0 vllm serve MODEL --port 8100 \\
        --kv-transfer-config "{$CFG,\\"kv_role\\":\\"kv_producer\\"}" &
    VLLM_CPU_OMP_THREADS_BIND=1 vllm serve MODEL --port 8200 \\
        --kv-transfer-config "{$CFG,\\"kv_role\\":\\"kv_consumer\\"}" &
    python3 scripts/pd_proxy.py --port 8000 --prefill http://127.0.0.1:8100 \\
        --decode http://127.0.0.1:8200      # more URLs after each flag, or --registry
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
import time
import urllib.parse
from collections.abc import Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from scheduler.errors import NoInstanceError  # noqa: E402
from scheduler.fleet import Fleet  # noqa: E402
from scheduler.policy import BreakerBoard, TrafficPolicy  # noqa: E402
from scheduler.prefix import text_keys  # noqa: E402
from scheduler.router import DEFAULT_POLICY, Decision, Request, Router  # noqa: E402
from transfer_engine.control.client import RegistryStore  # noqa: E402

MAX_BODY = 16 << 20
CHARS_PER_TOKEN = 4  # the proxy sees text, not tokens: a rough, model-free estimate


class UpstreamError(Exception):
    """An upstream call failed before anything reached the client: safe to retry."""


def _post(base: str, path: str, body: dict[str, Any], timeout: float
          ) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
    url = urllib.parse.urlsplit(base)
    conn = http.client.HTTPConnection(url.hostname or "127.0.0.1", url.port or 80,
                                      timeout=timeout)
    try:
        conn.request("POST", path, json.dumps(body).encode(),
                     {"Content-Type": "application/json"})
        return conn, conn.getresponse()
    except BaseException:
        conn.close()
        raise


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
    return Router(fleet, policy, local_prefill_tokens=local_prefill_tokens)


def _request_of(body: dict[str, Any], block_chars: int) -> Request:
    prompt = body.get("prompt", body.get("messages", ""))
    text = prompt if isinstance(prompt, str) else json.dumps(prompt, sort_keys=True)
    out = body.get("max_completion_tokens") or body.get("max_tokens") or 256
    return Request(text_keys(text, block_chars), max(1, len(text) // CHARS_PER_TOKEN),
                   int(out) if isinstance(out, int) and out > 0 else 256)


class Proxy(BaseHTTPRequestHandler):
    router: Router = make_router()
    timeout = 600.0
    connect_timeout = 10.0
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
        router = self.router
        fleet = router.fleet
        req = _request_of(request, router.cost.block_tokens * CHARS_PER_TOKEN)
        failed: set[str] = set()
        errors: list[str] = []
        attempts = 2 + len(fleet.prefill) + len(fleet.decode)
        for _ in range(attempts):
            try:
                decision = router.route(req, time.monotonic(), exclude=failed)
            except NoInstanceError as exc:
                errors.append(str(exc))
                break
            try:
                conn, resp = self._attempt(request, decision, failed, errors)
            except UpstreamError:
                continue
            if conn is None or resp is None:
                return  # answered (an upstream refusal the client must see)
            self._relay(decision, conn, resp)
            return
        code = 503 if not errors or "no live instance" in errors[-1] else 502
        self._error(code, "no server could take the request: " + "; ".join(errors[-4:]))

    def _fail(self, name: str, why: str, failed: set[str], errors: list[str]) -> None:
        with self.router.fleet.lock:
            self.router.fleet.traffic.breakers.record(name, False)
        failed.add(name)
        errors.append(f"{name}: {why}")

    def _ok(self, name: str) -> None:
        with self.router.fleet.lock:
            self.router.fleet.traffic.breakers.record(name, True)

    def _release(self, d: Decision, prefill_open: bool) -> None:
        fleet, now = self.router.fleet, time.monotonic()
        if prefill_open:
            fleet.prefill_done(d.prefill, d.decode, now)
        fleet.decode_done(d.decode, d.kv_tokens, now, local_prefill=d.local)

    def _attempt(self, request: dict[str, Any], d: Decision, failed: set[str],
                 errors: list[str]
                 ) -> tuple[http.client.HTTPConnection | None, http.client.HTTPResponse | None]:
        """Prefill (unless local) then start decode. Returns the decode connection and
        response with the status line read; ``(None, None)`` once a client error was
        answered. Raises :class:`UpstreamError` when a retry may help."""
        fleet = self.router.fleet
        dec_url = fleet.decode.urls[d.decode]
        decode_body = request
        if d.prefill is not None:
            name = fleet.prefill.names[d.prefill]
            pre = dict(request, max_tokens=1, stream=False,
                       kv_transfer_params={"do_remote_decode": True})
            pre.pop("max_completion_tokens", None)
            pre.pop("stream_options", None)
            try:
                conn, resp = _post(fleet.prefill.urls[d.prefill], self.path, pre,
                                   self.timeout)
                try:
                    raw = resp.read()
                finally:
                    conn.close()
            except (OSError, http.client.HTTPException) as exc:
                self._fail(name, f"prefill failed: {exc!r}", failed, errors)
                self._release(d, True)
                raise UpstreamError from exc
            fleet.prefill_done(d.prefill, d.decode, time.monotonic())
            try:
                answer = json.loads(raw)
            except ValueError:
                answer = raw[:200].decode("utf-8", "replace")
            if resp.status >= 500 or not isinstance(answer, dict):
                self._fail(name, f"prefill answered {resp.status}", failed, errors)
                self._release(d, False)
                raise UpstreamError
            if resp.status != 200:
                self._release(d, False)
                self._error(502, f"prefill server answered {resp.status}: {answer}")
                return None, None
            params = answer.get("kv_transfer_params")
            if not params:
                self._release(d, False)
                self._error(502, "prefill server returned no kv_transfer_params: is the "
                            "connector mounted with kv_role kv_producer?")
                return None, None
            self._ok(name)
            decode_body = dict(request, kv_transfer_params=params)
        name = fleet.decode.names[d.decode]
        try:
            conn, resp = _post(dec_url, self.path, decode_body, self.timeout)
        except (OSError, http.client.HTTPException) as exc:
            self._fail(name, f"decode failed: {exc!r}", failed, errors)
            self._release(d, False)
            raise UpstreamError from exc
        if resp.status >= 500:
            conn.close()
            self._fail(name, f"decode answered {resp.status}", failed, errors)
            self._release(d, False)
            raise UpstreamError
        return conn, resp

    def _relay(self, d: Decision, conn: http.client.HTTPConnection,
               resp: http.client.HTTPResponse) -> None:
        name = self.router.fleet.decode.names[d.decode]
        done = False
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
            done = True
        except (OSError, http.client.HTTPException):
            self.close_connection = True  # the client sees a cut-off response
        finally:
            conn.close()
            self._release(d, False)  # before the client can see the end
            if done:
                self._ok(name)
        if done:
            try:
                self.wfile.write(b"0\r\n\r\n")
            except OSError:
                self.close_connection = True

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
        sys.stderr.write(f"pd_proxy: {format % args}\n")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--prefill", nargs="*", default=[], help="base URLs of prefill servers")
    ap.add_argument("--decode", nargs="*", default=[], help="base URLs of decode servers")
    ap.add_argument("--registry", help="find servers in this registry (tcp://HOST:PORT)")
    ap.add_argument("--policy", default=DEFAULT_POLICY,
                    help="round_robin, least_loaded, prefix_only or cache_aware (default)")
    ap.add_argument("--local-prefill-tokens", type=int, default=0,
                    help="send prompts of at most this many tokens straight to decode")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per upstream call")
    args = ap.parse_args(argv)
    if not (args.prefill or args.decode or args.registry):
        ap.error("give --prefill/--decode URLs or --registry")
    Proxy.router = make_router(args.prefill, args.decode, policy=args.policy,
                               local_prefill_tokens=args.local_prefill_tokens)
    Proxy.timeout = args.timeout
    store = subscription = None
    try:
        if args.registry:
            store = RegistryStore(args.registry, timeout=5.0, name="pd_proxy")
            subscription = Proxy.router.fleet.watch(store)
        with ThreadingHTTPServer((args.host, args.port), Proxy) as server:
            fleet = Proxy.router.fleet
            print(f"pd_proxy on http://{args.host}:{server.server_port} policy "
                  f"{Proxy.router.policy}: prefill {fleet.prefill.names}, decode "
                  f"{fleet.decode.names}{' + registry ' + args.registry if store else ''}",
                  flush=True)
            try:
                server.serve_forever()
            except KeyboardInterrupt:
                pass
    finally:
        if subscription is not None:
            subscription.close()
        if store is not None:
            store.close()


if __name__ == "__main__":
    main()
