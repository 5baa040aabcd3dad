"""The answering side of a signed request/reply: how a ROUTER socket answers a request.

Every ROUTER service of the project (:class:`~transfer_engine.control.service.Service`,
the membership :class:`~transfer_engine.control.registry.Registry`, the kvstore's
master) answers the same way, with these functions: a reply is sealed with the service's
signer (one that cannot be encoded, e.g. over its size limit, becomes an
:class:`ErrorReply` saying so); a request that failed authentication is answered
``Denied`` *unsigned*, since its sender may lack our secret; one that is malformed is
answered :class:`ErrorReply` with the reason; a message of several frames is answered
only when it names a sender to answer, so that the sender's next request pairs up. A
reply is sent without blocking: one to a peer that does not read (its queue is full) or
is gone is dropped, and the caller is told, so that a slow client never stalls a
service.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import zmq

from transfer_engine.control.auth import Signer, seal
from transfer_engine.control.messages import Denied, ErrorReply, Message
from transfer_engine.errors import AuthenticationError, TransferError

__all__ = ["SINGLE_FRAME", "seal_reply", "send_frame", "send_reply", "refusal", "refuse",
           "answer_multipart"]

SINGLE_FRAME = "expected a single-frame message"


def seal_reply(reply: Message | bytes, signer: Signer | None) -> bytes:
    """The frame of ``reply``: a message, or one already encoded (by
    :func:`~transfer_engine.control.messages.encode_packed`), signed when ``signer``."""
    if isinstance(reply, bytes):
        return signer.sign(reply) if signer is not None else reply
    try:
        return seal(reply, signer)
    except TransferError as exc:  # e.g. a reply over its size limit
        return seal(ErrorReply(f"cannot encode the reply: {exc}"[:2000]), signer)


def send_frame(sock: zmq.Socket[Any], ident: bytes, frame: bytes) -> bool:
    """Sends ``frame`` to ``ident`` without blocking; False when it was dropped (the
    peer's queue is full, or it is gone)."""
    try:
        sock.send_multipart([ident, frame], zmq.NOBLOCK)
    except zmq.ZMQError:
        return False
    return True


def send_reply(sock: zmq.Socket[Any], ident: bytes, reply: Message | bytes,
               signer: Signer | None) -> bool:
    """Seals ``reply`` and sends it to ``ident``; False when it was dropped."""
    return send_frame(sock, ident, seal_reply(reply, signer))


def refusal(exc: TransferError) -> tuple[Message, bool]:
    """The answer to a request that :func:`~transfer_engine.control.auth.open_request`
    refused, and whether it is signed: ``Denied`` (unsigned) for a failed
    authentication, an ``ErrorReply`` with the reason for anything else."""
    if isinstance(exc, AuthenticationError):
        return Denied(exc.message), False
    return ErrorReply(str(exc)), True


def refuse(sock: zmq.Socket[Any], ident: bytes, exc: TransferError,
           signer: Signer | None) -> bool:
    """Answers a refused request (see :func:`refusal`); False when it was dropped."""
    reply, signed = refusal(exc)
    return send_reply(sock, ident, reply, signer if signed else None)


def answer_multipart(sock: zmq.Socket[Any], frames: Sequence[bytes | zmq.Frame],
                     signer: Signer | None) -> bool:
    """Answers a message that is not ``[sender, request]`` when it names a sender (more
    than two frames): its sender's next request must pair with the next answer. False
    when that answer was dropped."""
    if len(frames) <= 2:
        return True
    first = frames[0]
    ident = first.bytes if isinstance(first, zmq.Frame) else first
    return send_reply(sock, ident, ErrorReply(SINGLE_FRAME), signer)
