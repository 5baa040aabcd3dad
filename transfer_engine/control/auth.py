"""Authentication of control messages: HMAC-SHA256 with a shared secret.

A signed frame is ``MAGIC | timestamp (f64, wall clock) | nonce (16 B) | mac (32 B) |
message`` where ``mac = HMAC-SHA256(secret, MAGIC | timestamp | nonce | message)``. A
receiver accepts a frame only if the mac matches (constant-time compare), the timestamp
is within ``window`` seconds of its own wall clock, and the nonce was not seen within the
window (replay protection; the nonce cache is bounded by the window and ``max_nonces``).

Why HMAC and not ZeroMQ CURVE: it does not depend on libzmq being built with libsodium,
it authenticates each message (so a restarted registry or a reconnecting DEALER needs no
new key exchange), and one shared secret is what operators of a single fleet already
distribute. It does not encrypt: metadata (endpoints, segment sizes) is visible on the
wire, while data-plane bytes never pass here. CURVE can be layered under it on the same
sockets later (``zmq.has("curve")``) if confidentiality is needed.

Configuration: ``AuthConfig(secret=...)``, or ``AuthConfig.from_env()`` which reads
``TE_CONTROL_SECRET`` (the secret itself) or ``TE_CONTROL_SECRET_FILE`` (a file holding
it). No secret: frames are sent and accepted unsigned (the default, for a trusted
network); a receiver with a secret refuses unsigned frames.
"""

from __future__ import annotations

import collections
import hashlib
import hmac
import ipaddress
import logging
import os
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from transfer_engine.control.messages import (
    MAX_MESSAGE_BYTES,
    Denied,
    Message,
    decode,
    encode,
)
from transfer_engine.errors import AuthenticationError

__all__ = ["AuthConfig", "Signer", "MAGIC", "OVERHEAD", "seal", "open_request",
           "open_reply", "check_exposure", "is_loopback", "insecure_allowed", "INSECURE_ENV"]

log = logging.getLogger(__name__)

MAGIC = b"TEA1"
_HEAD = struct.Struct("!4sd16s32s")
OVERHEAD = _HEAD.size  # bytes a signature adds to a message


@dataclass(frozen=True)
class AuthConfig:
    """How control messages are authenticated.

    :param secret: shared secret (at least 16 bytes; ``str`` is UTF-8 encoded); ``None``
        disables signing.
    :param window: seconds a signed message stays valid; bounds clock skew between
        hosts and how long nonces are remembered.
    :param max_nonces: nonces remembered at most; beyond it messages are refused (a
        flood of valid-looking messages cannot grow memory).
    """

    secret: bytes | str | None = None
    window: float = 30.0
    max_nonces: int = 200_000

    def __post_init__(self) -> None:
        if self.secret is not None and len(self.key) < 16:
            raise ValueError("a control secret needs at least 16 bytes")
        if self.window <= 0 or self.max_nonces <= 0:
            raise ValueError("window and max_nonces must be positive")

    @property
    def key(self) -> bytes:
        s = self.secret
        return s.encode() if isinstance(s, str) else (s or b"")

    @classmethod
    def from_env(cls) -> AuthConfig:
        secret = os.environ.get("TE_CONTROL_SECRET")
        path = os.environ.get("TE_CONTROL_SECRET_FILE")
        if secret is None and path:
            with open(path, "rb") as f:
                secret = f.read().strip().decode()
        return cls(secret=secret or None)

    def signer(self, clock: Callable[[], float] = time.time) -> Signer | None:
        return Signer(self, clock) if self.secret is not None else None


class Signer:
    """Signs outgoing frames and checks incoming ones. Thread-safe."""

    def __init__(self, config: AuthConfig, clock: Callable[[], float] = time.time) -> None:
        self._key = config.key
        self._window = config.window
        self._max = config.max_nonces
        self._clock = clock
        self._seen: collections.OrderedDict[bytes, float] = collections.OrderedDict()
        self._lock = threading.Lock()

    @property
    def nonces_held(self) -> int:
        """Nonces remembered against replays: those seen within the window (at most
        ``max_nonces``; beyond it messages are refused)."""
        return len(self._seen)

    def sign(self, data: bytes) -> bytes:
        ts = self._clock()
        nonce = os.urandom(16)
        mac = hmac.digest(self._key, MAGIC + struct.pack("!d", ts) + nonce + data,
                          hashlib.sha256)
        return _HEAD.pack(MAGIC, ts, nonce, mac) + data

    def verify(self, frame: bytes) -> bytes:
        """Returns the message inside ``frame``; raises ``AuthenticationError``."""
        if len(frame) < OVERHEAD or frame[:4] != MAGIC:
            raise AuthenticationError("message is not signed")
        if len(frame) - OVERHEAD > MAX_MESSAGE_BYTES:  # refused before the costly MAC
            raise AuthenticationError(f"message of {len(frame) - OVERHEAD} bytes exceeds "
                                      f"the limit of {MAX_MESSAGE_BYTES}")
        magic, ts, nonce, mac = _HEAD.unpack_from(frame)
        data = frame[OVERHEAD:]
        expect = hmac.digest(self._key, frame[:4 + 8 + 16] + data, hashlib.sha256)
        if not hmac.compare_digest(mac, expect):
            raise AuthenticationError("bad signature (wrong secret?)")
        now = self._clock()
        if not abs(now - ts) <= self._window:  # also refuses NaN
            raise AuthenticationError(f"stale or future timestamp ({now - ts:+.1f}s; "
                                      f"window {self._window}s; clocks in sync?)")
        with self._lock:
            while self._seen:
                oldest, expiry = next(iter(self._seen.items()))
                if expiry > now:
                    break
                del self._seen[oldest]
            if nonce in self._seen:
                raise AuthenticationError("replayed message")
            if len(self._seen) >= self._max:
                raise AuthenticationError("too many messages in the replay window")
            # remembered as long as its timestamp is valid: a sender whose clock runs
            # ahead of ours stamps messages that stay valid past now + window
            self._seen[nonce] = max(now, ts) + self._window
        return data


def seal(msg: Message, signer: Signer | None) -> bytes:
    """Encodes ``msg`` and signs it when a secret is configured."""
    data = encode(msg)
    return signer.sign(data) if signer is not None else data


def open_request(frame: bytes, signer: Signer | None, peer: str | None = None) -> Message:
    """Server side: checks and decodes one incoming frame. Raises
    ``AuthenticationError`` (answer with :class:`Denied`) or ``ProtocolError``."""
    if signer is not None:
        try:
            frame = signer.verify(frame)
        except AuthenticationError as exc:
            raise exc.with_context(peer=peer) from None
    elif frame[:4] == MAGIC:
        raise AuthenticationError("message is signed but no control secret is configured "
                                  "here", peer=peer)
    return decode(frame, peer=peer)


def open_reply(frame: bytes, signer: Signer | None, peer: str | None = None,
               op: str | None = None) -> Message:
    """Client side: checks and decodes a reply; a :class:`Denied` answer, or an unsigned
    reply while we sign, raises ``AuthenticationError`` with the server's reason."""
    if frame[:4] == MAGIC:
        if signer is None:
            raise AuthenticationError("the peer signs its messages: configure the shared "
                                      "control secret", peer=peer, op=op)
        try:
            frame = signer.verify(frame)
        except AuthenticationError as exc:
            raise exc.with_context(peer=peer, op=op) from None
        msg = decode(frame, peer=peer)
    else:
        msg = decode(frame, peer=peer)
        if signer is not None and not isinstance(msg, Denied):
            raise AuthenticationError("reply is not signed: the peer runs without a "
                                      "control secret", peer=peer, op=op)
    if isinstance(msg, Denied):
        raise AuthenticationError(f"refused by the peer: {msg.reason}", peer=peer, op=op)
    return msg


INSECURE_ENV = "TE_ALLOW_INSECURE"


def insecure_allowed(explicit: bool | None = None) -> bool:
    """The opt-in to serve a network without a control secret: ``explicit`` when given,
    else ``$TE_ALLOW_INSECURE`` (``1``/``true``/``yes``/``on``)."""
    if explicit is not None:
        return explicit
    return os.environ.get(INSECURE_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address, a name, or a ZeroMQ endpoint) is reachable only
    from this host: every address a name stands for must be a loopback one, and a name
    that does not resolve, or a wildcard, counts as reachable from the network."""
    scheme, sep, rest = host.partition("://")
    if sep:
        if scheme in ("ipc", "inproc"):
            return True
        host = rest.rsplit(":", 1)[0] if ":" in rest else rest
    host = host.strip("[]").split("%")[0]
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    if not host or host == "*":
        return False
    try:
        infos = socket.getaddrinfo(host, None)
    except (OSError, UnicodeError):
        return False
    return bool(infos) and all(ipaddress.ip_address(str(i[4][0]).split("%")[0]).is_loopback
                               for i in infos)


def check_exposure(host: str, signed: bool, insecure: bool | None, what: str) -> None:
    """Refuses to serve a non-loopback ``host`` without a control secret unless the
    operator opted in (``insecure=True`` or ``$TE_ALLOW_INSECURE=1``), which is logged.

    Raises ``ValueError`` naming the ways out.
    """
    if signed or is_loopback(host):
        return
    if not insecure_allowed(insecure):
        raise ValueError(
            f"{what} would serve {host!r} without a control secret: anyone who reaches it "
            "could act as a peer. Set TE_CONTROL_SECRET (or TE_CONTROL_SECRET_FILE, or "
            f"auth=...) everywhere, serve a loopback address, or opt in with insecure=True "
            f"/ --insecure / {INSECURE_ENV}=1")
    log.warning("%s serves %s WITHOUT a control secret (insecure opt-in): any host that "
                "reaches it can act as a peer", what, host)
