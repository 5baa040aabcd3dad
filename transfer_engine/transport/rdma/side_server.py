"""The side channel's target role: a peer's rail opens here (its ticket proven, our
queue pair for it made and connected) and later asks for keys of segments it has not
seen. A part of :class:`~transfer_engine.transport.rdma.transport.RdmaTransport`."""

from __future__ import annotations

import errno
import socket
import threading
import time
from typing import TYPE_CHECKING, Any

from transfer_engine.control.tickets import Ticket, new_challenge
from transfer_engine.errors import (
    AuthenticationError,
    ConnectError,
    PeerLostError,
    TransferError,
    error_code,
)
from transfer_engine.transport.cuts import Cuts, shut, wait_until
from transfer_engine.transport.rdma.inbound import _Inbound
from transfer_engine.transport.rdma.plan import NOTIFY_HEADER, QpInfo, negotiate_mtu, random_psn
from transfer_engine.transport.rdma.side import (
    _MAX_OPENING_FRAME,
    _recv_frame,
    _send_frame,
    _SideRefused,
)
from transfer_engine.transport.stream import HELLO_TIMEOUT, RESOURCE_ERRORS

if TYPE_CHECKING:
    from transfer_engine.transport.base import Host
    from transfer_engine.transport.rdma.placement import MrTable
    from transfer_engine.transport.rdma.plan import ImmUnwrapper

_MAX_SIDE = 4096  # side channels served at once


class SideServer:
    """Accepts and serves side channels (the transport's listener and tables)."""

    if TYPE_CHECKING:
        _closed: bool
        _host: Host | None
        _listener: socket.socket | None
        _lock: threading.Lock
        _side_socks: set[socket.socket]
        cuts: Cuts
        _inbound: dict[tuple[str, int], _Inbound]
        _by_name: dict[str, Any]
        _regions: MrTable
        _unwrap: ImmUnwrapper
        recv_depth: int
        max_notify: int

    def _accept_loop(self) -> None:
        assert self._listener is not None
        backoff = 0.0
        while not self._closed:
            try:
                sock, _ = self._listener.accept()
            except OSError as exc:
                if self._closed or exc.errno in (errno.EBADF, errno.EINVAL, None):
                    return
                if exc.errno in RESOURCE_ERRORS:
                    backoff = min(1.0, backoff * 2 or 0.01)
                    time.sleep(backoff)
                continue
            backoff = 0.0
            with self._lock:
                crowded = len(self._side_socks) >= _MAX_SIDE
            if crowded:
                sock.close()
                continue
            try:
                threading.Thread(target=self._serve, args=(sock,), name="te-rdma-side",
                                 daemon=True).start()
            except RuntimeError:
                sock.close()

    def _serve(self, sock: socket.socket) -> None:
        conn: _Inbound | None = None
        peer: str | None = None
        with self._lock:
            self._side_socks.add(sock)
        ticket: Ticket | None = None
        mark = self.cuts.mark()
        try:
            ticket, proof, msg = self._open_side(sock)
            sock.settimeout(None)
            peer, rail, want = ticket.peer, int(msg["rail"]), str(msg["device"])
            dev = self._by_name.get(want)
            if msg.get("kind") != "connect" or dev is None:
                raise ConnectError(f"no rdma device {want!r} here", peer=peer)
            theirs = QpInfo.from_wire(msg.get("qp"), peer)
            conn = _Inbound(dev, peer, rail, self.recv_depth,
                            NOTIFY_HEADER.size + self.max_notify)
            conn.origin = ticket.id
            psn = random_psn()
            dev.connect_qp(conn.qp, psn, theirs, negotiate_mtu(dev.mtu, theirs.mtu),
                           peer=peer)
            conn.side = sock
            dev.add_inbound(conn)
            with self._lock:
                self._inbound[(peer, conn.key)] = conn
            if self.cuts.since(peer, mark):  # cut while it opened: its ticket is void
                raise _SideRefused("peer cut")
            _send_frame(sock, {"qp": dev.qp_info(conn.qp, psn).to_wire(), "proof": proof,
                               "segments": self._regions.remote_keys(want, None)})
            while not self._closed:
                msg = _recv_frame(sock, peer)
                ids = [int(i) for i in msg.get("ids", [])]
                _send_frame(sock, {"segments": self._regions.remote_keys(want, ids)})
        except _SideRefused:
            try:  # a bare refusal: a stranger learns nothing
                _send_frame(sock, {"error": error_code(AuthenticationError("")),
                                   "message": "rail refused"})
            except OSError:
                pass
        except (TransferError, KeyError, ValueError, TypeError) as exc:
            if not isinstance(exc, PeerLostError):
                try:
                    code = error_code(exc) if isinstance(exc, TransferError) else 2
                    _send_frame(sock, {"error": code, "message": str(exc)})
                except OSError:
                    pass
        except OSError:
            pass
        finally:
            with self._lock:
                self._side_socks.discard(sock)
            sock.close()
            if ticket is not None:
                ticket.release()
            if conn is not None:
                conn.device.remove_inbound(conn)
                if not self._closed:
                    conn.close()  # before it leaves the table: a cut waits for that
                with self._lock:
                    self._inbound.pop((conn.peer, conn.key), None)
                if peer is not None and not self._peer_has_inbound(peer):
                    with self._lock:
                        self._unwrap.forget(peer)

    def _open_side(self, sock: socket.socket) -> tuple[Ticket, bytes, dict[str, Any]]:
        """The side channel's opening: our challenge, the peer's ticket and proof (the
        same as a stream rail's, see :mod:`~transfer_engine.control.tickets`); returns
        the ticket, our answer and the connect message. Raises :class:`_SideRefused`."""
        assert self._host is not None
        sock.settimeout(HELLO_TIMEOUT)
        challenge = new_challenge()
        try:
            _send_frame(sock, {"challenge": challenge})
            msg = _recv_frame(sock, None, limit=_MAX_OPENING_FRAME)
            if msg.get("kind") != "connect":
                raise _SideRefused("no connect")
            ticket, proof = self._host.admit_rail(msg.get("ticket"), "rdma", challenge,
                                                  msg.get("nonce"), msg.get("proof"))
        except (TransferError, OSError) as exc:
            raise _SideRefused(str(exc)) from None
        return ticket, proof, msg

    def cut(self, peer: str, timeout: float) -> bool:
        """Ends ``peer``'s rails here (see ``Transport.cut``): their side channels are
        shut, so that their serving threads destroy the queue pairs, after which the NIC
        refuses whatever that peer still sends them."""
        self.cuts.cut(peer)
        with self._lock:
            socks = [c.side for (p, _), c in self._inbound.items()
                     if p == peer and c.side is not None]
        shut(socks)
        return wait_until(lambda: not self._peer_has_inbound(peer), timeout)

    def _peer_has_inbound(self, peer: str) -> bool:
        with self._lock:
            return any(p == peer for p, _ in self._inbound)
