"""The disaggregation proxy's calls to the prefill and decode servers: one JSON request
each, on a connection of its own, and the error that says a retry elsewhere is safe.
(A helper of ``scripts/pd_proxy.py``, imported from the scripts folder.)"""

from __future__ import annotations

import http.client
import json
import select
import socket
import sys
import threading
import time
import urllib.parse
from http.server import ThreadingHTTPServer
from typing import Any

from pd_proxy_handoff import ClientGone, client_gone

__all__ = ["BoundedServer", "DecodeWorkers", "KeyRefused", "UpstreamError", "post_json",
           "get_json", "json_headers"]


class UpstreamError(Exception):
    """An upstream call failed before anything reached the client: safe to retry."""


class KeyRefused(OSError):
    """A server refused the router's own query for its API key (401, 403): asked again
    with the next request's key rather than remembered as an answer."""


KEY_REFUSED = (401, 403)  # the statuses of a server that refused the API key


def post_json(base: str, path: str, body: dict[str, Any], timeout: float,
              client: socket.socket | None = None, auth: str | None = None
              ) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
    """POSTs ``body`` (with the client's ``Authorization`` value ``auth``, for servers
    started with an API key); the connection and the response, its status line read.
    With ``client``, the one waiting for this answer: :class:`ClientGone` once it has
    gone before the server answers (the request's connection closes: the server aborts
    it, as it aborts one whose client left)."""
    url = urllib.parse.urlsplit(base)
    conn = http.client.HTTPConnection(url.hostname or "127.0.0.1", url.port or 80,
                                      timeout=timeout)
    try:
        conn.request("POST", path, json.dumps(body).encode(), json_headers(auth))
        end = time.monotonic() + timeout
        while client is not None and (left := end - time.monotonic()) > 0:
            ready, _, _ = select.select([conn.sock, client], [], [], min(left, 1.0))
            if conn.sock in ready:
                break
            if client in ready:  # it sent more (a pipelined request) or it left
                if client_gone(client):
                    raise ClientGone("the client closed its connection")
                client = None
        return conn, conn.getresponse()
    except BaseException:
        conn.close()
        raise


def auth_headers(auth: str | None) -> dict[str, str]:
    """The ``Authorization`` header when there is a key to send, else none."""
    return {"Authorization": auth} if auth else {}


def json_headers(auth: str | None) -> dict[str, str]:
    """A JSON request's headers, with the client's ``Authorization`` when it gave one."""
    return {"Content-Type": "application/json", **auth_headers(auth)}


def get_json(base: str, path: str, timeout: float, auth: str | None = None) -> Any:
    url = urllib.parse.urlsplit(base)
    conn = http.client.HTTPConnection(url.hostname or "127.0.0.1", url.port or 80,
                                      timeout=timeout)
    try:
        conn.request("GET", path, headers=auth_headers(auth))
        resp = conn.getresponse()
        data = resp.read()
        if resp.status in KEY_REFUSED:
            raise KeyRefused(f"GET {path} answered {resp.status}")
        if resp.status != 200:
            raise OSError(f"GET {path} answered {resp.status}")
        return json.loads(data)
    finally:
        conn.close()


class DecodeWorkers:
    """Where each decode server's connector workers listen, asked of the server once
    (a one-token request whose kv_transfer_params ask for them, in the background;
    tried every second while the server does not answer, for ``wait_s``): prefill
    pushes a request's KV to them. Unknown until the answer is in, and for a server
    whose connector does not say (prefill then pushes nothing, decode reads). A server
    started with an API key is asked with ``auth`` (the router's own ``--api-key``),
    else with the key of the request that needs the answer."""

    RETRY_S = 30.0  # a server that did not say is asked again after this

    def __init__(self, timeout: float = 30.0, wait_s: float = 600.0,
                 auth: str | None = None) -> None:
        self._timeout = timeout
        self._wait_s = wait_s
        self._auth = auth
        self._known: dict[str, tuple[list[str], float]] = {}  # url -> (workers, when)
        self._asking: set[str] = set()
        self._lock = threading.Lock()

    def get(self, url: str, model: Any, auth: str | None = None) -> list[str] | None:
        with self._lock:
            known, when = self._known.get(url, (None, 0.0))
            if url in self._asking or known or (
                    known is not None and time.monotonic() - when < self.RETRY_S):
                return known or None
            self._asking.add(url)
        threading.Thread(target=self._ask, args=(url, model, self._auth or auth), daemon=True,
                         name="pd-proxy-probe").start()
        return None

    def forget(self, url: str) -> None:
        """Ask again at the next request (the server restarted, or a push failed)."""
        with self._lock:
            self._known.pop(url, None)

    def _ask(self, url: str, model: Any, auth: str | None) -> None:
        found: list[str] = []
        refused = False
        body = {"prompt": ".", "max_tokens": 1, "stream": False,
                "kv_transfer_params": {"te_probe": True}}
        if model is not None:
            body["model"] = model
        give_up = time.monotonic() + self._wait_s
        while True:
            try:
                conn, resp = post_json(url, "/v1/completions", body, self._timeout,
                                       auth=auth)
                refused = resp.status in KEY_REFUSED
                try:
                    answer = json.loads(resp.read()) if resp.status == 200 else None
                finally:
                    conn.close()
                if answer is not None:
                    listed = ((answer.get("kv_transfer_params") or {}).get("te_endpoints")
                              if isinstance(answer, dict) else None)
                    if isinstance(listed, list) and all(
                            isinstance(e, str) for e in listed):
                        found = listed
                    break
            except (OSError, http.client.HTTPException, ValueError):
                pass
            if time.monotonic() + 1.0 > give_up:
                break
            time.sleep(1.0)  # not up yet
        sys.stderr.write(f"pd_proxy: decode {url}: connector workers {found or 'unknown'}"
                         f"{'' if found else ' (prefill will not push to it)'}"
                         f"{' (refused the API key; asked again)' if refused else ''}\n")
        with self._lock:
            self._asking.discard(url)
            if not refused:
                self._known[url] = (found, time.monotonic())


class BoundedServer(ThreadingHTTPServer):
    """A thread per client connection, at most ``max_clients`` at once: a connection
    past that is closed at once, so idle or slow clients cannot take every thread."""

    daemon_threads = True
    max_clients = 1024
    request_queue_size = 1024  # listen backlog: a burst of clients must not be reset

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._slots = threading.BoundedSemaphore(self.max_clients)
        super().__init__(*args, **kwargs)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that went away (reset, timed out) is one line, not a traceback."""
        exc = sys.exc_info()[1]
        if isinstance(exc, ConnectionError | TimeoutError):
            sys.stderr.write(f"pd_proxy: client {client_address[0]}:{client_address[1]} "
                             f"went away: {exc!r:.100}\n")
            return
        super().handle_error(request, client_address)
