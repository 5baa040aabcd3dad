"""The bootstrap server: where decode ranks find the prefill ranks of one prefill server.

SGLang starts it once per prefill server, on the prefill host at
``--disaggregation-bootstrap-port``, and sends every request there as
``bootstrap_host:bootstrap_port`` plus a ``bootstrap_room``. Each prefill rank registers
its engine endpoint, its side channel and its KV compatibility factors; a decode rank
asks for the prefill rank with its own rank number. The server moves no KV and keeps no
per-request state: rooms are settled between the ranks themselves.
"""

from __future__ import annotations

import threading
from typing import Any

import zmq
from sglang.srt.disaggregation.base.conn import BaseKVBootstrapServer

from transfer_engine.closeable import Closeable
from transfer_engine.connectors.sglang.messages import (
    BACKEND_VERSION,
    Ping,
    PrefillInfo,
    PrefillLookup,
    PrefillRegister,
)
from transfer_engine.control.auth import AuthConfig
from transfer_engine.control.messages import Ack, Message
from transfer_engine.control.service import Service
from transfer_engine.errors import ProtocolError, UnknownPeerError

__all__ = ["TransferEngineKVBootstrapServer"]


class TransferEngineKVBootstrapServer(BaseKVBootstrapServer, Closeable):  # type: ignore[misc]
    """Serves prefill rank registrations on ``host:port`` from a thread until closed.

    :param host: address to listen on (``0.0.0.0`` for every interface).
    :param port: port to listen on; 0 picks a free one (see :attr:`port`).
    :param auth: signing of messages; default ``AuthConfig.from_env()``
        (``TE_CONTROL_SECRET``).
    """

    def __init__(self, host: str, port: int, *, auth: AuthConfig | None = None) -> None:
        self.host = host
        self._lock = threading.Lock()
        self._ranks: dict[int, PrefillRegister] = {}
        self._closed = False
        self._zctx: zmq.Context[Any] = zmq.Context()
        try:
            self._service = Service(self._zctx, host, port, self._handle, "sglang-bootstrap",
                                    (auth or AuthConfig.from_env()).signer())
        except BaseException:
            self._zctx.term()
            raise
        self.port = self._service.port

    def _handle(self, msg: Message) -> Message:
        if isinstance(msg, PrefillRegister):
            if msg.version != BACKEND_VERSION:
                raise ProtocolError(f"prefill rank {msg.rank} speaks backend version "
                                    f"{msg.version}, this server {BACKEND_VERSION}")
            if msg.rank < 0 or not msg.engine_endpoint or not msg.channel:
                raise ProtocolError("registration needs a rank >= 0, an engine endpoint "
                                    "and a side channel")
            with self._lock:
                self._ranks[msg.rank] = msg
            return Ack()
        if isinstance(msg, PrefillLookup):
            with self._lock:
                reg = self._ranks.get(msg.rank)
                known = sorted(self._ranks)
            if reg is None:
                raise UnknownPeerError(f"prefill rank {msg.rank} has not registered here "
                                       f"(registered ranks: {known}); are the prefill and "
                                       "decode tensor-parallel sizes equal?")
            return PrefillInfo(reg.rank, reg.engine_name, reg.engine_endpoint, reg.channel,
                               reg.version, reg.compat)
        if isinstance(msg, Ping):
            return Ack()
        raise ProtocolError(f"unexpected {msg.kind} at the bootstrap server")

    @property
    def ranks(self) -> list[int]:
        """Prefill ranks registered so far."""
        with self._lock:
            return sorted(self._ranks)

    def close(self) -> None:
        """Stops serving and frees the port. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._service.close()
        self._zctx.term()

    def _unclosed(self) -> str:
        return f"bootstrap server on port {self.port} was not closed"

    def __repr__(self) -> str:
        state = " CLOSED" if self._closed else ""
        return (f"<TransferEngineKVBootstrapServer {self._service.endpoint} "
                f"ranks={self.ranks}{state}>")
