"""The private link between an application and its serving process.

Length-prefixed msgpack frames over a unix stream socket pair, file descriptors attached
to a frame's first bytes (``SCM_RIGHTS``), calls matched to replies by id. Only the two
ends of one ``socketpair`` ever hold it.
"""

from __future__ import annotations

import itertools
import socket
import struct
import threading
from collections.abc import Sequence
from typing import Any

import msgpack

_LEN = struct.Struct("<I")
MAX_FRAME = 4 << 20  # an immediate's body is at most 1 MiB
MAX_FDS = 4


class ChannelClosed(Exception):
    """The other end is gone (exited, killed, or closed the link)."""


class FrameTooLarge(ValueError):
    """A message over :data:`MAX_FRAME`: not sent (the other end would take it for the
    link closing)."""


class Channel:
    """One end of the link; ``send`` and ``call`` from any thread, ``recv`` from one."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._wlock = threading.Lock()
        self._ids = itertools.count(1)
        self._waiting: dict[int, list[Any]] = {}  # call id -> [event, reply]
        self._wait_lock = threading.Lock()
        self.closed = False

    def send(self, msg: dict[str, Any], fds: Sequence[int] = ()) -> None:
        data = msgpack.packb(msg, use_bin_type=True)
        if len(data) > MAX_FRAME:
            raise FrameTooLarge(f"a {msg.get('op', 'reply')} message of {len(data)} bytes "
                                f"(at most {MAX_FRAME})")
        frame = _LEN.pack(len(data)) + data
        try:
            with self._wlock:
                if fds:
                    sent = socket.send_fds(self.sock, [frame], list(fds))
                    if sent < len(frame):
                        self.sock.sendall(frame[sent:])
                else:
                    self.sock.sendall(frame)
        except OSError as exc:
            raise ChannelClosed(str(exc)) from None

    def recv(self) -> tuple[dict[str, Any], list[int]]:
        """The next frame and the fds that came with it; raises :class:`ChannelClosed`."""
        try:
            head, fds, _, _ = socket.recv_fds(self.sock, _LEN.size, MAX_FDS,
                                              socket.MSG_WAITALL | socket.MSG_CMSG_CLOEXEC)
            if len(head) < _LEN.size:
                raise ChannelClosed("link closed")
            (n,) = _LEN.unpack(head)
            if n > MAX_FRAME:
                raise ChannelClosed(f"frame of {n} bytes")
            body = bytearray(n)
            view = memoryview(body)
            got = 0
            while got < n:
                k = self.sock.recv_into(view[got:], n - got, socket.MSG_WAITALL)
                if not k:
                    raise ChannelClosed("link closed mid-frame")
                got += k
        except OSError as exc:
            raise ChannelClosed(str(exc)) from None
        msg = msgpack.unpackb(body, raw=False)
        if not isinstance(msg, dict):
            raise ChannelClosed("malformed frame")
        return msg, list(fds)

    def call(self, msg: dict[str, Any], timeout: float, fds: Sequence[int] = ()
             ) -> dict[str, Any]:
        """Sends ``msg`` and waits for the frame whose ``re`` is its id (delivered by
        the thread that reads, through :meth:`answer`)."""
        call_id = next(self._ids)
        slot: list[Any] = [threading.Event(), None]
        with self._wait_lock:
            if self.closed:
                raise ChannelClosed("link closed")
            self._waiting[call_id] = slot
        try:
            self.send({**msg, "id": call_id}, fds)
            if not slot[0].wait(timeout):
                raise TimeoutError(f"no answer to {msg.get('op')!r} in {timeout:g} s")
        finally:
            with self._wait_lock:
                self._waiting.pop(call_id, None)
        if slot[1] is None:
            raise ChannelClosed("link closed")
        return slot[1]  # type: ignore[no-any-return]

    def answer(self, msg: dict[str, Any]) -> bool:
        """Hands a reply to its caller; False if ``msg`` is not a reply."""
        call_id = msg.get("re")
        if call_id is None:
            return False
        with self._wait_lock:
            slot = self._waiting.get(call_id)
        if slot is not None:
            slot[1] = msg
            slot[0].set()
        return True

    def close(self) -> None:
        """Wakes every caller (they raise :class:`ChannelClosed`) and closes the socket."""
        with self._wait_lock:
            self.closed = True
            slots = list(self._waiting.values())
        for slot in slots:
            slot[0].set()
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
