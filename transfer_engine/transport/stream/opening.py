"""Opening a stream rail: the initiator answers the target's challenge with its ticket
(:mod:`~transfer_engine.control.tickets`) and checks the target's proof."""

from __future__ import annotations

import os
import socket

import msgpack
import numpy as np

from transfer_engine.control.tickets import CHALLENGE_BYTES, CHALLENGE_MAGIC, Credential
from transfer_engine.errors import AuthenticationError, ProtocolError
from transfer_engine.transport.stream.io import recv_exact, send_bytes
from transfer_engine.transport.stream.wire import (
    ANSWER,
    KIND_ANSWER,
    KIND_HELLO,
    MAX_BODY,
    WIRE_VERSION,
    encode_announce,
    encode_request,
    unpack_error,
)

__all__ = ["open_rail"]


def open_rail(sock: socket.socket, credential: Credential | None, transport: str,
              timeout: float | None, ranges: np.ndarray | None = None) -> None:
    """Opens a rail: answers the target's challenge with our ticket, checks the target's
    proof and, for shm, announces our segments' ``ranges`` (ANNOUNCE rows). Raises
    :class:`AuthenticationError` or :class:`PeerClosed`/``OSError``."""
    if credential is None:
        raise AuthenticationError("no rail ticket: connect through the engine's handshake",
                                  transport=transport, op="connect")
    sock.settimeout(timeout)
    try:
        challenge = recv_exact(sock, CHALLENGE_BYTES)
        if not challenge.startswith(CHALLENGE_MAGIC):
            raise ProtocolError("the target does not speak rail version "
                                f"{WIRE_VERSION}", transport=transport, op="connect")
        nonce, proof = credential.opening(transport, challenge)
        body = msgpack.packb({"version": WIRE_VERSION, "ticket": credential.ticket,
                              "nonce": nonce, "proof": proof, "pid": os.getpid()})
        send_bytes(sock, encode_request(KIND_HELLO, None, body))
        kind, status, _, body_len, _ = ANSWER.unpack(recv_exact(sock, ANSWER.size))
        if body_len > MAX_BODY:
            raise ProtocolError("malformed answer to the rail's hello", transport=transport,
                                op="connect")
        answer = recv_exact(sock, body_len)
        if kind != KIND_ANSWER or status:
            raise unpack_error(answer, status or 2, "?", "connect", transport)
        credential.check_answer(transport, challenge, nonce, answer)
        if ranges is not None:
            send_bytes(sock, encode_announce(ranges))
    finally:
        sock.settimeout(None)
