"""The Transport and Rail interfaces every data path implements.

Protocol (who calls what, in which order):

1. The engine builds each transport, then calls ``start(host)`` once. The transport
   begins accepting peers and returns the endpoint info (a msgpack-able dict) that the
   engine publishes in its handshake metadata.
2. ``register(segment)`` for every segment the engine registers; the returned dict (the
   segment's keys for this transport: an RDMA rkey, nothing for TCP) travels with the
   segment's metadata. ``deregister(segment)`` when it closes.
3. To reach a peer the engine checks ``reachable(peer_meta)`` and calls
   ``connect(peer, info, on_complete, timeout, credential)`` once per rail it wants,
   with the ``info`` that peer published for this transport and the rail ticket its
   handshake issued (:mod:`~transfer_engine.control.tickets`). A target serves a rail
   only once it proved a ticket (``host.admit_rail``), and only as that ticket's peer.
4. The engine posts :class:`Work` with ``rail.post(work)``. A rail keeps the order of
   the work posted to it. ``on_complete`` is called exactly once per posted work, from
   a transport thread: with ``error=None`` once its bytes are in place at the
   destination (WRITE: in the peer's memory; READ: in ours), otherwise with a
   :class:`~transfer_engine.errors.TransferError`. Work that carries an immediate is
   counted by the peer (``host.deliver_immediate``) after its bytes, and those of all
   earlier work on the same rail, have landed.
5. Target side: a transport resolves incoming remote extents with
   ``host.local_segment(id)`` and :meth:`Segment.check`, pins the segment while bytes
   land, and never touches memory that failed the check.
6. To stop a transfer early (cancel, deadline, a segment closing) the engine calls
   ``rail.withdraw(works)``: work not yet sent is taken back and never completed by
   the rail; if some of it is already on the wire, the engine calls ``rail.abort``.
   When a segment cannot drain its pins, ``transport.revoke(segment)`` tears down what
   serves peers' requests on it.
7. ``close()`` closes every rail (their pending work fails with ``ClosedError``) and
   stops accepting. Closing twice is a no-op.
"""

from __future__ import annotations

import abc
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from transfer_engine.descriptor import Op
from transfer_engine.errors import PeerLostError

if TYPE_CHECKING:
    import numpy as np

    from transfer_engine.control.tickets import Credential, Ticket
    from transfer_engine.errors import TransferError
    from transfer_engine.planner import WorkRequest
    from transfer_engine.segment import Segment

__all__ = ["Capabilities", "Immediate", "Work", "Completion", "OnComplete", "Host",
           "Transport", "Rail", "TornDown"]


@dataclass(frozen=True, slots=True)
class Capabilities:
    """Facts the planner and the engine's transport choice need."""

    max_sge: int  # local extents per work request
    max_wr_bytes: int  # bytes per work request
    remote_scatter: bool  # may one work request land in several remote ranges?
    same_host_only: bool = False
    device_memory: bool = False  # can move cuda:N memory without host staging
    default_rails: int = 1
    slice_size: int = 1 << 20  # preferred work request size
    min_split: int = 64 << 10  # smallest share of a transfer worth a rail of its own


@dataclass(frozen=True, slots=True)
class Immediate:
    """The 'with immediate' part of a write: counted by the target after the bytes."""

    transfer_id: int
    expected: int  # immediates the target must see before notifying
    notify: bytes | None = None  # carried by one immediate per transfer
    # a later attempt's: the transfer id of the transfer's first attempt, so that the
    # target notifies once however many attempts land (notify.ImmediateCounter)
    first: int | None = None


@dataclass(slots=True)
class Work:
    """One posted work request, resolved for the rail."""

    wr_id: int
    op: Op
    local: Sequence[tuple[int, int, int]]  # (segment id, offset, length) extents, in order
    remote: Sequence[tuple[int, int, int]]
    nbytes: int
    imm: Immediate | None = None
    prepared: Any = None  # what the rail's Transport.prepare made of it; opaque elsewhere
    context: Any = None  # the engine's bookkeeping; transports leave it alone
    resent: bool = False  # posted again on another rail after its first one broke


@dataclass(frozen=True, slots=True)
class Completion:
    work: Work
    error: TransferError | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


OnComplete = Callable[[Completion], None]


class TornDown(PeerLostError):
    """A rail this side closed itself, its peer being fine: to stop one transfer (a
    cancel, a deadline; ``stopping`` is that transfer's id), or because a call on it
    was interrupted midway (Ctrl-C in a wait), which leaves its stream unusable. The
    other work it carried may be posted again, on a rail the transport reopens."""

    def __init__(self, message: str, *, stopping: int | None = None, **context: Any
                 ) -> None:
        super().__init__(message, **context)
        self.stopping = stopping


class Host(Protocol):
    """What a transport needs from the engine that owns it."""

    @property
    def name(self) -> str: ...

    @property
    def host_id(self) -> str: ...

    def local_segment(self, segment_id: int, *, peer: str | None = None,
                      op: str | None = None) -> Segment:
        """The open segment of that id, or raises ``InvalidDescriptorError``."""
        ...

    def deliver_immediate(self, peer: str, imm: Immediate, origin: bytes = b"",
                          work: int | None = None, resent: bool = False) -> None:
        """Counts one immediate of ``peer``'s; ``origin`` is the id of the rail ticket it
        came through (every rail of one connection shares it), ``work`` the id of the
        initiator's work request it came with, where the wire carries it, and
        ``resent`` whether the initiator sent that work before on another rail (it is
        then not counted again if its first arrival was)."""
        ...

    def admit_rail(self, ticket: object, transport: str, challenge: bytes, nonce: object,
                   proof: object) -> tuple[Ticket, bytes]:
        """Checks a rail's opening against the tickets this engine issued; returns the
        ticket (the rail is bound to its peer) and the answer proving our side.
        Raises ``AuthenticationError`` that discloses nothing."""
        ...

    def local_ranges(self) -> np.ndarray:
        """(address, length, writable) rows of this engine's open host segments, what
        a same-host rail announces to its target."""
        ...


class Rail(abc.ABC):
    """One independent ordered path to one peer (a TCP connection, an RDMA QP)."""

    __slots__ = ()

    @abc.abstractmethod
    def post(self, work: Work) -> None:
        """Queues ``work``; never blocks on the network. Raises ``ClosedError`` or
        ``PeerLostError`` at once when the rail is already down."""

    @abc.abstractmethod
    def close(self) -> None:
        """Fails pending work with ``ClosedError``, then releases the path. Idempotent."""

    def abort(self, error: TransferError) -> None:
        """Closes the rail because its peer is known to be gone: pending work completes
        with ``error`` (say, ``PeerLostError``) rather than ``ClosedError``. Idempotent;
        rails that cannot tell the two apart just close.

        Either way, a work completes only once this side no longer touches its local
        memory (no system call is still copying from or into it)."""
        self.close()

    def withdraw(self, works: Sequence[Work]) -> tuple[list[Work], bool]:
        """Takes back those of ``works`` this rail has not begun to send: it will never
        send nor complete them. Returns them, and whether any other of ``works`` may
        still be moving bytes (sent and not completed): then only :meth:`abort` stops
        them. The default takes nothing back and assumes work in flight unless the rail
        is closed."""
        return [], not self.closed

    def assist(self, works: Sequence[Work]) -> bool:
        """Lets the calling thread, which waits for ``works`` inside a held window
        (:mod:`~transfer_engine.transport.held`), take their completions itself
        without giving up the GIL; True if it took any. The default takes none: the
        completions come as they would."""
        return False

    def send_queued(self, works: Sequence[Work]) -> None:
        """Sends, in the calling thread (inside a held window), those of ``works`` still
        queued for a thread of the transport that has not begun them, so that only the
        peer's part is left before the caller decides to wait (:meth:`waits_only`).
        The default sends nothing: :meth:`assist` does what it can."""
        return None

    def waits_only(self, works: Sequence[Work]) -> bool:
        """Whether all that is left of ``works`` is the peer's to do: every request
        sent, and no byte for this side to move (the peer copies). A waiter may then
        let other threads have the GIL while the peer works (``held.Turn``). The
        default: not known, so no."""
        return False

    @property
    @abc.abstractmethod
    def closed(self) -> bool: ...

    @property
    @abc.abstractmethod
    def inflight(self) -> int:
        """Work posted and not yet completed."""

    def __enter__(self) -> Rail:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Transport(abc.ABC):
    """A way of moving bytes (tcp, shm, rdma). Opens rails to peers."""

    __slots__ = ()
    name: ClassVar[str]

    @abc.abstractmethod
    def start(self, host: Host) -> dict[str, Any]:
        """Starts accepting peers; returns the endpoint info peers need to connect."""

    @abc.abstractmethod
    def register(self, segment: Segment) -> dict[str, Any]:
        """Makes ``segment`` reachable; returns its keys for this transport. Raises
        ``RegistrationError`` (nothing stays registered)."""

    @abc.abstractmethod
    def deregister(self, segment: Segment) -> None: ...

    def revoke(self, segment: Segment) -> None:  # noqa: B027 (optional, not abstract)
        """Ends peers' access to ``segment`` now: requests being served on it are torn
        down mid-way (their connections closed) so that their pins drop. Called when
        :meth:`Segment.close` still finds pins after its wait; the segment already
        refuses new ones. A torn WRITE may leave a prefix of its bytes; its immediate
        is not counted. The default does nothing (a transport whose requests cannot
        stall)."""

    def cut(self, peer: str, timeout: float) -> bool:
        """Closes every rail ``peer`` holds open to us (its tickets are already revoked,
        and a rail admitted before that is refused) and waits up to ``timeout`` seconds
        for the requests being served on them to stop; True once nothing of ``peer``'s
        can land in our memory any more. The default cannot promise that: False."""
        return False

    @staticmethod
    def cut_servers(servers: Iterable[Any], peer: str, timeout: float) -> bool:
        """:meth:`cut` on each of ``servers`` that is not None, within one ``timeout``."""
        end = time.monotonic() + timeout
        done = True
        for server in servers:
            if server is not None:
                done = server.cut(peer, max(0.0, end - time.monotonic())) and done
        return done

    @abc.abstractmethod
    def reachable(self, peer_meta: dict[str, Any]) -> bool:
        """Whether a peer with this handshake metadata can be reached this way."""

    @abc.abstractmethod
    def connect(self, peer: str, info: dict[str, Any], on_complete: OnComplete,
                timeout: float | None = None, credential: Credential | None = None
                ) -> Rail:
        """Opens one rail to ``peer`` (``info`` is what the peer's ``start`` returned),
        proving it with ``credential``, the ticket the peer's handshake gave us.
        Raises ``ConnectError``, ``AuthenticationError`` or ``TransferTimeout``."""

    @property
    @abc.abstractmethod
    def capabilities(self) -> Capabilities: ...

    @abc.abstractmethod
    def close(self) -> None:
        """Closes every rail and stops accepting. Idempotent."""

    def prepare(self, request: WorkRequest, segments: Sequence[Segment]) -> Any:
        """Whatever this transport wants worked out for ``request`` (its local extents in
        ``segments``) before a rail posts it, done once per request on the caller's
        thread; the rail finds it as ``Work.prepared``. Nothing by default."""
        return None

    def carriers(self, rails: Sequence[Rail], segments: Sequence[Segment],
                 remote_ids: Iterable[int]) -> list[Rail]:
        """Those of a peer's open ``rails`` that can carry a transfer between local
        ``segments`` and the peer's segments ``remote_ids`` (a transport whose memory
        regions live on some NICs only picks those); all of them by default."""
        return list(rails)

    def reaches_device(self, rails: Sequence[Rail], segments: Sequence[Segment]) -> bool:
        """Whether ``rails`` move these local segments' device memory as it is, where
        ``capabilities.device_memory`` is False (shm's device IPC); else the engine
        stages it through host memory. False by default."""
        return False

    def revived(self, rail: Rail) -> Rail | None:
        """A rail this transport opened again on the path of the broken ``rail`` (a NIC
        whose link came back), handed over once for the engine to use in its place;
        None (the default) while there is none."""
        return None

    def info(self, key: str) -> Any:
        """Transport-specific facts (e.g. 'devices' for rdma); None when unknown."""
        return None

    def active(self, rails: Sequence[Rail]) -> int:
        """How many of a peer's ``rails`` carry transfers at once: each transfer starts
        on the least busy of the first so many. All of them unless a transport knows
        better."""
        return len(rails)

    def spread(self, rails: Sequence[Rail]) -> int:
        """Over how many of the :meth:`active` ``rails`` (least busy first) one transfer
        is cut; the rest serve concurrent transfers. All of them unless a transport
        knows better."""
        return len(rails)

    def __enter__(self) -> Transport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
