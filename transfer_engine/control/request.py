"""The client side of a signed request/reply: one DEALER socket to a ROUTER service.

Every control-plane client (an engine's link to a peer's control endpoint, the registry
client, the kvstore's links to its master) talks to its server the same way, through a
:class:`SignedClient`: a request is sealed (:func:`~transfer_engine.control.auth.seal`),
its answer is waited for up to a timeout and opened
(:func:`~transfer_engine.control.auth.open_reply`: a ``Denied`` or a signature mismatch
raises ``AuthenticationError``), and an :class:`ErrorReply` raises the error the caller
chose (``RemoteError`` by default). An answer that does not come in time leaves the
socket unusable, since it would pair with the next request when it arrives late: the
socket is closed and opened afresh before the timeout is raised.

A DEALER answers in the order requests were sent, so a caller may also send several
requests and take their answers one by one (:meth:`send`, :meth:`receive`), or wait for
messages it did not ask for (:meth:`poll`, :meth:`read`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import zmq

from transfer_engine import interrupts
from transfer_engine.control.auth import Signer, open_reply, seal
from transfer_engine.control.messages import ErrorReply, Message
from transfer_engine.errors import ClosedError, RemoteError, TransferTimeout

__all__ = ["SignedClient", "MAX_REPLY_BYTES"]

MAX_REPLY_BYTES = 8 << 20

TimeoutErrorFactory = Callable[[str, float], Exception]
"""``(op, timeout)`` -> the error a request that got no answer in time raises."""
RefusedErrorFactory = Callable[[str, str], Exception]
"""``(op, reason)`` -> the error an :class:`ErrorReply` raises."""


class SignedClient:
    """A DEALER socket connected to ``address`` that sends signed requests and opens
    their replies. :meth:`request` is thread-safe (one request at a time); the lower
    :meth:`send` / :meth:`receive` are for a caller that serialises its own use.

    :param zctx: the context to make sockets in; ``None``: one of its own, terminated
        by :meth:`close`.
    :param signer: signs requests and checks replies (``None``: unsigned).
    :param peer: names the server in errors (``peer=`` context); may be changed later.
    :param name: what the client is, for "... is closed" errors.
    :param what: names the server in the default refusal message.
    :param max_bytes: largest reply accepted (``MAXMSGSIZE``).
    :param ipv6: whether the socket may connect to IPv6 endpoints.
    :param reconnect: ``(RECONNECT_IVL, RECONNECT_IVL_MAX)`` in milliseconds, if set.
    :param timeout_error: makes the error a timed-out request raises (default
        ``TransferTimeout``).
    :param refused_error: makes the error an ``ErrorReply`` raises (default
        ``RemoteError``).
    """

    def __init__(self, zctx: zmq.Context[Any] | None, address: str,
                 signer: Signer | None, *, peer: str, name: str = "control client",
                 what: str = "peer", max_bytes: int = MAX_REPLY_BYTES, ipv6: bool = True,
                 reconnect: tuple[int, int] | None = None,
                 timeout_error: TimeoutErrorFactory | None = None,
                 refused_error: RefusedErrorFactory | None = None) -> None:
        self.address = address
        self.peer = peer
        self.name = name
        self.what = what
        self.rtt: float | None = None  # seconds, the last round trip of request()
        self._signer = signer
        self._max_bytes = max_bytes
        self._ipv6 = ipv6
        self._reconnect = reconnect
        self._timeout_error = timeout_error
        self._refused_error = refused_error
        self._own = zctx is None
        self._zctx: zmq.Context[Any] = zmq.Context() if zctx is None else zctx
        self._lock = threading.Lock()
        self._closed = False
        try:
            self._sock = self._open()
        except BaseException:
            if self._own:
                interrupts.term(self._zctx)
            raise

    def _open(self) -> zmq.Socket[bytes]:
        sock: zmq.Socket[bytes] = self._zctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        if self._ipv6:
            sock.setsockopt(zmq.IPV6, 1)  # accepts IPv4 endpoints too
        sock.setsockopt(zmq.MAXMSGSIZE, self._max_bytes)
        if self._reconnect is not None:
            sock.setsockopt(zmq.RECONNECT_IVL, self._reconnect[0])
            sock.setsockopt(zmq.RECONNECT_IVL_MAX, self._reconnect[1])
        try:
            sock.connect(self.address)
        except BaseException:
            sock.close(0)
            raise
        return sock

    @property
    def socket(self) -> zmq.Socket[bytes]:
        """The current socket (to register with a poller); replaced by :meth:`reset`."""
        return self._sock

    @property
    def closed(self) -> bool:
        return self._closed

    def request(self, msg: Message, timeout: float) -> Message:
        """Sends ``msg`` and returns its answer; records the round trip in :attr:`rtt`."""
        with self._lock:
            started = time.monotonic()
            self.send(msg)
            frame = self._frame(msg.kind, timeout)
            self.rtt = time.monotonic() - started
        return self._open_answer(frame, msg.kind)

    def send(self, msg: Message) -> None:
        """Sends ``msg`` sealed, without waiting for its answer."""
        if self._closed:
            raise ClosedError(f"{self.name} is closed", peer=self.peer, op=msg.kind)
        self._sock.send(seal(msg, self._signer))

    def receive(self, op: str, timeout: float) -> Message:
        """The next answer, to a request of kind ``op``: waits up to ``timeout`` seconds
        (then resets the socket and raises the timeout error); an ``ErrorReply`` raises
        the refusal error."""
        return self._open_answer(self._frame(op, timeout), op)

    def poll(self, timeout: float) -> bool:
        """Whether a message arrives within ``timeout`` seconds (nothing is reset)."""
        return bool(self._sock.poll(max(0, int(timeout * 1000)), zmq.POLLIN))

    def read(self, op: str | None = None) -> Message:
        """Takes the message that :meth:`poll` saw and opens it (an ``ErrorReply`` is
        returned as it is; ``AuthenticationError`` or ``ProtocolError`` is raised)."""
        return open_reply(self._sock.recv(), self._signer, peer=self.peer, op=op)

    def _frame(self, op: str, timeout: float) -> bytes:
        if not self._sock.poll(int(timeout * 1000), zmq.POLLIN):
            self.reset()  # the late answer would pair with the next request
            raise self._timed_out(op, timeout)
        return self._sock.recv()

    def _open_answer(self, frame: bytes, op: str) -> Message:
        reply = open_reply(frame, self._signer, peer=self.peer, op=op)
        if isinstance(reply, ErrorReply):
            if self._refused_error is not None:
                raise self._refused_error(op, reply.message)
            raise RemoteError(f"{self.what} refused {op}: {reply.message}", peer=self.peer,
                              op=op)
        return reply

    def _timed_out(self, op: str, timeout: float) -> Exception:
        if self._timeout_error is not None:
            return self._timeout_error(op, timeout)
        return TransferTimeout(f"no answer from {self.address} in {timeout}s", peer=self.peer,
                               op=op)

    def reset(self) -> None:
        """Closes the socket and opens a fresh one: nothing queued on the old one (a
        request, or an answer still to come) reaches the new one."""
        self._sock.close(linger=0)
        self._sock = self._open()

    def retarget(self, address: str) -> None:
        """Points the client at another server (a leader that moved); as with
        :meth:`reset`, nothing queued on the old socket reaches the new one."""
        self.address = address
        self.reset()

    def close(self) -> None:
        """Closes the socket (and the context, when it is the client's own). Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._sock.close(linger=0)
            if self._own:
                interrupts.term(self._zctx)

    def __repr__(self) -> str:
        state = "CLOSED" if self._closed else "OPEN"
        return f"<SignedClient {self.name} -> {self.address} {state}>"
