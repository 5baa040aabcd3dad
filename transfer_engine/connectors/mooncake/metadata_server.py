"""Our HTTP metadata server, wire-compatible with Mooncake's
``mooncake_http_metadata_server`` (``te-mooncake metadata-server``): a key-value store
served from a thread, requests checked against the control secret when one is set."""

from __future__ import annotations

import argparse
import http.server
import logging
import signal
import socket
import threading
import urllib.parse
from collections.abc import Sequence
from typing import Any

from transfer_engine.control.auth import AuthConfig, check_exposure
from transfer_engine.errors import AuthenticationError

from .directory import log
from .signing import SIGNATURE_HEADER, verify_request

__all__ = ["MetadataServer", "main"]


class MetadataServer:
    """Mooncake's HTTP metadata protocol, served from a thread.

    :param host: address to serve; ``0.0.0.0``/``""`` without a secret serves loopback
        instead (with a warning), any other non-loopback address needs a secret or the
        insecure opt-in (``ValueError`` otherwise).
    :param port: TCP port; 0 picks a free one (see :attr:`port`).
    :param path: the URL path (Mooncake: ``/metadata``).
    :param auth: the control secret (default ``AuthConfig.from_env()``).
    :param insecure: serve a network address without a secret anyway.
    :param max_keys: keys held at most (``507`` beyond it).
    :param max_value: bytes per value at most (``413`` beyond it).
    :param max_connections: connections served at once (``503`` beyond it).
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 8080, *, path: str = "/metadata",
                 auth: AuthConfig | str | bytes | None = None, insecure: bool | None = None,
                 max_keys: int = 100_000, max_value: int = 4 << 20,
                 max_connections: int = 256) -> None:
        if not isinstance(auth, AuthConfig):
            auth = AuthConfig(secret=auth) if auth is not None else AuthConfig.from_env()
        self._signer = auth.signer()
        if host in ("", "0.0.0.0", "::") and self._signer is None:
            log.warning("metadata server: no control secret, serving 127.0.0.1 instead of "
                        "%r (set TE_CONTROL_SECRET to serve the network)", host or "*")
            host = "127.0.0.1"
        check_exposure(host, self._signer is not None, insecure, what="metadata server")
        self.path = path
        self.max_keys, self.max_value = max_keys, max_value
        self._store: dict[str, bytes] = {}
        self._lock = threading.Lock()
        self._slots = threading.BoundedSemaphore(max_connections)
        handler = _handler_for(self)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        server_cls = type("_Server", (http.server.ThreadingHTTPServer,),
                          {"address_family": family, "daemon_threads": True})
        self._httpd = server_cls((host, port), handler)
        self.host = host
        self.port = int(self._httpd.server_address[1])
        self._thread = threading.Thread(target=self._httpd.serve_forever,
                                        kwargs={"poll_interval": 0.1}, daemon=True,
                                        name=f"te-mc-metadata-{self.port}")
        self._thread.start()
        self._closed = False

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}{self.path}"

    def keys(self) -> list[str]:
        with self._lock:
            return sorted(self._store)

    # one method per verb, called by the handler; each returns (status, body)

    def get(self, key: str) -> tuple[int, bytes]:
        with self._lock:
            value = self._store.get(key)
        return (200, value) if value is not None else (404, b"metadata not found")

    def put(self, key: str, value: bytes) -> tuple[int, bytes]:
        with self._lock:
            if "rpc_meta" in key and key in self._store:
                return 400, b"Duplicate rpc_meta key not allowed"
            if key not in self._store and len(self._store) >= self.max_keys:
                return 507, b"metadata server full"
            self._store[key] = value
        return 200, b"metadata updated"

    def delete(self, key: str) -> tuple[int, bytes]:
        with self._lock:
            if self._store.pop(key, None) is None:
                return 404, b"metadata not found"
        return 200, b"metadata deleted"

    def close(self) -> None:
        """Stops serving and joins the thread. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(5)

    def __enter__(self) -> MetadataServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "CLOSED" if self._closed else "SERVING"
        return f"<MetadataServer {self.url} keys={len(self._store)} {state}>"


def _handler_for(server: MetadataServer) -> type[http.server.BaseHTTPRequestHandler]:
    class Handler(http.server.BaseHTTPRequestHandler):
        timeout = 10  # seconds a connection may stall
        disable_nagle_algorithm = True  # headers and body go out as two writes
        protocol_version = "HTTP/1.1"
        server_version = "te-metadata"

        def _serve(self, method: str) -> None:
            if not server._slots.acquire(blocking=False):
                self._reply(503, b"too many connections")
                return
            try:
                self._dispatch(method)
            finally:
                server._slots.release()

        def _dispatch(self, method: str) -> None:
            url = urllib.parse.urlsplit(self.path)
            if url.path != server.path:
                self._reply(404, b"not found")
                return
            try:  # the key exactly as sent: distinct bytes are distinct keys
                key = urllib.parse.parse_qs(url.query, errors="strict").get("key", [""])[0]
            except UnicodeDecodeError:
                self._reply(400, b"metadata key must be UTF-8")
                return
            if self.headers.get("Transfer-Encoding"):
                self.close_connection = True  # the body's bytes are not read
                self._reply(411, b"a body needs Content-Length")
                return
            try:
                length = int(self.headers.get("Content-Length") or 0)
            except ValueError:
                length = -1
            if length < 0 or length > server.max_value:
                self.close_connection = True
                self._reply(413, b"value too large")
                return
            body = self.rfile.read(length) if length else b""
            if len(body) != length:  # the client went away mid-body: store nothing
                self.close_connection = True
                self._reply(400, b"body shorter than Content-Length")
                return
            if not key:
                self._reply(400, b"metadata key is required")
                return
            if server._signer is not None:
                try:
                    verify_request(server._signer, self.headers.get(SIGNATURE_HEADER),
                                   method, key, body)
                except AuthenticationError as exc:
                    log.warning("metadata server: refused %s %s from %s: %s", method, key,
                                self.client_address[0], exc)
                    self._reply(401, b"unauthenticated")
                    return
            if method == "GET":
                status, out = server.get(key)
            elif method == "PUT":
                status, out = server.put(key, body)
            elif method == "DELETE":
                status, out = server.delete(key)
            else:
                status, out = 405, b"Method not allowed"
            self._reply(status, out)

        def _reply(self, status: int, body: bytes) -> None:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:  # noqa: N802 (http.server's names)
            self._serve("GET")

        def do_PUT(self) -> None:  # noqa: N802
            self._serve("PUT")

        def do_DELETE(self) -> None:  # noqa: N802
            self._serve("DELETE")

        def do_POST(self) -> None:  # noqa: N802
            self._serve("POST")

        def log_message(self, format: str, *args: Any) -> None:
            log.debug("metadata server: " + format, *args)

    return Handler


def main(argv: Sequence[str] | None = None) -> int:
    """``te-mooncake metadata-server``: Mooncake's ``mooncake_http_metadata_server``
    flags (``--port``, ``--host``, ``--log-level``); runs until SIGINT/SIGTERM."""
    parser = argparse.ArgumentParser(
        prog="te-mooncake metadata-server",
        description="HTTP metadata server speaking Mooncake's protocol")
    parser.add_argument("--port", type=int, default=8080)
    parser.add_argument("--host", default="0.0.0.0",
                        help="without TE_CONTROL_SECRET a wildcard serves loopback only")
    parser.add_argument("--path", default="/metadata")
    parser.add_argument("--insecure", action="store_true", default=None,
                        help="serve a network address without a control secret")
    parser.add_argument("--log-level", default="INFO",
                        choices=["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"])
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        server = MetadataServer(args.host, args.port, path=args.path, insecure=args.insecure)
    except (ValueError, OSError) as exc:
        print(f"te-mooncake metadata-server: {exc}", flush=True)
        return 1
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    print(f"metadata server at {server.url}", flush=True)
    stop.wait()
    server.close()
    return 0
