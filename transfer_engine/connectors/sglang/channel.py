"""The SGLang backend's links to its peers' side channels.

The bootstrap server and every rank's side channel are one
:class:`~transfer_engine.control.service.Service` each (typed messages from
:mod:`.messages`, signed like the engine's control plane); :class:`Links` sends to the
peers' side channels without waiting.
"""

from __future__ import annotations

import collections
import logging
from typing import Any

import zmq

from transfer_engine.control.auth import (
    Signer,
    open_reply,
    seal,
)
from transfer_engine.control.messages import Ack, Message
from transfer_engine.errors import TransferEngineError

__all__ = ["Links"]

log = logging.getLogger(__name__)

_MAX_LINKS = 256  # sockets a Links keeps, the least recently used closed first
_WILDCARDS = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}


class Links:
    """Background-thread DEALER sockets to peer side channels: fire-and-forget sends;
    answers are drained and only tell that the peer is alive."""

    def __init__(self, zctx: zmq.Context[Any], signer: Signer | None) -> None:
        self._zctx = zctx
        self._signer = signer
        self._socks: collections.OrderedDict[str, zmq.Socket[bytes]] = (
            collections.OrderedDict())

    def _sock(self, endpoint: str) -> zmq.Socket[bytes]:
        sock = self._socks.get(endpoint)
        if sock is None:
            if len(self._socks) >= _MAX_LINKS:
                self._socks.popitem(last=False)[1].close(0)
            sock = self._zctx.socket(zmq.DEALER)
            try:
                sock.setsockopt(zmq.LINGER, 0)
                sock.setsockopt(zmq.IPV6, 1)
                sock.setsockopt(zmq.SNDHWM, 64)
                sock.setsockopt(zmq.MAXMSGSIZE, 1 << 20)
                sock.connect(endpoint)  # a malformed endpoint (a peer's word) raises
            except zmq.ZMQError:
                sock.close(0)
                raise
            self._socks[endpoint] = sock
        else:
            self._socks.move_to_end(endpoint)
        return sock

    def send(self, endpoint: str, msg: Message) -> None:
        try:
            self._sock(endpoint).send(seal(msg, self._signer), zmq.NOBLOCK)
        except (zmq.ZMQError, TransferEngineError) as exc:
            log.info("%s to %s not sent: %s", msg.kind, endpoint, exc)

    def answered(self, endpoint: str) -> bool:
        """Whether any answer arrived from ``endpoint`` since the last call."""
        sock = self._socks.get(endpoint)
        if sock is None:
            return False
        seen = False
        for _ in range(1024):
            try:
                frame = sock.recv(zmq.NOBLOCK)
            except zmq.ZMQError:
                break
            try:
                reply = open_reply(frame, self._signer, peer=endpoint)
            except TransferEngineError as exc:
                log.info("answer from %s: %s", endpoint, exc)
                continue
            seen = True
            if not isinstance(reply, Ack):
                log.info("%s answered %s", endpoint, reply)
        return seen

    def drop(self, endpoint: str) -> None:
        sock = self._socks.pop(endpoint, None)
        if sock is not None:
            sock.close(0)

    def close(self) -> None:
        for sock in self._socks.values():
            sock.close(0)
        self._socks.clear()
