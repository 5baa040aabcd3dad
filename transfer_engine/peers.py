"""The engine's peers: one connection per peer, made by the handshake.

``connect`` says Hello on the peer's control endpoint, gets its metadata and a rail
ticket in the Welcome, and opens rails on every transport both sides share, best
first; concurrent connects to one address share one handshake.
"""

from __future__ import annotations

import logging
import math
import socket
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout

from transfer_engine.control.messages import (
    Hello,
    Welcome,
)
from transfer_engine.control.tickets import Credential, check_name
from transfer_engine.errors import (
    ConnectError,
    PeerLostError,
    ProtocolError,
    TransferError,
    TransferTimeout,
    UnknownPeerError,
)
from transfer_engine.peer import ControlClient, Peer, PeerInfo
from transfer_engine.state import EngineState
from transfer_engine.transport.base import Transport

log = logging.getLogger(__name__)


def _usable(peer: Peer) -> bool:
    """Whether ``peer`` can carry a transfer now: not lost, with a transport whose rails
    are open."""
    return peer.lost is None and any(
        rails and not all(rail.closed for rail in rails)
        for name, rails in peer.rails.items() if name in peer.order)

def _reachable(address: str, timeout: float) -> None:
    """Fails at once where nothing listens at a ``tcp://`` control endpoint (ZeroMQ
    would retry quietly until the handshake's deadline): a refused port raises
    :class:`ConnectError` now, a silent one :class:`TransferTimeout` after ``timeout``.
    """
    if not address.startswith("tcp://"):
        return
    host, _, port = address[len("tcp://"):].rpartition(":")
    try:
        target = (host.strip("[]"), int(port))
    except ValueError:
        raise ConnectError(f"not a tcp://host:port endpoint: {address!r}", peer=address,
                           op="connect") from None
    try:
        socket.create_connection(target, timeout=timeout).close()
    except TimeoutError:
        raise TransferTimeout(f"no answer from {address} in {timeout}s", peer=address,
                              op="connect") from None
    except OSError as exc:
        raise ConnectError(f"cannot reach {address}: {exc.strerror or exc}", peer=address,
                           op="connect") from None


class Peers(EngineState):
    """The peer table and the handshake (a part of :class:`Engine`)."""

    def connect(self, address: str, timeout: float | None = None) -> Peer:
        """Handshakes with the engine at ``address`` (its ``endpoint``, or with a
        registry, its member name) and opens rails on every transport both sides share,
        best first. Returns the :class:`Peer`.

        One connection per peer, whoever asks: a peer already connected at ``address``
        with open rails is returned as it is; concurrent calls for one address share one
        handshake (later callers wait for it and get its peer or its error). A peer
        replaced by a new connection (it restarted, or was reached by another address)
        keeps its rails until the transfers already on them have finished.
        """
        self._check_open("connect")
        timeout = self.timeout if timeout is None else timeout
        if "://" not in address:
            return self.connect_name(address, timeout)
        with self._lock:
            known = self._by_address.get(address)
            if known is not None and self._peers.get(known.name) is known and _usable(known):
                return known
            pending = self._connecting.get(address)
            if pending is None:
                pending = self._connecting[address] = Future()
                mine = True
            else:
                mine = False
        if not mine:
            try:
                return pending.result(timeout)
            except FutureTimeout:
                raise TransferTimeout(f"another connect to {address} did not finish in "
                                      f"{timeout}s", peer=address, op="connect") from None
        try:
            peer = self._handshake(address, timeout)
        except BaseException as exc:
            pending.set_exception(exc)
            raise
        finally:
            with self._lock:
                self._connecting.pop(address, None)
        pending.set_result(peer)
        return peer

    def _handshake(self, address: str, timeout: float) -> Peer:
        _reachable(address, timeout)
        client = ControlClient(self._zctx, address, peer=address, auth=self._signer)
        try:
            reply = client.request(Hello(self.metadata()), timeout)
            if not isinstance(reply, Welcome):
                raise ProtocolError(f"expected welcome, got {reply.kind}", peer=address)
            meta = reply.meta
            try:
                name = PeerInfo.from_wire(meta).name
            except ProtocolError as exc:
                raise exc.with_context(peer=address) from None
            client.peer = name
            credential = Credential.from_welcome(reply.ticket, self._secret, name, self.name)
            peer = Peer(meta, client, timeout)
            peer.ticket = credential.ticket
        except BaseException:
            client.close()
            raise
        with self._lock:
            old = self._peers.get(name)
        if (old is not None and _usable(old)
                and old.info.incarnation == peer.info.incarnation):
            peer.close()  # the same engine, reached by another address: one connection
            with self._lock:
                self._by_address[address] = old
            return old
        try:
            self._open_rails(peer, timeout, credential)
        except BaseException:
            peer.close()
            raise
        with self._lock:
            old = self._peers.pop(peer.name, None)
            self._peers[peer.name] = peer
            self._by_address[address] = peer
            self._stack.callback(peer.close)
            busy = old is not None and any(x.peer is old for x in self._live.values())
            if old is not None and busy:
                self._retired.add(old)  # closed once its transfers are done
        if old is not None and not busy:
            old.close()
        return peer

    def _open_rails(self, peer: Peer, timeout: float, credential: Credential) -> None:
        errors: list[str] = []
        for name, transport in self._transports.items():
            info = peer.info.transports.get(name)
            if not info:
                continue
            rails = []
            try:
                if not transport.reachable(peer.meta):
                    continue
                for _ in range(max(1, transport.capabilities.default_rails)):
                    rails.append(transport.connect(peer.name, info, self._on_complete,
                                                   timeout, credential))
            except (TransferError, KeyError, TypeError, ValueError) as exc:
                for rail in rails:
                    rail.close()
                if not isinstance(exc, TransferError):  # the peer's entry is malformed
                    exc = ProtocolError(f"bad {name} metadata: {exc!r}"[:300],
                                        peer=peer.name)
                errors.append(f"{name}: {exc}")
                log.info("no %s rails to %s: %s", name, peer.name, exc)
                continue
            peer.rails[name] = rails
            peer.order.append(name)
        if not peer.order:
            raise ConnectError(f"no common transport ({'; '.join(errors) or 'none shared'})",
                               peer=peer.name, op="connect")

    def connect_name(self, name: str, timeout: float | None = None) -> Peer:
        """Looks ``name`` up in the registry and connects to its control endpoint."""
        self._check_open("connect")
        if self.membership is None:
            raise UnknownPeerError("not an endpoint, and no registry to resolve a name",
                                   peer=name, op="connect")
        record = self.membership.get(name, self.timeout if timeout is None else timeout)
        return self.connect(record.control, timeout)

    def peer_lost(self, name: str, reason: str = "peer lost") -> int:
        """Declares peer ``name`` gone (the registry calls this on leave or expiry).

        Its in-flight transfers fail at once with :class:`PeerLostError` (no fallback:
        every path to a lost peer is gone), its rails and control client close, and new
        transfers to it raise ``PeerLostError`` until :meth:`connect` succeeds again.
        Returns how many transfers were failed; unknown names are ignored.
        """
        with self._lock:
            peer = self._peers.get(name)
            if peer is None or self._closed:
                return 0
            live = [x for x in self._live.values() if x.peer is peer]
            self._counter.forget_peer(name)  # its partial transfers never complete
        failed = 0
        for xfer in live:
            with xfer.lock:
                del xfer.transports[1:]
                if xfer.remaining > 0:
                    xfer.error = xfer.error or PeerLostError(
                        f"peer lost: {reason}", peer=name, op=str(xfer.op),
                        transport=xfer.transports[0] if xfer.transports else None)
                    failed += 1
        self.stats["peers_lost"] += 1
        log.warning("peer %s lost (%s): failing %d transfers", name, reason, failed)
        peer.fail(reason)  # closing rails completes their pending work with our error
        return failed

    def peer(self, name: str) -> Peer:
        with self._lock:
            peer = self._peers.get(name)
        if peer is None:
            raise UnknownPeerError("no connected peer of that name", peer=name)
        return peer

    @property
    def peers(self) -> dict[str, Peer]:
        with self._lock:
            return dict(self._peers)

    def cut_peer(self, name: str, timeout: float = 5.0) -> bool:
        """Fences engine ``name`` off this engine's memory: its rail tickets are revoked
        and every rail it holds open here is closed, waiting up to ``timeout`` seconds
        for the requests being served on them to stop. Its transfers to us fail; to
        move more it must connect (say Hello) again. True once nothing it sent before
        can land here; False if a request of its was still being served at the timeout
        (call again). A store reuses a writer's space only after this (kvstore)."""
        self._check_open("cut")
        check_name(name)
        if not (isinstance(timeout, int | float) and math.isfinite(timeout) and timeout >= 0):
            raise ValueError(f"timeout must be a finite number of seconds >= 0, not {timeout!r}")
        began = time.monotonic()
        self._tickets.revoke_peer(name)
        done = Transport.cut_servers(self._transports.values(), name, float(timeout))
        if done:
            self._tickets.cut(name, began)
        return done

    def cut_covers(self, name: str, ticket: bytes) -> bool:
        """Whether a cut of engine ``name`` that stood (:meth:`cut_peer` returned True)
        came after rail ticket ``ticket`` was issued to it here: nothing sent on rails
        of that ticket can land any more. The ticket is what the peer's own engine calls
        :attr:`Peer.ticket`; False for one this engine does not know (any more)."""
        return isinstance(ticket, bytes) and self._tickets.cut_covers(name, ticket)
