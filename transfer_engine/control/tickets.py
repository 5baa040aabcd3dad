"""Rail tickets: how a data-plane connection proves it belongs to a handshaken peer.

The control handshake (``Hello`` -> ``Welcome``) is where a peer proves itself: with a
control secret every message is signed (:mod:`~transfer_engine.control.auth`); without
one, only processes that reach the loopback control endpoint can take part. A rail
(a TCP connection, a Unix socket, an RDMA side channel) is a separate connection, so the
target hands the initiator a *ticket* in its ``Welcome``: a random id and a 32-byte key.

- With a secret, the key never travels: both sides derive it as
  ``HMAC(secret, "te-rail-key" | ticket id | target | initiator)``. Someone who sees the
  ``Welcome`` learns the id and nothing he can use.
- Without one, the key travels in the ``Welcome`` (the control plane then serves
  loopback only, unless the operator opted in to more).

A rail opens with a challenge-response that costs one round trip and nothing per byte::

    target    -> initiator: CHALLENGE = magic(4) nonce(32)
    initiator -> target   : ticket id, client nonce, proof = HMAC(key, "c" | transport |
                            nonce | client nonce)
    target    -> initiator: HMAC(key, "s" | transport | nonce | client nonce)

The target then binds the rail to the ticket's peer: every request and notification on
it is that peer's, whatever names its messages carry. A fresh nonce per connection
makes a recorded opening useless; the target's answer proves to the initiator that it
talks to the engine it handshook with. The book of tickets is bounded (oldest dropped
first, a few per peer name), and so is the number of rails one ticket may hold open.
"""

from __future__ import annotations

import collections
import hashlib
import hmac
import os
import threading
import time
from dataclasses import dataclass, field
from typing import TypeGuard

from transfer_engine.errors import AuthenticationError

__all__ = ["Ticket", "TicketBook", "Credential", "MAX_NAME", "valid_name", "check_name",
           "CHALLENGE_MAGIC", "CHALLENGE_BYTES", "rail_key", "client_proof", "server_proof",
           "new_challenge"]

MAX_NAME = 1024  # characters in an engine's name: every ticket, rail and relay carries it
CHALLENGE_MAGIC = b"TEr4"
CHALLENGE_BYTES = len(CHALLENGE_MAGIC) + 32
ID_BYTES = 16
KEY_BYTES = 32


def valid_name(name: object) -> TypeGuard[str]:
    """Whether ``name`` can name an engine: a non-empty string of at most
    :data:`MAX_NAME` characters (a peer's is checked at its hello, which is refused)."""
    return isinstance(name, str) and 0 < len(name) <= MAX_NAME


def check_name(name: object) -> str:
    """``name`` if :func:`valid_name`, else ``ValueError``."""
    if not valid_name(name):
        raise ValueError(f"an engine's name is a string of 1 to {MAX_NAME} characters, "
                         f"not {str(name)[:64]!r}{'...' if len(str(name)) > 64 else ''}")
    return str(name)


def rail_key(secret: bytes, ticket_id: bytes, target: str, initiator: str) -> bytes:
    """The ticket's key as both sides derive it from the shared control secret."""
    msg = b"te-rail-key\0" + ticket_id + target.encode() + b"\0" + initiator.encode()
    return hmac.digest(secret, msg, hashlib.sha256)


def _proof(tag: bytes, key: bytes, transport: str, challenge: bytes, nonce: bytes) -> bytes:
    return hmac.digest(key, tag + transport.encode() + b"\0" + challenge + nonce,
                       hashlib.sha256)


def client_proof(key: bytes, transport: str, challenge: bytes, nonce: bytes) -> bytes:
    """What the initiator sends: it holds the ticket's key."""
    return _proof(b"te-rail-c\0", key, transport, challenge, nonce)


def server_proof(key: bytes, transport: str, challenge: bytes, nonce: bytes) -> bytes:
    """What the target answers: it holds the same key (it issued the ticket)."""
    return _proof(b"te-rail-s\0", key, transport, challenge, nonce)


def new_challenge() -> bytes:
    return CHALLENGE_MAGIC + os.urandom(CHALLENGE_BYTES - len(CHALLENGE_MAGIC))


@dataclass(frozen=True, slots=True)
class Credential:
    """The initiator's side of a ticket: what it needs to open rails to one peer."""

    ticket: bytes
    key: bytes

    def opening(self, transport: str, challenge: bytes) -> tuple[bytes, bytes]:
        """``(client nonce, proof)`` answering ``challenge``."""
        nonce = os.urandom(32)
        return nonce, client_proof(self.key, transport, challenge, nonce)

    def check_answer(self, transport: str, challenge: bytes, nonce: bytes,
                     answer: bytes) -> None:
        """Raises unless the target proved it holds the key."""
        expect = server_proof(self.key, transport, challenge, nonce)
        if not hmac.compare_digest(expect, answer):
            raise AuthenticationError("the rail's target did not prove the ticket's key",
                                      transport=transport, op="connect")

    @classmethod
    def from_welcome(cls, wire: object, secret: bytes | None, target: str,
                     initiator: str) -> Credential:
        """Reads the ticket a ``Welcome`` carries (raises ``AuthenticationError``)."""
        if not isinstance(wire, dict):
            raise AuthenticationError("the peer issued no rail ticket", peer=target,
                                      op="connect")
        ticket, key = wire.get("id"), wire.get("key")
        if not isinstance(ticket, bytes) or len(ticket) != ID_BYTES:
            raise AuthenticationError("malformed rail ticket", peer=target, op="connect")
        if secret:
            key = rail_key(secret, ticket, target, initiator)
        elif not isinstance(key, bytes) or len(key) != KEY_BYTES:
            raise AuthenticationError("rail ticket without a key (does the peer sign with "
                                      "a control secret we lack?)", peer=target,
                                      op="connect")
        return cls(ticket, key)


@dataclass(eq=False)
class Ticket:
    """The target's record of one ticket."""

    id: bytes
    peer: str
    key: bytes
    pid: int  # the process the handshake named (checked against SO_PEERCRED on shm)
    rails: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    book: TicketBook | None = field(default=None, repr=False)

    def release(self) -> None:
        """A rail bound to this ticket closed."""
        with self.lock:
            if self.rails <= 0:
                return
            self.rails -= 1
        if self.book is not None:
            self.book._released(self.peer)


class TicketBook:
    """Tickets this engine issued; thread-safe and bounded.

    :param secret: the control secret (keys are derived from it), or None (random keys,
        sent in the ``Welcome``).
    :param target: this engine's name (part of the derived key).
    :param max_tickets: tickets kept at most; the oldest go first.
    :param per_peer: tickets kept per peer name (a reconnecting peer gets a new one).
    :param max_rails: rails one ticket may hold open at once; a peer name holds at most
        ``per_peer * max_rails`` whatever its tickets (those of tickets the book has
        dropped since count too).
    """

    def __init__(self, secret: bytes | None, target: str, max_tickets: int = 4096,
                 per_peer: int = 4, max_rails: int = 64) -> None:
        self._secret = secret or None
        self._target = target
        self._max = max_tickets
        self._per_peer = per_peer
        self.max_rails = max_rails
        self._tickets: collections.OrderedDict[bytes, Ticket] = collections.OrderedDict()
        self._by_peer: dict[str, collections.deque[bytes]] = {}
        self._rails_of: collections.Counter[str] = collections.Counter()  # by peer name
        self._lock = threading.Lock()
        self.refused = 0
        # when each ticket was issued (longer than the book keeps it), and when the last
        # cut of each peer that stood began: what cut_covers answers from
        self._issued: collections.OrderedDict[bytes, tuple[str, float]] = (
            collections.OrderedDict())
        self._cuts: collections.OrderedDict[str, float] = collections.OrderedDict()

    def issue(self, peer: str, pid: int = 0) -> dict[str, bytes]:
        """A new ticket for ``peer``; returns its wire form for the ``Welcome``."""
        ticket_id = os.urandom(ID_BYTES)
        if self._secret is not None:
            key, wire = rail_key(self._secret, ticket_id, self._target, peer), {
                "id": ticket_id}
        else:
            key = os.urandom(KEY_BYTES)
            wire = {"id": ticket_id, "key": key}
        with self._lock:
            self._tickets[ticket_id] = Ticket(ticket_id, peer, key, pid, book=self)
            self._issued[ticket_id] = (peer, time.monotonic())
            while len(self._issued) > 4 * self._max:
                self._issued.popitem(last=False)
            ids = self._by_peer.setdefault(peer, collections.deque())
            ids.append(ticket_id)
            while len(ids) > self._per_peer:
                self._tickets.pop(ids.popleft(), None)
            while len(self._tickets) > self._max:
                old = self._tickets.popitem(last=False)[1]
                self._forget(old)
        return wire

    def _forget(self, ticket: Ticket) -> None:
        ids = self._by_peer.get(ticket.peer)
        if ids is not None:
            try:
                ids.remove(ticket.id)
            except ValueError:
                pass
            if not ids:
                del self._by_peer[ticket.peer]

    def admit(self, ticket_id: object, transport: str, challenge: bytes, nonce: object,
              proof: object) -> tuple[Ticket, bytes]:
        """Checks a rail's opening; returns the ticket (its rail count taken) and the
        answer to send. Raises ``AuthenticationError`` that says nothing more."""
        refused = AuthenticationError("rail refused", transport=transport, op="connect")
        if not (isinstance(ticket_id, bytes) and isinstance(nonce, bytes)
                and isinstance(proof, bytes) and len(nonce) == 32):
            self.refused += 1
            raise refused
        with self._lock:
            ticket = self._tickets.get(ticket_id)
        if ticket is None or not hmac.compare_digest(
                client_proof(ticket.key, transport, challenge, nonce), proof):
            self.refused += 1
            raise refused
        with self._lock:
            held = self._rails_of[ticket.peer]
            if held >= self.max_rails * self._per_peer:
                self.refused += 1
                raise AuthenticationError(f"peer holds {held} rails already",
                                          peer=ticket.peer, transport=transport,
                                          op="connect")
            with ticket.lock:
                if ticket.rails >= self.max_rails:
                    self.refused += 1
                    raise AuthenticationError(f"peer holds {ticket.rails} rails already",
                                              peer=ticket.peer, transport=transport,
                                              op="connect")
                ticket.rails += 1
            self._rails_of[ticket.peer] += 1
        return ticket, server_proof(ticket.key, transport, challenge, nonce)

    def _released(self, peer: str) -> None:
        with self._lock:
            left = self._rails_of[peer] - 1
            if left > 0:
                self._rails_of[peer] = left
            else:
                del self._rails_of[peer]

    def revoke_peer(self, peer: str) -> None:
        """Drops every ticket of ``peer`` (rails already open stay bound)."""
        with self._lock:
            for ticket_id in self._by_peer.pop(peer, ()):
                self._tickets.pop(ticket_id, None)

    def cut(self, peer: str, began: float) -> None:
        """A cut of ``peer`` that began at ``began`` (``time.monotonic()``) stood: every
        rail it had open here was closed and no request of it was still served."""
        with self._lock:
            self._cuts[peer] = max(began, self._cuts.pop(peer, began))
            while len(self._cuts) > self._max:
                self._cuts.popitem(last=False)

    def cut_covers(self, peer: str, ticket_id: bytes) -> bool:
        """Whether a cut of ``peer`` that stood began after ticket ``ticket_id`` was
        issued to it (False for a ticket not known, or not known any more)."""
        with self._lock:
            issued = self._issued.get(ticket_id)
            cut = self._cuts.get(peer)
        return issued is not None and issued[0] == peer and cut is not None \
            and issued[1] < cut

    def __len__(self) -> int:
        with self._lock:
            return len(self._tickets)
