"""A signed request/reply service: a ZeroMQ ROUTER answered on its own thread.

The engine's control endpoint, the SGLang bootstrap server and every SGLang rank's side
channel are one :class:`Service` each. Every request is checked by
:func:`~transfer_engine.control.auth.open_request` (signature, size, version, kind,
fields) before the handler sees it; a request that fails authentication is answered
``Denied`` (unsigned: the sender may lack our secret); a handler that raises a
:class:`TransferError` answers :class:`ErrorReply` with its text (the client raises
``RemoteError``); any other exception is logged and answered the same way. No message
stops the service, and refusals are logged at most once a second, so a flood of junk
costs a counter, not a log line each.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import zmq

from transfer_engine.control.auth import OVERHEAD, Signer, check_exposure, open_request
from transfer_engine.control.messages import MAX_MESSAGE_BYTES, ErrorReply, Message
from transfer_engine.control.reply import SINGLE_FRAME, answer_multipart, refuse, send_reply
from transfer_engine.errors import AuthenticationError, TransferError

__all__ = ["Service", "tcp_endpoint", "split_host_port"]

log = logging.getLogger(__name__)

_WILDCARDS = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}
MAX_REQUEST_BYTES = MAX_MESSAGE_BYTES + OVERHEAD  # no valid request is larger
# requests queued per connection while the service thread is busy (ZeroMQ's default is
# 1,000: up to 4 GiB from one flooding connection); past it ZeroMQ stops reading it
RECV_QUEUE = 4


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
    :param name: what the service is (its thread is ``te-<name>``, its log lines say it).
    :param signer: signs replies and checks requests (``None``: unsigned).
    :param insecure: serve a non-loopback ``host`` without a secret (see
        :func:`~transfer_engine.control.auth.check_exposure`).
    :param stats: a counter the service adds ``<prefix>rejected`` and
        ``<prefix>denied`` to (default: its own, :attr:`stats`).
    """

    def __init__(self, zctx: zmq.Context[Any], host: str, port: int,
                 handler: Callable[[Message], Message], name: str,
                 signer: Signer | None, *, insecure: bool | None = None,
                 stats: collections.Counter[str] | None = None,
                 stat_prefix: str = "") -> None:
        check_exposure(host, signer is not None, insecure, what=f"the {name} service")
        self.name = name
        self.stats = stats if stats is not None else collections.Counter[str]()
        self._prefix = stat_prefix
        self._logged = 0.0  # when a refusal was last logged
        self._quiet = 0  # refusals not logged since
        self._handler = handler
        self._signer = signer
        self._sock: zmq.Socket[bytes] = zctx.socket(zmq.ROUTER)
        try:
            self._sock.setsockopt(zmq.LINGER, 0)
            self._sock.setsockopt(zmq.MAXMSGSIZE, MAX_REQUEST_BYTES)
            self._sock.setsockopt(zmq.RCVHWM, RECV_QUEUE)
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
                                        name=f"te-{name}")
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
                self._refused(SINGLE_FRAME)
                answer_multipart(self._sock, frames, self._signer)
                continue
            ident, data = frames
            try:
                reply = self._handler(open_request(data, self._signer, peer="?"))
            except AuthenticationError as exc:
                self.stats[self._prefix + "denied"] += 1
                self._refused(f"refused: {exc}")
                refuse(self._sock, ident, exc, self._signer)
                continue
            except TransferError as exc:
                self._refused(f"rejected: {exc}")
                refuse(self._sock, ident, exc, self._signer)
                continue
            except Exception as exc:  # never let a message stop the service
                log.exception("%s: request failed", self.name)
                reply = ErrorReply(f"internal error: {exc!r}")
            send_reply(self._sock, ident, reply, self._signer)

    def _refused(self, why: str) -> None:
        self.stats[self._prefix + "rejected"] += 1
        now = time.monotonic()
        if now - self._logged < 1.0:
            self._quiet += 1
            return
        more = f" ({self._quiet} more since the last line)" if self._quiet else ""
        log.warning("%s: request %s%s", self.name, why, more)
        self._logged, self._quiet = now, 0

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


