"""The RDMA transport: devices, memory registration, the side channel's server,
rails to peers and the completions of every NIC.
"""

from __future__ import annotations

import collections
import functools
import itertools
import logging
import os
import socket
import threading
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, cast

from transfer_engine import topology
from transfer_engine.control.tickets import (
    CHALLENGE_MAGIC,
    Credential,
)
from transfer_engine.errors import (
    AuthenticationError,
    ClosedError,
    ConnectError,
    NotSupportedError,
    PeerLostError,
    ProtocolError,
    TransferError,
    TransferTimeout,
)
from transfer_engine.segment import Segment
from transfer_engine.transport.base import (
    Capabilities,
    Host,
    Immediate,
    OnComplete,
    Rail,
    Transport,
)
from transfer_engine.transport.cuts import Cuts
from transfer_engine.transport.rdma.inbound import _RECV_BIT, _Inbound
from transfer_engine.transport.rdma.placement import (
    MrTable,
    RouteSettings,
    memory_location,
    placement_of,
)
from transfer_engine.transport.rdma.plan import (
    ImmUnwrapper,
    MrKey,
    QpInfo,
    WcOpcode,
    decode_imm,
    negotiate_mtu,
    random_psn,
    stripe_pairs,
    unpack_notify,
)
from transfer_engine.transport.rdma.rail import WORK_PIECES, RdmaRail
from transfer_engine.transport.rdma.side import (
    _keys_from_wire,
    _recv_frame,
    _send_frame,
)
from transfer_engine.transport.rdma.side_server import SideServer
from transfer_engine.transport.rdma.verbs import Device
from transfer_engine.transport.reopen import Reopener

log = logging.getLogger(__name__)

_SEEN_MAX = 1 << 16  # (transfer, origin rail) pairs remembered for de-duplication
PROVIDERS = ("pyverbs", "emulated")


class RdmaTransport(SideServer, Transport):
    """RDMA rails over RC queue pairs (pyverbs).

    :param devices: NIC names (``"mlx5_0,mlx5_1"`` or a list); None takes every device
        with an active port.
    :param rails_per_nic: queue pairs per NIC pair that ``default_rails`` asks for.
    :param host: address the side channel listens on (the engine passes its own, so
        without a control secret it is loopback unless opted in); ``advertise``: the
        address peers dial (default: ``host``, or this host's name for a wildcard).
    :param port: side-channel port; 0 picks a free one.
    :param gid_index: GID table index (RoCE needs the right one); None picks one.
    :param traffic_class / service_level: a global route's traffic class and the
        service level of every queue pair (see ``placement.RouteSettings``; None reads
        ``$TE_RDMA_TRAFFIC_CLASS`` / ``$TE_RDMA_SERVICE_LEVEL``, default 0).
    :param placement: ``"nearest"`` registers a segment on the NICs nearest its memory
        (``nic_topology``, default ``topology.load()``), ``"all"`` on every NIC; None
        reads ``$TE_RDMA_PLACEMENT``, default ``"nearest"``.
    :param slice_size: bytes per work request the planner aims for.
    :param max_notify: largest notification payload in bytes.
    :param sq_depth / recv_depth: send / receive queue entries per QP.
    :param cq_depth: completion queue entries per NIC (capped by the device). Every QP
        reserves its queues' worth (``sq_depth + 1`` for a rail, ``recv_depth + 1``
        for a peer's rail to us), so a rail that would let it overrun is refused.
    :param relaxed_ordering: register memory with relaxed PCIe ordering when supported.
    :param provider: ``"pyverbs"`` (a real NIC) or ``"emulated"`` (the user-space
        provider of ``emulated``, for machines without one); None reads
        ``$TE_RDMA_PROVIDER``, default ``"pyverbs"``. Peers only pair with the same
        provider, and emulated ones only on the same host.
    :param emulated_copy: with the emulated provider, whether bytes really move (False:
        a counting device that checks and completes everything and copies nothing).
    """

    name = "rdma"

    def __init__(self, devices: str | list[str] | None = None, rails_per_nic: int = 2,
                 host: str = "127.0.0.1", port: int = 0, advertise: str | None = None,
                 gid_index: int | None = None, slice_size: int = 16 << 20,
                 max_notify: int = 4096, sq_depth: int = 1024, recv_depth: int = 256,
                 notify_slots: int = 64, relaxed_ordering: bool = True,
                 poll_interval: float = 0.2, provider: str | None = None,
                 emulated_copy: bool = True, cq_depth: int = 1 << 16,
                 traffic_class: int | None = None, service_level: int | None = None,
                 placement: str | None = None,
                 nic_topology: topology.Topology | None = None) -> None:
        provider = provider or os.environ.get("TE_RDMA_PROVIDER") or "pyverbs"
        if provider not in PROVIDERS:
            raise NotSupportedError(f"unknown RDMA provider {provider!r}; known: "
                                    f"{list(PROVIDERS)}", transport="rdma")
        self.provider = provider
        self.placement = placement_of(placement)
        self.route = RouteSettings.resolve(gid_index, traffic_class, service_level)
        names = devices.split(",") if isinstance(devices, str) else devices
        kwargs: dict[str, Any] = {"route": self.route, "cq_depth": cq_depth,
                                  "relaxed_ordering": relaxed_ordering,
                                  "on_wc": self._on_wc, "poll_interval": poll_interval}
        if provider == "emulated":
            from transfer_engine.transport.rdma import emulated_device as emu  # noqa: PLC0415

            kwargs.update(copy=emulated_copy, on_event=self._on_device_event)
            self._devices: list[Any] = list(emu.open_devices(names, **kwargs))
        else:
            from transfer_engine.transport.rdma import verbs as rdma_verbs  # noqa: PLC0415

            rdma_verbs.import_pyverbs()  # NotSupportedError with the reason and remedy
            self._devices = list(rdma_verbs.open_devices(names, **kwargs))
        self._by_name = {d.name: d for d in self._devices}
        self._topology = nic_topology or topology.load()  # placement and link rates
        for dev in self._devices:
            nic = self._topology.nic(dev.name)
            dev.link_rate_gbps = nic.link_rate_gbps if nic else 0.0
        self._side_socks: set[socket.socket] = set()
        self.rails_per_nic, self.slice_size = rails_per_nic, slice_size
        self.max_notify, self.sq_depth, self.recv_depth = max_notify, sq_depth, recv_depth
        self.notify_slots = notify_slots
        self._bind, self._advertise = (host, port), advertise
        self._host: Host | None = None
        self._listener: socket.socket | None = None
        self._acceptor: threading.Thread | None = None
        self._lock = threading.Lock()
        self._wr_ids = itertools.count(1)
        self._wr_owner: dict[int, RdmaRail] = {}
        self._peer_rails: dict[str, list[RdmaRail]] = {}
        self._inbound: dict[tuple[str, int], _Inbound] = {}
        self.cuts = Cuts()
        self._side_locks: dict[int, threading.Lock] = {}
        self._regions = MrTable(self._devices)
        self._unwrap = ImmUnwrapper()
        self._seen: collections.OrderedDict[tuple[str, bytes, int, int], None] = (
            collections.OrderedDict())
        self._peer_failures: collections.Counter[str] = collections.Counter()
        self._dead: set[str] = set()  # devices lost to an asynchronous event
        self._rail_numbers: collections.Counter[str] = collections.Counter()
        self._reopener: Reopener[RdmaRail] = Reopener("rdma", retry=0.2, max_tries=300)
        self._closed = False

    # --- Transport interface ----------------------------------------------------------

    @functools.cached_property
    def capabilities(self) -> Capabilities:
        # One engine work becomes as many verbs requests as it has remote ranges (SGE
        # lists packed by ``build_work_requests``), so a work may scatter remotely and
        # hold many extents: all of them are checked against the target's keys before
        # any is posted, and they share one doorbell.
        return Capabilities(
            max_sge=min(WORK_PIECES, self.sq_depth - 1),
            max_wr_bytes=min(d.max_msg_size for d in self._devices),
            remote_scatter=True, device_memory=self.provider == "pyverbs",
            default_rails=self.rails_per_nic * len(self._devices),
            slice_size=self.slice_size)

    def start(self, host: Host) -> dict[str, Any]:
        self._host = host
        listener = socket.create_server(self._bind, reuse_port=False)
        self._listener = listener
        self._acceptor = threading.Thread(target=self._accept_loop,
                                          name="te-rdma-side-accept", daemon=True)
        self._acceptor.start()
        addr = self._advertise or (self._bind[0] if self._bind[0] not in ("0.0.0.0", "::")
                                   else socket.getfqdn())
        info: dict[str, Any] = {"devices": [d.name for d in self._devices],
                                "endpoint": f"tcp://{addr}:{listener.getsockname()[1]}"}
        if self.provider != "pyverbs":  # absent for pyverbs: older peers pair unchanged
            info["provider"] = self.provider
            info["host_id"] = host.host_id
        return info

    def register(self, segment: Segment) -> dict[str, Any]:
        devices = self._devices
        if self.placement == "nearest" and len(devices) > 1:
            where = memory_location(segment.address, segment.length, segment.device)
            names = set(topology.nearest_nics(self._topology, where,
                                              [d.name for d in devices]))
            devices = [d for d in devices if d.name in names]
        return {"mrs": self._regions.register(segment, devices)}

    def deregister(self, segment: Segment) -> None:
        self._regions.deregister(segment.id)

    def carriers(self, rails: Sequence[Rail], segments: Sequence[Segment],
                 remote_ids: Iterable[int]) -> list[Rail]:
        """The rails whose NICs hold the regions of both sides. Where none does, the
        local segments are registered on the NICs of rails that reach the peer's
        regions, once (logged); where no rail reaches them, all rails (the transfer
        then fails on the unregistered remote segment, naming it)."""
        ids, remote = [s.id for s in segments], list(remote_ids)
        if not all(isinstance(r, RdmaRail) for r in rails):
            return list(rails)
        ours = cast("list[RdmaRail]", list(rails))
        holds = self._regions.holds
        both: list[Rail] = [r for r in ours if holds(r.device.name, ids)
                            and r.holds_remote(remote)]
        if both or not ours:
            return both
        reach = [r for r in ours if r.holds_remote(remote)]
        for dev in {r.device.name: r.device for r in reach}.values():
            log.info("rdma: registering %s on %s too: the peer's memory is reached "
                     "from there", [s.name for s in segments], dev.name)
            for seg in segments:
                self._regions.extend(seg, dev)
        both = [r for r in reach if self._regions.holds(r.device.name, ids)]
        return both or list(rails)

    def reachable(self, peer_meta: dict[str, Any]) -> bool:
        info = peer_meta.get("transports", {}).get("rdma")
        if not (info and info.get("devices") and info.get("endpoint")):
            return False
        if info.get("provider", "pyverbs") != self.provider:
            return False  # a real NIC and an emulated one share no fabric
        return self.provider == "pyverbs" or (
            self._host is not None and info.get("host_id") == self._host.host_id)

    def connect(self, peer: str, info: dict[str, Any], on_complete: OnComplete,
                timeout: float | None = 10.0, credential: Credential | None = None,
                pair: tuple[int, int] | None = None) -> RdmaRail:
        """A rail to ``peer`` on the next NIC pair (``pair``: these NIC indexes)."""
        if self._closed or self._host is None:
            raise ClosedError("transport is closed or not started", peer=peer,
                              transport="rdma", op="connect")
        if credential is None:
            raise AuthenticationError("no rail ticket: connect through the engine's "
                                      "handshake", peer=peer, transport="rdma",
                                      op="connect")
        remote_devs = list(info.get("devices") or [])
        endpoint = str(info.get("endpoint", ""))
        if not remote_devs or not endpoint.startswith("tcp://"):
            raise ConnectError(f"peer published no rdma devices/endpoint: {info!r:.120}",
                               peer=peer, transport="rdma", op="connect")
        with self._lock:
            # never reused, even after a rail closed: the target counts immediates
            # per (transfer, rail index), so two live rails must not share one
            index = self._rail_numbers[peer]
            self._rail_numbers[peer] += 1
            self._peer_rails.setdefault(peer, [])
        li, ri = pair or stripe_pairs(len(self._devices), len(remote_devs), index)
        dev, remote_dev = self._devices[li], str(remote_devs[ri])
        hostport = endpoint[len("tcp://"):].rsplit(":", 1)
        qp = dev.create_qp(send_wr=self.sq_depth, recv_wr=1, send_sge=dev.max_sge)
        psn = random_psn()
        try:
            sock = socket.create_connection((hostport[0].strip("[]"), int(hostport[1])),
                                            timeout=timeout)
        except TimeoutError as exc:
            dev.destroy_qp(qp)
            raise TransferTimeout(f"side channel {endpoint} timed out", peer=peer,
                                  transport="rdma", op="connect") from exc
        except OSError as exc:
            dev.destroy_qp(qp)
            raise ConnectError(f"cannot reach side channel {endpoint}: {exc}", peer=peer,
                               transport="rdma", op="connect") from exc
        try:
            sock.settimeout(timeout)
            challenge = _recv_frame(sock, peer).get("challenge")
            if not isinstance(challenge, bytes) or not challenge.startswith(CHALLENGE_MAGIC):
                raise ProtocolError("the side channel sent no challenge", peer=peer,
                                    transport="rdma")
            nonce, proof = credential.opening("rdma", challenge)
            _send_frame(sock, {"kind": "connect", "rail": index, "device": remote_dev,
                               "ticket": credential.ticket, "nonce": nonce, "proof": proof,
                               "qp": dev.qp_info(qp, psn).to_wire()})
            reply = _recv_frame(sock, peer)
            answer = reply.get("proof")
            credential.check_answer("rdma", challenge, nonce,
                                    answer if isinstance(answer, bytes) else b"")
            sock.settimeout(None)
            theirs = QpInfo.from_wire(reply.get("qp"), peer)
            dev.connect_qp(qp, psn, theirs, negotiate_mtu(dev.mtu, theirs.mtu), peer=peer)
            keys = _keys_from_wire(reply.get("segments", {}))
        except TransferError as exc:
            sock.close()
            dev.destroy_qp(qp)
            exc.with_context(peer=peer, op="connect", transport="rdma")
            raise
        except OSError as exc:
            sock.close()
            dev.destroy_qp(qp)
            raise ConnectError(f"rdma handshake failed: {exc}", peer=peer,
                               transport="rdma", op="connect") from exc
        rail = RdmaRail(self, peer, index, dev, remote_dev, qp, sock, keys, on_complete)
        with self._lock:
            self._peer_rails[peer].append(rail)
            self._side_locks[id(rail)] = threading.Lock()
        rail.reopen = functools.partial(self._reopen, rail, peer, info, on_complete, timeout,
                                        credential, (li, ri))
        return rail

    def _reopen(self, broken: RdmaRail, *args: Any) -> RdmaRail:
        rail = self.connect(*args)
        broken.close()
        return rail

    def rail_failed(self, rail: RdmaRail) -> None:
        """Has a failed rail's NIC pair opened again in the background, while the
        peer's side channel is up: a queue pair in error stays in error, whatever put it
        there (a refused key, a path that broke), and without this each such error
        would leave the peer one rail fewer for good."""
        if self._closed or rail.reopen is None or rail.device.name in self._dead:
            return
        self._reopener.schedule(rail, rail.reopen, lambda: not self._closed and (
            rail.device.name not in self._dead and rail.side_alive()))

    def revived(self, rail: Rail) -> Rail | None:
        return self._reopener.revived(rail)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._reopener.close()
        with self._lock:
            rails = [r for rs in self._peer_rails.values() for r in rs]
            inbound = list(self._inbound.values())
        for rail in rails:
            rail.close()
        if self._listener is not None:
            try:  # close() alone does not wake a thread blocked in accept()
                self._listener.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self._listener.close()
        if self._acceptor is not None:
            self._acceptor.join(timeout=5)
        with self._lock:
            socks = list(self._side_socks)
        for sock in socks:
            try:
                sock.shutdown(socket.SHUT_RDWR)  # wakes the threads serving them
            except OSError:
                pass
        for dev in self._devices:
            dev.stop()  # pollers first: nothing touches a QP being destroyed
        for conn in inbound:
            conn.close()
        self._regions.close()
        for dev in self._devices:
            dev.close()

    def spread(self, rails: Sequence[Rail]) -> int:
        """One rail per NIC pair carries a transfer: a second queue pair on the same
        NICs adds no bandwidth to it, only more requests to post and complete; the
        other rails carry concurrent transfers."""
        pairs = {(getattr(r, "device", None), getattr(r, "remote_device", None))
                 for r in rails}
        return max(1, min(len(rails), len(pairs)))

    def emulated_nics(self) -> list[Any]:
        """The emulated provider's NICs (``emulated.Nic``: counters, ``copy``,
        ``fail``); empty on pyverbs."""
        return [d.nic for d in self._devices if hasattr(d, "nic")]

    def info(self, key: str) -> Any:
        if key == "devices":
            return [d.name for d in self._devices]
        if key == "peer_failures":
            return dict(self._peer_failures)
        if key == "stripe_weights":
            return [d.link_rate_gbps or 1.0 for d in self._devices]
        return None

    def __repr__(self) -> str:
        state = "CLOSED" if self._closed else "OPEN"
        return (f"<RdmaTransport devices={[d.name for d in self._devices]} "
                f"rails={sum(map(len, self._peer_rails.values()))} {state}>")

    # --- helpers the rails use --------------------------------------------------------

    def local_keys(self, device: str) -> dict[int, MrKey]:
        return self._regions.local_keys(device)

    def new_wr_id(self, rail: RdmaRail) -> int:
        wr_id = next(self._wr_ids)
        self._wr_owner[wr_id] = rail
        return wr_id

    @contextmanager
    def side_lock(self, rail: RdmaRail) -> Iterator[None]:
        with self._side_locks.setdefault(id(rail), threading.Lock()):
            yield

    def defer(self, device: Device, fn: Any, *args: Any) -> None:
        device.call_soon(fn, *args)

    def sibling(self, rail: RdmaRail) -> RdmaRail | None:
        """An open rail to the same peer for a failed one's work: one on a live NIC
        other than the failed rail's first (its NIC may be what failed)."""
        with self._lock:
            rails = [r for r in self._peer_rails.get(rail.peer, [])
                     if r is not rail and not r.closed and r.device.name not in self._dead]
        rails.sort(key=lambda r: (r.device is rail.device, r.remote_device
                                  == rail.remote_device, r.inflight))
        return rails[0] if rails else None

    def _on_device_event(self, device: Any, kind: int) -> None:
        """An asynchronous event of a NIC (its completion thread): a lost device or an
        overrun completion queue fails every rail on it, whose work moves to rails on
        other NICs; later rails avoid it."""
        log.error("rdma device %s: asynchronous event %d; its rails fail over",
                  device.name, kind)
        with self._lock:
            self._dead.add(device.name)
            rails = [r for rs in self._peer_rails.values() for r in rs
                     if r.device is device and not r.closed]
        for rail in rails:
            rail.fail(PeerLostError(f"rdma device {device.name} failed", peer=rail.peer,
                                    transport="rdma"))

    def forget_wr_ids(self, wr_ids: list[int]) -> None:
        for wr_id in wr_ids:
            self._wr_owner.pop(wr_id, None)

    def note_failure(self, peer: str) -> None:
        self._peer_failures[peer] += 1

    def forget_rail(self, rail: RdmaRail) -> None:
        with self._lock:
            rails = self._peer_rails.get(rail.peer, [])
            if rail in rails:
                rails.remove(rail)
            self._side_locks.pop(id(rail), None)

    # --- completions (poller threads) -------------------------------------------------

    def _on_wc(self, device: Device, wc: Any) -> None:
        if wc.wr_id & _RECV_BIT:
            self._on_recv(device, wc)
            return
        rail = self._wr_owner.pop(wc.wr_id, None)
        if rail is not None:
            rail.on_wc(wc.wr_id, wc.status, wc.vendor_err)

    def _on_recv(self, device: Device, wc: Any) -> None:
        key, index = (wc.wr_id & ~_RECV_BIT) >> 20, wc.wr_id & 0xFFFFF
        conn = device.inbound(key)
        if conn is None or wc.status != 0:
            return  # a flushed receive of a failed or closing QP: never re-posted
        try:
            if wc.opcode == WcOpcode.RECV_RDMA_WITH_IMM:
                wrapped, expected = decode_imm(socket.ntohl(wc.imm_data))
                with self._lock:
                    tid = self._unwrap.full_id(conn.peer, wrapped)
                self._deliver(conn.peer, tid, expected, conn.rail, None, conn.origin)
            else:
                data = conn.payload(index, min(wc.byte_len, conn.slot))
                tid, expected, origin, payload, first = unpack_notify(data, conn.peer)
                with self._lock:
                    self._unwrap.observe(conn.peer, tid)
                self._deliver(conn.peer, tid, expected, origin, payload, conn.origin, first)
        except TransferError as exc:
            log.warning("dropped a malformed rdma immediate from %s: %s", conn.peer, exc)
        finally:
            conn.post_recv(index)

    def _deliver(self, peer: str, tid: int, expected: int, origin: int,
                 payload: bytes | None, ticket: bytes = b"", first: int | None = None
                 ) -> None:
        seen = (peer, ticket, tid, origin)  # per connection, as the engine counts
        with self._lock:  # one poller thread per NIC: they share this table
            if seen in self._seen:
                return  # the same rail's immediate again, after a retry elsewhere
            self._seen[seen] = None
            if len(self._seen) > _SEEN_MAX:
                self._seen.popitem(last=False)
        if self._host is not None:
            self._host.deliver_immediate(peer, Immediate(tid, expected, payload, first),
                                         ticket)
