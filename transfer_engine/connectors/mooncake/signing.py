"""Signatures of requests to our HTTP metadata server (``X-TE-Signature``): our HMAC frame
head (``control/auth.py``) over ``METHOD\\nKEY\\nsha256(body)``, made by the client and
checked by the server."""

from __future__ import annotations

import base64
import hashlib

from transfer_engine.control.auth import OVERHEAD, Signer
from transfer_engine.errors import AuthenticationError

__all__ = ["SIGNATURE_HEADER", "sign_request", "verify_request"]

SIGNATURE_HEADER = "X-TE-Signature"


def _canonical(method: str, key: str, body: bytes) -> bytes:
    return f"{method}\n{key}\n{hashlib.sha256(body).hexdigest()}".encode()


def sign_request(signer: Signer, method: str, key: str, body: bytes) -> str:
    """The ``X-TE-Signature`` value for a request."""
    frame = signer.sign(_canonical(method, key, body))
    return base64.b64encode(frame[:OVERHEAD]).decode()


def verify_request(signer: Signer, header: str | None, method: str, key: str,
                   body: bytes) -> None:
    """Raises ``AuthenticationError`` unless ``header`` signs this request."""
    if not header:
        raise AuthenticationError("request is not signed")
    try:
        head = base64.b64decode(header, validate=True)
    except ValueError:
        raise AuthenticationError("malformed signature") from None
    if len(head) != OVERHEAD:
        raise AuthenticationError("malformed signature")
    signer.verify(head + _canonical(method, key, body))

