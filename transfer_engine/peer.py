"""The engine's view of another engine: what its handshake said, rails per transport,
health."""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import zmq

from transfer_engine.control.auth import Signer
from transfer_engine.control.messages import SegmentsReply, SegmentsRequest
from transfer_engine.control.request import SignedClient
from transfer_engine.control.tickets import MAX_NAME, valid_name
from transfer_engine.errors import InvalidDescriptorError, PeerLostError, ProtocolError
from transfer_engine.health import PeerHealth
from transfer_engine.segment import RemoteSegment

if TYPE_CHECKING:
    from transfer_engine.transport.base import Rail

__all__ = ["Peer", "PeerInfo", "ControlClient"]


class ControlClient(SignedClient):
    """A DEALER socket to a peer's control endpoint; one request at a time. With
    ``auth`` every request is signed and every reply must be (``AuthenticationError``
    otherwise, naming the side that lacks or mismatches the secret); a timeout raises
    ``TransferTimeout``, a refusal ``RemoteError``."""

    def __init__(self, zctx: zmq.Context[Any], address: str, peer: str,
                 auth: Signer | None = None) -> None:
        super().__init__(zctx, address, auth, peer=peer)


def _field(meta: Mapping[str, Any], key: str, kind: type | tuple[type, ...],
           default: Any, what: str) -> Any:
    value = meta.get(key, default)
    if not isinstance(value, kind) or isinstance(value, bool) and kind is int:
        name = meta.get("name")
        raise ProtocolError(f"peer metadata field {key!r} is of type "
                            f"{type(value).__name__}, not {what}",
                            peer=name[:200] if isinstance(name, str) and name else None)
    return value


@dataclass(frozen=True)
class PeerInfo:
    """What a peer's handshake says of it (``Engine.metadata`` on its side), checked
    once: a field of the wrong type is a ``ProtocolError`` naming it, not a crash
    wherever it is first read. Each transport's own entry in ``transports`` is checked
    by that transport when it connects."""

    name: str
    incarnation: str
    host_id: str
    hostname: str
    pid: int
    control: str
    pod: str
    zone: str
    transports: Mapping[str, dict[str, Any]]
    segments: list[Any]

    @classmethod
    def from_wire(cls, meta: Any) -> PeerInfo:
        if not isinstance(meta, Mapping):
            raise ProtocolError(f"peer metadata is a {type(meta).__name__}, not a map")
        name = _field(meta, "name", str, "", "a string")
        if not valid_name(name):
            raise ProtocolError(f"peer metadata without a name of 1 to {MAX_NAME} "
                                "characters")
        transports = _field(meta, "transports", dict, {}, "a map")
        for key, value in transports.items():
            if not isinstance(key, str) or not isinstance(value, dict):
                raise ProtocolError(f"peer metadata: transport {str(key)[:64]!r} is "
                                    "not a name with a map", peer=name)
        return cls(name, _field(meta, "incarnation", str, "", "a string"),
                   _field(meta, "host_id", str, "", "a string"),
                   _field(meta, "hostname", str, "", "a string"),
                   _field(meta, "pid", int, 0, "an integer"),
                   _field(meta, "control", str, "", "a string"),
                   _field(meta, "pod", str, "", "a string"),
                   _field(meta, "zone", str, "", "a string"), transports,
                   _field(meta, "segments", list, [], "a list"))


class Peer:
    """A connected engine. Made by :meth:`Engine.connect`; closed by the engine.

    ``info`` is its checked handshake metadata; ``meta`` the same as it came, for
    transports and traffic policies that read their own keys of it."""

    def __init__(self, meta: dict[str, Any], client: ControlClient,
                 timeout: float = 10.0) -> None:
        self.info = PeerInfo.from_wire(meta)
        self.name: str = self.info.name
        self.meta = meta
        self.rails: dict[str, list[Rail]] = {}
        self.order: list[str] = []  # transports in preference order, best first
        self.failures: dict[str, int] = {}
        self.health = PeerHealth([])  # filled as rails open (order.append)
        self._health_lock = threading.Lock()  # completions arrive on several threads
        self.lost: str | None = None  # why the peer was declared lost (Engine.peer_lost)
        # the rail ticket's id (not its key): the peer's Engine.cut_covers takes it
        self.ticket = b""
        self._client = client
        self._timeout = timeout
        self._segments: dict[str, RemoteSegment] = {}
        self._by_id: dict[int, RemoteSegment] = {}
        self._set_segments(self.info.segments)
        self._closed = False

    def _set_segments(self, wire: list[dict[str, Any]]) -> None:
        try:
            segs = [RemoteSegment.from_wire(self.name, s) for s in wire]
        except (KeyError, TypeError, ValueError) as exc:
            raise ProtocolError(f"bad segment metadata: {exc}", peer=self.name) from exc
        self._segments = {s.name: s for s in segs}
        self._by_id = {s.id: s for s in segs}

    @property
    def transport(self) -> str | None:
        """The transport new transfers use (best one not demoted)."""
        return self.order[0] if self.order else None

    @property
    def control_address(self) -> str:
        """The peer's control endpoint (where it answers probes)."""
        return self._client.address

    @property
    def segments(self) -> dict[str, RemoteSegment]:
        return dict(self._segments)

    def refresh(self) -> None:
        """Asks the peer for its current segments."""
        reply = self._client.request(SegmentsRequest(""), self._timeout)
        if not isinstance(reply, SegmentsReply):
            raise ProtocolError(f"expected segments, got {reply.kind}", peer=self.name)
        self._set_segments(reply.segments)

    def segment(self, name: str) -> RemoteSegment:
        """The peer's segment called ``name`` (asks the peer if we do not know it)."""
        seg = self._segments.get(name)
        if seg is None:
            self.refresh()
            seg = self._segments.get(name)
        if seg is None:
            raise InvalidDescriptorError("peer has no segment of that name", peer=self.name,
                                         segment=name)
        return seg

    def succeeded(self, transport: str, latency: float) -> None:
        """A transfer over ``transport`` completed in ``latency`` seconds (feeds the
        health EWMA and ends a re-probe)."""
        with self._health_lock:
            self.health.add(transport)
            self.health.record_success(transport, latency)

    def demote(self, transport: str) -> None:
        """Moves ``transport`` behind the others after it failed (a transfer failed over);
        it is re-probed later (:meth:`reprobe`)."""
        with self._health_lock:
            self.failures[transport] = self.failures.get(transport, 0) + 1
            self.health.add(transport)
            self.health.record_failure(transport, force=True)
            if transport in self.order and len(self.order) > 1:
                self.order.remove(transport)
                self.order.append(transport)

    def reprobe(self) -> list[str]:
        """Moves demoted transports whose re-probe delay has passed back to the front, so
        that the next transfer tries them (a failure demotes them again, for twice as
        long). Transports whose rails are closed stay behind. Returns those moved."""
        moved = []
        for name in self.health.due():
            rails = self.rails.get(name) or []
            if not rails or any(rail.closed for rail in rails) or name not in self.order:
                self.health.record_failure(name)  # stays demoted, longer
                continue
            moved.append(name)
        if moved:
            rest = [t for t in self.order if t not in moved]
            self.order[:] = [t for t in self.health.order() if t in moved] + rest
        return moved

    def fail(self, reason: str) -> None:
        """Marks the peer lost: no transport is offered any more and its rails close,
        their pending work completing with ``PeerLostError``. Idempotent."""
        if self.lost is None:
            self.lost = reason
        self.order.clear()
        if self._closed:
            return
        for name, rails in self.rails.items():
            for rail in rails:
                rail.abort(PeerLostError(f"peer lost: {reason}", peer=self.name,
                                         transport=name))
        self.close()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for rails in self.rails.values():
            for rail in rails:
                rail.close()
        self._client.close()

    def __repr__(self) -> str:
        rails = ",".join(f"{t}x{len(r)}" for t, r in self.rails.items())
        return (f"<Peer {self.name!r} via {self.transport} rails=[{rails}] "
                f"segments={len(self._segments)}>")
