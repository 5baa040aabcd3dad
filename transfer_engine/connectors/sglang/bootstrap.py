"""The bootstrap server: where decode ranks find the prefill ranks of one prefill server.

SGLang starts it once per prefill server, on the prefill host at
``--disaggregation-bootstrap-port``, and sends every request there as
``bootstrap_host:bootstrap_port`` plus a ``bootstrap_room``. Each prefill rank registers
its engine endpoint, its side channel and its KV compatibility factors; a decode rank
asks for the prefill rank with its own rank number. The server moves no KV and keeps no
per-request state: rooms are settled between the ranks themselves. What it keeps is
bounded, whoever registers: ranks below ``MAX_RANKS``, short strings, compat factors of
at most ``MAX_COMPAT_BYTES`` (held encoded).
"""

from __future__ import annotations

import threading
from dataclasses import replace
from typing import Any

import msgpack
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

__all__ = ["TransferEngineKVBootstrapServer", "MAX_RANKS", "MAX_COMPAT_BYTES",
           "MAX_FIELD_CHARS"]

MAX_RANKS = 4096  # ranks of one prefill server (TP x PP world): 0 <= rank < MAX_RANKS
MAX_COMPAT_BYTES = 8 << 10  # a registration's compat factors, msgpack-encoded
MAX_FIELD_CHARS = 256  # longest engine name, engine endpoint or side channel


def _check_register(msg: PrefillRegister) -> bytes:
    """Refuses (``ProtocolError``) a registration this server would not keep: a bad
    version or rank, an empty or oversized string, oversized compat factors. Returns
    the compat factors encoded (kept as bytes: their size bounds what a rank costs)."""
    if msg.version != BACKEND_VERSION:
        raise ProtocolError(f"prefill rank {msg.rank} speaks backend version "
                            f"{msg.version}, this server {BACKEND_VERSION}")
    if not 0 <= msg.rank < MAX_RANKS:
        raise ProtocolError(f"registration needs a rank in [0, {MAX_RANKS}), got "
                            f"{msg.rank}")
    for name in ("engine_name", "engine_endpoint", "channel"):
        value = getattr(msg, name)
        if not 0 < len(value) <= MAX_FIELD_CHARS:
            raise ProtocolError(f"registration of rank {msg.rank}: {name} must have 1 to "
                                f"{MAX_FIELD_CHARS} characters, not {len(value)}")
    compat: bytes = msgpack.packb(msg.compat)
    if len(compat) > MAX_COMPAT_BYTES:
        raise ProtocolError(f"registration of rank {msg.rank}: compat factors of "
                            f"{len(compat)} bytes exceed {MAX_COMPAT_BYTES}")
    return compat


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
        # rank -> its registration, compat factors encoded (bounded: MAX_RANKS of them)
        self._ranks: dict[int, tuple[PrefillRegister, bytes]] = {}
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
            compat = _check_register(msg)
            with self._lock:
                self._ranks[msg.rank] = (replace(msg, compat={}), compat)
            return Ack()
        if isinstance(msg, PrefillLookup):
            with self._lock:
                found = self._ranks.get(msg.rank)
                known = sorted(self._ranks)
            if found is None:
                shown = f"{known[:16]}" + (f" and {len(known) - 16} more"
                                           if len(known) > 16 else "")
                raise UnknownPeerError(f"prefill rank {msg.rank} has not registered here "
                                       f"(registered ranks: {shown}); are the prefill and "
                                       "decode tensor-parallel sizes equal?")
            reg, compat = found
            return PrefillInfo(reg.rank, reg.engine_name, reg.engine_endpoint, reg.channel,
                               reg.version, msgpack.unpackb(compat, raw=False))
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
