"""The disaggregation proxy's calls to the prefill and decode servers: one JSON request
each, on a connection of its own, and the error that says a retry elsewhere is safe.
(A helper of ``scripts/pd_proxy.py``, imported from the scripts folder.)"""

from __future__ import annotations

import http.client
import json
import urllib.parse
from typing import Any

__all__ = ["UpstreamError", "post_json", "get_json"]


class UpstreamError(Exception):
    """An upstream call failed before anything reached the client: safe to retry."""


def post_json(base: str, path: str, body: dict[str, Any], timeout: float
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


def get_json(base: str, path: str, timeout: float) -> Any:
    url = urllib.parse.urlsplit(base)
    conn = http.client.HTTPConnection(url.hostname or "127.0.0.1", url.port or 80,
                                      timeout=timeout)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        data = resp.read()
        if resp.status != 200:
            raise OSError(f"GET {path} answered {resp.status}")
        return json.loads(data)
    finally:
        conn.close()
