"""The engine's control endpoint: a :class:`~transfer_engine.control.service.Service`
answering handshakes.

A Hello gets our metadata and a fresh rail ticket
(:mod:`~transfer_engine.control.tickets`); a segments query gets our current segments.
The service checks every message first, and nothing a client sends stops it.
"""

from __future__ import annotations

import logging
import resource
from typing import Any

import zmq

from transfer_engine import interrupts
from transfer_engine.control.messages import (
    Hello,
    Message,
    SegmentsReply,
    SegmentsRequest,
    Welcome,
)
from transfer_engine.control.service import Service
from transfer_engine.control.tickets import MAX_NAME, valid_name
from transfer_engine.errors import ProtocolError
from transfer_engine.state import EngineState

log = logging.getLogger(__name__)


def _descriptor_limit() -> int:
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return soft if 0 < soft < (1 << 20) else 1 << 20


class ControlEndpoint(EngineState):
    """The engine's control endpoint (a part of :class:`Engine`)."""

    def _start_control(self, host: str, port: int) -> None:
        self._zctx: zmq.Context[Any] = zmq.Context()
        # a socket per connected peer: ZeroMQ's default cap (1023) would stop an engine
        # short of a thousand peers; the process's descriptor limit is the real one
        self._zctx.set(zmq.MAX_SOCKETS, max(1024, _descriptor_limit()))
        self._stack.callback(interrupts.term, self._zctx)
        # exposure was checked by the engine, which knows whether it was opted in
        service = Service(self._zctx, host, port, self._handle_control,
                          f"control-{self.name}", self._signer, insecure=True,
                          stats=self.stats, stat_prefix="control_")
        self._stack.callback(service.close)
        self.endpoint = service.endpoint

    @property
    def rails_per_ticket(self) -> int:
        """Rails one handshaken peer may hold open at once (more are refused)."""
        return self._tickets.max_rails

    def _handle_control(self, msg: Message) -> Message:
        if isinstance(msg, Hello):
            name = msg.meta.get("name")
            if not valid_name(name):
                raise ProtocolError(f"hello without a name of 1 to {MAX_NAME} characters")
            if name == self.name:
                raise ProtocolError(f"peer uses our own name {name!r}")
            pid = msg.meta.get("pid")
            ticket = self._tickets.issue(name, pid if isinstance(pid, int) else 0)
            return Welcome(self.metadata(), ticket)
        if isinstance(msg, SegmentsRequest):
            return SegmentsReply(self.metadata()["segments"])
        raise ProtocolError(f"unexpected {msg.kind} on the control endpoint")
