"""The engine's control endpoint: a ROUTER socket answering handshakes.

A Hello gets our metadata and a fresh rail ticket (:mod:`~transfer_engine.control.tickets`);
a segments query gets our current segments. Every message is checked by
:func:`~transfer_engine.control.auth.open_request` first; nothing a client sends stops
the loop.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import zmq

from transfer_engine.control.auth import open_request, seal
from transfer_engine.control.messages import (
    Denied,
    ErrorReply,
    Hello,
    Message,
    SegmentsReply,
    SegmentsRequest,
    Welcome,
)
from transfer_engine.errors import (
    AuthenticationError,
    ProtocolError,
    TransferError,
)
from transfer_engine.state import EngineState

log = logging.getLogger(__name__)


class ControlEndpoint(EngineState):
    """The engine's control endpoint (a part of :class:`Engine`)."""

    def _start_control(self, host: str, port: int) -> None:
        self._zctx: zmq.Context[Any] = zmq.Context()
        self._stack.callback(self._zctx.term)
        self._router = self._zctx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)
        self._router.setsockopt(zmq.MAXMSGSIZE, 8 << 20)
        self._stack.callback(self._router.close, 0)
        if ":" in host and not host.startswith("["):
            self._router.setsockopt(zmq.IPV6, 1)
            bind_host = f"[{host}]"
        else:
            bind_host = host
        if port:
            self._router.bind(f"tcp://{bind_host}:{port}")
        else:
            port = self._router.bind_to_random_port(f"tcp://{bind_host}")
        self.endpoint = f"tcp://{bind_host}:{port}"
        self._control_stop = threading.Event()
        self._control_thread = threading.Thread(target=self._control_loop, daemon=True,
                                                name=f"te-control-{self.name}")
        self._control_thread.start()
        self._stack.callback(self._control_thread.join, 5)
        self._stack.callback(self._control_stop.set)

    def _control_loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        while not self._control_stop.is_set():
            try:
                if not poller.poll(100):
                    continue
                frames = self._router.recv_multipart(zmq.NOBLOCK)
            except zmq.ZMQError:
                if self._control_stop.is_set():
                    return
                continue
            if len(frames) != 2:
                self.stats["control_rejected"] += 1
                if len(frames) > 2:  # answer, so that the sender's next request pairs up
                    try:
                        self._router.send_multipart(
                            [frames[0], seal(ErrorReply("expected a single-frame message"),
                                             self._signer)], zmq.NOBLOCK)
                    except zmq.ZMQError:
                        pass
                continue
            ident, data = frames
            signed = True
            try:
                reply = self._handle_control(open_request(data, self._signer, peer="?"))
            except AuthenticationError as exc:
                self.stats["control_rejected"] += 1
                self.stats["control_denied"] += 1
                log.warning("control message refused: %s", exc)
                reply, signed = Denied(exc.message), False
            except TransferError as exc:
                self.stats["control_rejected"] += 1
                log.warning("control message rejected: %s", exc)
                reply = ErrorReply(str(exc))
            except Exception as exc:  # never let a message kill the endpoint
                log.exception("control message failed")
                reply = ErrorReply(f"internal error: {exc!r}")
            try:
                self._router.send_multipart(
                    [ident, seal(reply, self._signer if signed else None)], zmq.NOBLOCK)
            except zmq.ZMQError:
                pass

    def _handle_control(self, msg: Message) -> Message:
        if isinstance(msg, Hello):
            name = msg.meta.get("name")
            if not isinstance(name, str) or not name:
                raise ProtocolError("hello without a name")
            if name == self.name:
                raise ProtocolError(f"peer uses our own name {name!r}")
            pid = msg.meta.get("pid")
            ticket = self._tickets.issue(name, pid if isinstance(pid, int) else 0)
            return Welcome(self.metadata(), ticket)
        if isinstance(msg, SegmentsRequest):
            return SegmentsReply(self.metadata()["segments"])
        raise ProtocolError(f"unexpected {msg.kind} on the control endpoint")
