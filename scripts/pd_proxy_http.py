"""The disaggregation proxy's HTTP front: a request's body read (with its length or in
chunks, bounded), the router's own errors in vLLM's shape, and every request the
router does not route itself (another path or method, a body that is not a JSON
object) passed to the first decode server, whose answer is the client's: so that the
proxy answers as one server does. (A helper of ``scripts/pd_proxy.py``, imported from
the scripts folder.)"""

from __future__ import annotations

import http.client
import json
import socket
import time
import urllib.parse
from collections.abc import Sequence
from http import HTTPStatus
from typing import Any

__all__ = ["MAX_BODY", "ROUTED", "BodyError", "error_body", "read_body", "pass_on", "linger",
           "refuse", "target"]

MAX_BODY = 16 << 20
ROUTED = ("/v1/completions", "/v1/chat/completions")  # what the router routes itself
LINGER_S = 2.0  # seconds an unread body is taken and dropped, so its sender sees the answer
_PASSED_HEADERS = ("Content-Type", "Accept", "Authorization")


INVALID = "Invalid HTTP request received."  # a server's words for broken framing


class BodyError(Exception):
    """A request's body that cannot be read: answered with ``status`` (broken framing
    in plain text, as a server words it), and the connection closes (what is left of
    the body is not a request)."""

    def __init__(self, status: int, message: str = INVALID) -> None:
        super().__init__(message)
        self.status = status


def refuse(handler: Any, exc: BodyError) -> None:
    """Answers a request whose body could not be read, then lingers (:func:`linger`)."""
    handler.close_connection = True
    if str(exc) == INVALID:
        data = INVALID.encode()
        handler.send_response(exc.status)
        handler.send_header("Content-Type", "text/plain; charset=utf-8")
        handler.send_header("Content-Length", str(len(data)))
        handler.send_header("Connection", "close")
        handler.end_headers()
        handler.wfile.write(data)
    else:
        handler._error(exc.status, str(exc))
    linger(handler)


def target(handler: Any) -> str:
    """The request's path as the client sent it (``http.server`` makes a leading ``//``
    one slash, which a server answers 404)."""
    parts = handler.requestline.split()
    return str(parts[1] if len(parts) == 3 else handler.path)


def error_body(code: int, message: str) -> bytes:
    """An error as vLLM's server words it (``{"error": {message, type, param, code}}``)."""
    try:
        kind = HTTPStatus(code).phrase.replace(" ", "") + "Error"
    except ValueError:
        kind = "Error"
    return json.dumps({"error": {"message": message, "type": kind, "param": None,
                                 "code": code}}).encode()


def read_body(handler: Any) -> bytes:
    """The request's whole body: ``Content-Length`` bytes, or its chunks with
    ``Transfer-Encoding: chunked``; at most :data:`MAX_BODY`, else :class:`BodyError`."""
    coding = (handler.headers.get("Transfer-Encoding") or "").lower()
    raw = handler.headers.get("Content-Length")
    if coding:  # with a length too, the two could frame it two ways (smuggling)
        if coding.strip() != "chunked" or raw is not None:
            raise BodyError(400)
        return _chunks(handler.rfile)
    if raw is not None and not raw.strip().isdigit():
        raise BodyError(400)
    length = int(raw) if raw is not None else 0
    if length > MAX_BODY:
        raise BodyError(413, f"a body of at most {MAX_BODY} bytes is taken, not {length}")
    data = handler.rfile.read(length)
    if len(data) < length:
        raise BodyError(400)
    return bytes(data)


def _chunks(rfile: Any) -> bytes:
    out = bytearray()
    while True:
        line = rfile.readline(1026)
        try:
            size = int(line.split(b";")[0].strip(), 16)
        except ValueError:
            raise BodyError(400) from None
        if size < 0 or len(out) + size > MAX_BODY:
            raise BodyError(413, f"a body of at most {MAX_BODY} bytes is taken")
        if size == 0:
            for _ in range(64):  # trailer fields, then the empty line
                if rfile.readline(8192) in (b"\r\n", b"\n", b""):
                    return bytes(out)
            raise BodyError(400)
        chunk = rfile.read(size)
        if len(chunk) < size or rfile.readline(3) not in (b"\r\n", b"\n"):
            raise BodyError(400)
        out += chunk


def linger(handler: Any) -> None:
    """After an answer to a request whose body was not read: stops sending, then takes
    and drops what the client still sends for up to :data:`LINGER_S` seconds, so that
    it reads the answer instead of a reset."""
    sock: socket.socket = handler.connection
    try:
        handler.wfile.flush()
        sock.shutdown(socket.SHUT_WR)
        end = time.monotonic() + LINGER_S
        while (left := end - time.monotonic()) > 0:
            sock.settimeout(left)
            if not sock.recv(1 << 16):
                break
    except OSError:
        pass
    handler.close_connection = True


def pass_on(handler: Any, method: str, body: bytes | None, urls: Sequence[str],
            timeout: float) -> None:
    """Asks the first decode server ``method`` on the request's path and query, with
    ``body`` and the request's content headers, and answers the client as it answered."""
    if not urls:
        handler._error(503, "no decode server is known")
        return
    url = urllib.parse.urlsplit(urls[0])
    conn = http.client.HTTPConnection(url.hostname or "127.0.0.1", url.port or 80,
                                      timeout=timeout)
    headers = {k: v for k in _PASSED_HEADERS if (v := handler.headers.get(k)) is not None}
    try:
        conn.request(method, handler.path, body, headers)
        resp = conn.getresponse()
        data = resp.read()
    except (OSError, http.client.HTTPException) as exc:
        handler._error(502, f"decode server unreachable: {exc!r:.200}")
        return
    finally:
        conn.close()
    handler.send_response(resp.status)
    for name in ("Content-Type", "Location", "Allow"):
        if (value := resp.getheader(name)) is not None:
            handler.send_header(name, value)
    handler.send_header("Content-Length", str(len(data)))
    if handler.close_connection:
        handler.send_header("Connection", "close")
    handler.end_headers()
    if method != "HEAD":
        handler.wfile.write(data)
