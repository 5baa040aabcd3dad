"""TCP transport: one-sided writes and reads over plain sockets.

Each rail is one TCP connection. The sender gathers a request's header, entries and
every source block into one ``sendmsg`` call; the target checks segment, bounds and
permission first and then receives the payload straight into the destination blocks
with one ``recvmsg(MSG_WAITALL)`` (scatter, no staging copy). Both scatter-gather lists
are iovec arrays built with NumPy (:mod:`~transfer_engine.transport.iovec`), so a
request of a thousand 4 KiB blocks costs a few array operations, not a Python object per
block. READ mirrors it. An immediate is counted by the target after its request's bytes
landed, and because a connection is ordered, after every earlier request on that rail
too: write-with-immediate, exactly.

Tuning, measured with ``bench/transfer_engine_bench.py`` on a 2-core host: requests of
up to 16 MiB (each costs a round of Python and thread wake-ups on both sides, and the
stream idles while the target turns to the next: 1 MiB x 16 READs ran at 6.2 GB/s in
one request, 5.8 in two, 5.1 in four, with 17% less CPU per GB than in four); a
transfer is spread over several rails only in shares of at least 1 MiB, and only over
as many rails as the host has cores to keep copying at once (:meth:`TcpTransport.spread`):
the kernel's copies are most of the CPU, and a loopback rail runs two of them. On 2
cores, 16 MiB transfers cut over two loopback rails ran 10-20% slower with 25% more CPU
per GB than on one. The same bound holds for concurrent transfers
(:meth:`TcpTransport.active`): a transfer starts on the least busy of that many rails,
so concurrent transfers spread over them while a lone caller stays on one warm
connection (alternating between idle connections measured up to 25% slower); the price
on a host with few cores is that a small transfer may queue behind a large one.

Congestion control: a rail whose two ends are on one host uses a loss-based algorithm
(cubic, else reno) in place of the host's default, on both ends: a model-based one such
as BBR throttles a stream whose receiver copies in long ``MSG_WAITALL`` calls (a raw
two-process stream: 3.1-4.2 GB/s under BBR, 5.3-7.1 under cubic or reno; the engine at
64 KiB x 128: 4.50 to 5.27 GB/s, 8% less CPU per GB). Rails to other hosts keep the
host's choice, the operator's for the real network, unless ``congestion`` names one.

NICs: with ``nics`` (or ``$TE_TCP_NICS``) the transport also listens on each chosen
NIC's address and opens each rail from one local NIC (its address bound as the source)
to the peer NIC the kernel routes it to, one rail per NIC pair; a transfer is cut over
all of them, each rail's share following its measured goodput, and the work of a rail
that breaks or stalls moves to the others (:mod:`~transfer_engine.transport.tcp_nics`).
"""

from __future__ import annotations

import functools
import logging
import os
import socket
from collections.abc import Callable, Sequence
from typing import Any, cast

import numpy as np

from transfer_engine import interrupts
from transfer_engine.control.auth import is_loopback
from transfer_engine.control.tickets import Credential
from transfer_engine.descriptor import Op
from transfer_engine.errors import (
    AuthenticationError,
    ClosedError,
    ConnectError,
    PeerLostError,
    TransferError,
    TransferTimeout,
)
from transfer_engine.planner import WorkRequest
from transfer_engine.segment import Segment
from transfer_engine.topology import Topology
from transfer_engine.transport.base import Capabilities, Host, OnComplete, Rail, Transport, Work
from transfer_engine.transport.iovec import Pace, host_rows
from transfer_engine.transport.reopen import Reopener
from transfer_engine.transport.stream import (
    KIND_READ,
    KIND_WRITE,
    STALL_TIMEOUT,
    Connection,
    StreamRail,
    StreamServer,
    Targets,
    drain,
    encode_request,
    open_rail,
    recv_scatter,
    send_bytes,
    send_gather,
    tune_socket,
)
from transfer_engine.transport.stream.io import Unsent
from transfer_engine.transport.stream.process import ServeProcess, serve_mode
from transfer_engine.transport.tcp_congestion import (  # noqa: F401 - public here too
    AUTO,
    LOOPBACK_CONGESTION,
    check_congestion,
    congestion_of,
    is_loopback_socket,
    set_congestion,
)
from transfer_engine.transport.tcp_nics import (
    NicEndpoint,
    Parking,
    RateMeter,
    StallWatch,
    local_nics,
    pair_nics,
)

__all__ = ["TcpTransport"]

log = logging.getLogger(__name__)

SOCKET_BUFFER = 4 << 20
MIN_SPLIT = 1 << 20  # smallest share of a transfer sent over a rail of its own
NIC_SLICE = 1 << 20  # request size on NIC rails (see TcpTransport's slice_size)
_TCP_USER_TIMEOUT = getattr(socket, "TCP_USER_TIMEOUT", None)  # Linux only


def _host_iov(work: Work) -> np.ndarray:
    # the rows TcpTransport.prepare made (none for a request that moves no bytes)
    iov: np.ndarray = work.prepared if work.prepared is not None \
        else np.empty((0, 2), np.uint64)
    return iov


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


class TcpRail(StreamRail):
    transport_name = "tcp"

    def __init__(self, sock: socket.socket, peer: str, index: int, on_complete: OnComplete,
                 host: Host, nic: str | None = None, gbps: float = 0.0) -> None:
        self.loopback = is_loopback_socket(sock)
        self.congestion = congestion_of(sock)
        self.nic = nic  # the local NIC this rail leaves from (None: as routed)
        self.meter = RateMeter(gbps) if nic is not None else None
        # set by the transport on NIC rails: moves work off this rail when it breaks
        self.failover: Callable[[TcpRail, Work, TransferError], TransferError | None
                                ] | None = None
        super().__init__(sock, peer, index, on_complete, host)

    @property
    def weight(self) -> float:
        """Share of a transfer the planner gives this rail: its measured goodput."""
        return self.meter.gbps if self.meter is not None else 1.0

    def _complete(self, work: Work, error: TransferError | None) -> None:
        if self.meter is not None:
            self.meter.done(id(work), work.nbytes, error is None)
        # Only a connection that broke by itself fails over: a rail the engine tore
        # down (a cancel, a lost peer) or closed must fail its work, not move it.
        if (isinstance(error, PeerLostError) and self.failover is not None
                and not self._torn_down and not self._closed):
            error = self.failover(self, work, error)
            if error is None:
                return  # another NIC's rail carries it now
        super()._complete(work, error)

    def settle(self, work: Work, error: TransferError) -> None:
        """Fails ``work``, parked after this rail broke, without moving it again."""
        super()._complete(work, error)

    def stall(self, reason: str) -> None:
        """Fails this NIC rail as a broken connection would: its work moves to the
        peer's other NIC rails (see :class:`~.tcp_nics.StallWatch`)."""
        log.warning("NIC rail %s->%s#%d: %s", self.nic, self.peer, self.index, reason)
        self._fail_all(self._error(PeerLostError, f"NIC {self.nic} stalled: {reason}"))

    def _send_request(self, work: Work, spill: bool = False) -> Unsent | None:
        if self.meter is not None:
            self.meter.started(id(work), work.nbytes)
        if work.op is Op.WRITE:
            return send_gather(self._sock, encode_request(KIND_WRITE, work),
                               _host_iov(work), work.nbytes, spill=spill)
        send_bytes(self._sock, encode_request(KIND_READ, work))
        return None

    def _take_read(self, work: Work) -> None:
        recv_scatter(self._sock, _host_iov(work), work.nbytes, patient=True,
                     pace=Pace(self.stall_timeout))

    def _payload_follows(self, work: Work) -> bool:
        return work.nbytes > 0


class TcpServer(StreamServer):
    transport_name = "tcp"

    def __init__(self, listener: socket.socket, host: Host, buffer_bytes: int,
                 congestion: str | None = AUTO, stall_timeout: float = STALL_TIMEOUT
                 ) -> None:
        self._congestion = congestion  # before the acceptor starts
        super().__init__(listener, host, buffer_bytes, stall_timeout)

    def tune(self, sock: socket.socket) -> None:
        super().tune(sock)
        set_congestion(sock, self._congestion)

    def land(self, conn: Connection, views: Targets, local: np.ndarray | None) -> None:
        recv_scatter(conn.sock, views.iov, views.nbytes, pace=Pace(self._stall))

    def stream_rows(self, views: Targets) -> np.ndarray | None:
        return views.iov

    def serve(self, conn: Connection, wr_id: int, views: Targets,
              local: np.ndarray | None) -> None:
        send_gather(conn.sock, self._answer(wr_id, None), views.iov, views.nbytes,
                    views.headroom, pace=Pace(self._stall))

    def refuse_write(self, conn: Connection, nbytes: int) -> None:
        drain(conn.sock, nbytes, Pace(self._stall))


class TcpTransport(Transport):
    """TCP rails; the default when nothing better reaches a peer.

    :param host: address to accept rails on (IPv4 or IPv6 literal or name).
    :param port: port to accept on; 0 picks a free one.
    :param rails: connections opened per peer (default 2), or per NIC pair with
        ``nics`` (default 1: two flows through one shaped link measured up to 10%
        slower than one, see ``bench/lab_bench.py``).
    :param slice_size: bytes per work request (the planner's slice bound); default
        16 MiB, or 1 MiB with ``nics``: shares by measured goodput need requests small
        enough to split a transfer unevenly.
    :param buffer_bytes: SO_SNDBUF/SO_RCVBUF per connection (0 keeps the kernel's).
    :param spread: most rails one transfer is cut over (default: what the cores allow,
        see :meth:`spread`).
    :param congestion: TCP congestion control of the rails, on both ends: ``"auto"``
        (a loss-based algorithm for rails within one host, the host's default for the
        others; see the module's notes), None (the host's default everywhere), or an
        algorithm's name for every rail (``"cubic"``, ``"bbr"``, ...; ValueError if the
        host refuses it).
    :param stall_timeout: longest pause the target allows inside a request or an
        answer before it drops the rail (an idle rail stays).
    :param nics: NICs to open rails from and listen on: ``"auto"`` (every active NIC
        of the topology with an address), NIC names, or None (``$TE_TCP_NICS``; unset:
        none, rails leave as routed).
    :param topology: where the NICs are (default: :func:`transfer_engine.topology.load`,
        i.e. ``$TE_TOPOLOGY_FILE`` or sysfs).
    :param serve: where peers' requests are served: ``"thread"`` (threads of this
        process) or ``"process"`` (a serving process of its own, which moves the bytes
        while this process's threads are busy in Python; see
        :mod:`.stream.process` and docs/data-plane.md). Default: ``$TE_SERVE`` or
        ``"thread"``. ``"process"`` does not combine with ``nics`` yet.
    :param nic_timeout: seconds a NIC rail's sent bytes may stay unacknowledged before
        the kernel drops its connection (``TCP_USER_TIMEOUT``): a NIC whose link went
        down is noticed then, and the rail's unfinished work moves to the peer's other
        NIC rails (a WRITE lands the same bytes at the same place again; a READ reads
        them again). A NIC rail that holds work ``nic_timeout`` seconds past its due
        time at its measured goodput while another is open (a lossy or silent NIC, link
        up) is failed so.
    :param nic_retry: seconds between tries to open a broken NIC rail's pair again
        while the peer has another NIC rail open (or work waits for one); the engine
        takes the new rail at its next transfer to the peer.
    :param nic_wait: seconds the work of a peer whose every NIC rail broke waits for one
        of its NIC pairs to open again (tried at once, then every ``nic_retry``), to be
        posted there; then, or at once when the peer refuses the connection (it is
        gone), it fails with ``PeerLostError``. Default ``max(nic_timeout, 3 *
        nic_retry)``; 0 fails it at once.
    """

    name = "tcp"

    def __init__(self, host: str = "127.0.0.1", port: int = 0, rails: int | None = None,
                 slice_size: int | None = None, buffer_bytes: int = SOCKET_BUFFER,
                 spread: int | None = None, congestion: str | None = AUTO,
                 stall_timeout: float = STALL_TIMEOUT,
                 nics: str | Sequence[str] | None = None,
                 topology: Topology | None = None, nic_timeout: float = 5.0,
                 nic_retry: float = 1.0, nic_wait: float | None = None,
                 serve: str | None = None) -> None:
        self._serve = serve = serve_mode(serve)
        if spread is not None and spread < 1:
            raise ValueError("spread must be at least 1")
        if not stall_timeout > 0:
            raise ValueError("stall_timeout must be positive")
        self._stall = stall_timeout
        check_congestion(congestion)
        self._congestion = congestion
        self._bind = (host, port)
        self._spread = spread
        self._cores = _cores()  # read once: spread() runs on every transfer
        self._buffer_bytes = buffer_bytes
        self._nics: list[NicEndpoint] = local_nics(nics, topology)
        self._nic_pairs: dict[str, list[tuple[NicEndpoint, tuple[str, int], float]]] = {}
        self._nic_next: dict[str, int] = {}
        self._nic_groups: dict[str, list[TcpRail]] = {}  # peer key -> its NIC rails
        if not nic_timeout > 0:
            raise ValueError("nic_timeout must be positive")
        self._nic_timeout = nic_timeout
        self._reopener: Reopener[TcpRail] = Reopener("tcp", nic_retry)
        self._parking = Parking("tcp", max(nic_timeout, 3 * nic_retry)
                                if nic_wait is None else nic_wait)
        self._stalls: StallWatch | None = None  # started with the first NIC rail
        self.failovers = 0
        self._caps = Capabilities(max_sge=1000, max_wr_bytes=64 << 20, remote_scatter=True,
                                  default_rails=(rails or 1) * len(self._nics)
                                  if self._nics else (rails or 2),
                                  slice_size=slice_size or (
                                      NIC_SLICE if self._nics else 16 << 20),
                                  min_split=MIN_SPLIT)
        if serve == "process" and self._nics:
            raise ValueError("serve='process' does not combine with nics")
        self._server: TcpServer | None = None
        self._process: ServeProcess | None = None
        self._nic_servers: list[TcpServer] = []
        self._host: Host | None = None
        self._rails: list[TcpRail] = []
        self._closed = False

    @property
    def capabilities(self) -> Capabilities:
        return self._caps

    def prepare(self, request: WorkRequest, segments: Sequence[Segment]) -> np.ndarray:
        """The request's local extents as ``(address, length)`` rows (host memory: the
        engine sends this transport nothing else)."""
        return host_rows(request, segments)

    def start(self, host: Host) -> dict[str, Any]:
        if is_loopback(self._bind[0]):
            # the loopback-unless-secret rule was applied to our own address: NIC
            # listeners on other addresses would serve where the engine may not
            exposed = [n.name for n in self._nics if not is_loopback(n.address)]
            if exposed:
                raise ValueError(f"tcp NICs {exposed} would serve beyond loopback while "
                                 f"the transport serves {self._bind[0]!r}: serve the "
                                 "engine on a NIC address (with a control secret)")
        self._host = host
        addr = socket.getaddrinfo(self._bind[0], self._bind[1], type=socket.SOCK_STREAM)[0]
        listener = socket.socket(addr[0], socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(addr[4])
        bound = listener.getsockname()
        if self._serve == "process":

            def rebind() -> socket.socket:  # the address peers know, for a new process
                again = socket.socket(addr[0], socket.SOCK_STREAM)
                try:
                    again.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                    again.bind(bound)
                except OSError:
                    again.close()
                    raise
                return again

            try:
                self._process = ServeProcess("tcp", listener, host,
                                             stall_timeout=self._stall,
                                             buffer_bytes=self._buffer_bytes,
                                             congestion=self._congestion, rebind=rebind)
                return {"host": bound[0], "port": bound[1]}
            except ClosedError as exc:
                log.warning("%s; serving tcp from threads of this process instead", exc)
                self._serve = "thread"
        listener.listen(128)
        self._server = TcpServer(listener, host, self._buffer_bytes, self._congestion,
                                 self._stall)
        info: dict[str, Any] = {"host": bound[0], "port": bound[1]}
        if self._nics:
            info["nics"] = [nic.to_wire(self._nic_listener(nic, bound)) for nic in self._nics]
        return info

    def _nic_listener(self, nic: NicEndpoint, main: tuple[Any, ...]) -> int:
        """Accepts rails on ``nic``'s address too; returns the port (the main one where
        the main listener covers the address or the port is free there)."""
        if nic.address == main[0] or main[0] in ("0.0.0.0", "::"):
            return int(main[1])
        assert self._host is not None
        listener = socket.socket(socket.AF_INET6 if ":" in nic.address else socket.AF_INET,
                                 socket.SOCK_STREAM)
        try:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                listener.bind((nic.address, main[1]))
            except OSError:
                listener.bind((nic.address, 0))
            listener.listen(128)
        except OSError:
            listener.close()
            raise
        self._nic_servers.append(TcpServer(listener, self._host, self._buffer_bytes,
                                           self._congestion, self._stall))
        return int(listener.getsockname()[1])

    def register(self, segment: Segment) -> dict[str, Any]:
        if self._process is not None:
            self._process.register(segment)
        return {}

    def deregister(self, segment: Segment) -> None:
        if self._process is not None:
            self._process.deregister(segment)

    def reachable(self, peer_meta: dict[str, Any]) -> bool:
        return "tcp" in peer_meta.get("transports", {})

    def connect(self, peer: str, info: dict[str, Any], on_complete: OnComplete,
                timeout: float | None = 10.0, credential: Credential | None = None
                ) -> Rail:
        if self._closed or self._host is None:
            raise ClosedError("transport is closed", peer=peer, transport=self.name)
        key, nic = self._next_pair(peer, info)
        try:
            target = nic[1] if nic else (str(info["host"]), int(info["port"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise ConnectError(f"peer published no usable tcp endpoint: {info!r:.120}",
                               peer=peer, op="connect", transport=self.name) from exc
        return self._open(peer, key, nic, target, on_complete, timeout, credential)

    def _open(self, peer: str, key: str,
              nic: tuple[NicEndpoint, tuple[str, int], float] | None,
              target: tuple[str, int], on_complete: OnComplete, timeout: float | None,
              credential: Credential | None) -> TcpRail:
        """Opens one rail to ``target`` (from ``nic``'s local address, if any)."""
        if self._closed or self._host is None:
            raise ClosedError("transport is closed", peer=peer, transport=self.name)
        try:
            sock = socket.create_connection(target, timeout=timeout,
                                            source_address=(nic[0].address, 0) if nic
                                            else None)
        except TimeoutError as exc:
            raise TransferTimeout(f"connecting to {target} timed out", peer=peer,
                                  op="connect", transport=self.name) from exc
        except OSError as exc:
            raise ConnectError(f"cannot connect to {target}: {exc}", peer=peer,
                               op="connect", transport=self.name) from exc
        try:
            tune_socket(sock, self._buffer_bytes)
            set_congestion(sock, self._congestion)
            if nic is not None and _TCP_USER_TIMEOUT is not None:
                sock.setsockopt(socket.IPPROTO_TCP, _TCP_USER_TIMEOUT,
                                int(self._nic_timeout * 1000))
            with interrupts.blocking():  # the peer may not answer
                open_rail(sock, credential, self.name, timeout)
        except AuthenticationError as exc:
            sock.close()
            raise exc.with_context(peer=peer, op="connect", transport=self.name) from None
        except Exception as exc:
            sock.close()
            raise ConnectError(f"rail handshake with {target} failed: {exc}", peer=peer,
                               op="connect", transport=self.name) from exc
        except BaseException:  # Ctrl-C
            sock.close()
            raise
        rail = TcpRail(sock, peer, len(self._rails), on_complete, self._host,
                       nic[0].name if nic else None, nic[2] if nic else 0.0)
        rail.stall_timeout = self._stall
        self._rails.append(rail)
        rail.reopen = functools.partial(self._open, peer, key, nic, target, on_complete,
                                        timeout, credential)
        if nic is not None:
            group = self._nic_groups.setdefault(key, [])
            group[:] = [r for r in group if not r.closed] + [rail]
            rail.failover = functools.partial(self._failover, key, group)
            if self._stalls is None:
                self._stalls = StallWatch(self.name, lambda: list(
                    self._nic_groups.values()), self._nic_timeout)
            self._parking.take(key, rail)  # work that waited for a NIC rail to reopen
        return rail

    def revived(self, rail: Rail) -> Rail | None:
        """The rail that reopened ``rail``'s NIC pair after its link came back, once; for
        a rail this side tore down (a cancel, a deadline, an interrupted call), a new
        connection to the same peer with the same ticket, opened now, once. (A peer
        known lost takes no transfer: its rails are never reopened here.)"""
        again = self._reopener.revived(rail)
        if again is not None or not isinstance(rail, StreamRail):
            return again
        return rail.reopened()

    def _failover(self, key: str, group: list[TcpRail], broken: TcpRail, work: Work,
                  error: TransferError) -> TransferError | None:
        """Posts ``work`` from a broken NIC rail on the least busy open sibling, else
        parks it until one of the group's NIC pairs opens again; the error to fail it
        with when neither takes it."""
        for other in sorted((r for r in list(group) if r is not broken and not r.closed),
                            key=lambda r: r.inflight):
            work.resent = True  # its immediate may have been counted already
            try:
                other.post(work)
            except TransferError:
                continue
            self.failovers += 1
            log.info("NIC rail %s->%s#%d broke (%s): its work moved to %s#%d", broken.nic,
                     broken.peer, broken.index, error.message, other.nic, other.index)
            self._reopen_later(key, group, broken)
            return None
        failed = sorted({str(r.nic) for r in group})
        lost = PeerLostError(f"no NIC rail to the peer is left ({', '.join(failed)} "
                             f"failed): {error.message}", peer=broken.peer,
                             op=str(work.op), transport=self.name)
        parked = self._parking.park(key, broken, work, lost)
        for rail in list(group):  # every broken pair, tried at once while work waits
            if rail.closed or rail is broken:
                self._reopen_later(key, group, rail, soon=parked)
        return None if parked else lost

    def _reopen_later(self, key: str, group: list[TcpRail], broken: TcpRail,
                      soon: bool = False) -> None:
        """Has ``broken``'s NIC pair opened again in the background while another rail
        of its group is open (the peer is still in use) or work waits for one."""
        if broken.reopen is not None and not broken.torn_down:  # those: on demand
            self._reopener.schedule(
                broken, functools.partial(self._reopen, key, broken.reopen),
                lambda: any(not r.closed for r in group) or self._parking.waiting(key),
                soon=soon)

    def _reopen(self, key: str, reopen: Callable[[], Rail]) -> TcpRail:
        try:
            return cast(TcpRail, reopen())  # a TcpRail's reopen is this transport's _open
        except ConnectError as exc:
            if isinstance(exc.__cause__, ConnectionRefusedError):
                self._parking.fail(key, "the peer refused a new connection")
            raise

    def _next_pair(self, peer: str, info: dict[str, Any]
                   ) -> tuple[str, tuple[NicEndpoint, tuple[str, int], float] | None]:
        """(peer key, the NIC pair of the next rail to ``peer``, round robin); no pair
        without NICs on either side (or when the kernel routes none)."""
        remote = info.get("nics")
        key = f"{peer}|{remote!r}"  # a peer that restarted elsewhere pairs afresh
        if not self._nics or not isinstance(remote, list):
            return key, None
        pairs = self._nic_pairs.get(key)
        if pairs is None:
            pairs = self._nic_pairs[key] = pair_nics(self._nics, remote)
        if not pairs:
            return key, None
        k = self._nic_next.get(key, 0)
        self._nic_next[key] = k + 1
        return key, pairs[k % len(pairs)]

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._reopener.close()
        self._parking.close(lambda lost: ClosedError(
            "transport closed while the work waited for a NIC rail", **lost.context()))
        if self._stalls is not None:
            self._stalls.close()
        for rail in self._rails:
            rail.close()
        self._rails.clear()
        self._nic_groups.clear()
        if self._server is not None:
            self._server.close()
        if self._process is not None:
            self._process.close()
        for server in self._nic_servers:
            server.close()
        self._nic_servers.clear()

    def spread(self, rails: Sequence[Rail]) -> int:
        """As many rails as this host has cores to copy at once: a loopback rail keeps
        two of them busy (sender and receiver), a rail to another host one."""
        if self._spread is not None:
            return max(1, min(len(rails), self._spread))
        if rails and getattr(rails[0], "nic", None) is not None:
            return len(rails)  # one rail per NIC pair: the wires bound it, not the cores
        # a peer's rails all join the same two endpoints: the first tells for all
        per_rail = 2 if rails and getattr(rails[0], "loopback", False) else 1
        return max(1, min(len(rails), self._cores // per_rail))

    def active(self, rails: Sequence[Rail]) -> int:
        """As many as one transfer is cut over: the cores bound the copies of concurrent
        transfers as they bound a single one's (on 2 cores, two threads moving 64 KiB x
        128 over one loopback rail measured 4.55 GB/s and 0.40 CPU s/GB, against 3.06
        and 0.60 over two)."""
        return self.spread(rails)

    def revoke(self, segment: Segment) -> None:
        for server in (self._process, *self._servers()):
            if server is not None:
                server.revoke(segment)

    def cut(self, peer: str, timeout: float) -> bool:
        return self.cut_servers((self._process, *self._servers()), peer, timeout)

    def _servers(self) -> list[TcpServer]:
        return ([self._server] if self._server is not None else []) + self._nic_servers

    def info(self, key: str) -> Any:
        if key in ("bytes_received", "server_stats") and self._process is not None:
            got = self._process.stats()
            return got["bytes_received"] if key == "bytes_received" else got["stats"]
        if key == "serve":
            return self._serve
        if key == "serve_pid":
            return self._process.pid if self._process is not None else None
        if key == "bytes_received" and self._server is not None:
            return sum(s.bytes_received for s in self._servers())
        if key == "nics":
            return [nic.name for nic in self._nics]
        if key == "server_stats" and self._server is not None:
            return dict(self._server.stats)
        return None
