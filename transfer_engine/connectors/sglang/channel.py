"""A small request/reply service (ZeroMQ ROUTER on its own thread) and address helpers.

The bootstrap server and every rank's side channel are one :class:`Service` each: typed
messages from :mod:`.messages`, signed like the engine's control plane, answered by a
handler on the service thread. A handler that raises a :class:`TransferError` answers
:class:`ErrorReply` with its text (the client raises ``RemoteError``); any other
exception is logged and answered the same way, so no message stops the service.
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Callable
from typing import Any

import zmq

from transfer_engine.control.auth import (
    Signer,
    check_exposure,
    open_reply,
    open_request,
    seal,
)
from transfer_engine.control.messages import Ack, Denied, ErrorReply, Message
from transfer_engine.errors import AuthenticationError, TransferEngineError, TransferError

__all__ = ["Service", "Links", "tcp_endpoint", "split_host_port"]

log = logging.getLogger(__name__)

_MAX_LINKS = 256  # sockets a Links keeps, the least recently used closed first
_WILDCARDS = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}


def split_host_port(addr: str) -> tuple[str, int]:
    """``"host:port"`` or ``"[v6]:port"`` -> ``(host, port)``; raises ValueError."""
    host, sep, port = addr.rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"not a host:port address: {addr!r}")
    return host.strip("[]"), int(port)


def tcp_endpoint(host: str, port: int, *, connect: bool = False) -> str:
    """A ZeroMQ tcp endpoint; with ``connect`` a wildcard host becomes loopback."""
    if connect:
        host = _WILDCARDS.get(host, host)
    if ":" in host:
        host = f"[{host}]"
    return f"tcp://{host}:{port}"


class Service:
    """Answers requests on ``host:port`` (port 0: a free one) until closed.

    :param handler: called on the service thread with each decoded request; returns the
        reply.
    :param name: thread name suffix (threads are named ``te-sglang-<name>``).
    :param signer: signs replies and checks requests (``None``: unsigned).
    """

    def __init__(self, zctx: zmq.Context[Any], host: str, port: int,
                 handler: Callable[[Message], Message], name: str,
                 signer: Signer | None) -> None:
        check_exposure(host, signer is not None, None, what=f"SGLang {name} service")
        self._handler = handler
        self._signer = signer
        self._sock: zmq.Socket[bytes] = zctx.socket(zmq.ROUTER)
        try:
            self._sock.setsockopt(zmq.LINGER, 0)
            self._sock.setsockopt(zmq.MAXMSGSIZE, 8 << 20)
            if ":" in host:
                self._sock.setsockopt(zmq.IPV6, 1)
            bind = tcp_endpoint(host, port)
            if port:
                self._sock.bind(bind)
            else:
                port = self._sock.bind_to_random_port(bind.rsplit(":", 1)[0])
        except zmq.ZMQError:
            self._sock.close(0)
            raise
        self.port = port
        self.endpoint = tcp_endpoint(host, port)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True,
                                        name=f"te-sglang-{name}")
        self._thread.start()

    def _loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while not self._stop.is_set():
            try:
                if not poller.poll(100):
                    continue
                frames = self._sock.recv_multipart(zmq.NOBLOCK)
            except zmq.ZMQError:
                continue
            if len(frames) != 2:
                continue
            ident, data = frames
            signed = True
            try:
                reply = self._handler(open_request(data, self._signer, peer="?"))
            except AuthenticationError as exc:
                log.warning("request refused: %s", exc)
                reply, signed = Denied(exc.message), False
            except TransferError as exc:
                reply = ErrorReply(str(exc))
            except Exception as exc:  # never let a message stop the service
                log.exception("request failed")
                reply = ErrorReply(f"internal error: {exc!r}")
            signer = self._signer if signed else None
            try:
                out = seal(reply, signer)
            except TransferError as exc:  # e.g. a reply over its size limit
                out = seal(ErrorReply(f"cannot encode the reply: {exc}"[:2000]), signer)
            try:
                self._sock.send_multipart([ident, out], zmq.NOBLOCK)
            except zmq.ZMQError:
                pass

    @property
    def stopped(self) -> bool:
        """Whether the thread has ended (and the socket is closed, once ``close`` ran)."""
        return not self._thread.is_alive()

    def close(self, timeout: float = 5.0) -> None:
        """Stops the thread (waiting up to ``timeout`` seconds for a request being
        handled) and closes the socket. Idempotent."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join(timeout)
        if self._thread.is_alive():  # the socket is not ours to close while it runs
            log.warning("%s still handling a request after %ss", self._thread.name, timeout)
            return
        self._sock.close(0)


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
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.IPV6, 1)
            sock.setsockopt(zmq.SNDHWM, 64)
            sock.setsockopt(zmq.MAXMSGSIZE, 1 << 20)
            sock.connect(endpoint)
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
