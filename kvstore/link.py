"""A client's link to the kvstore master: signed requests over one DEALER, pipelined.

The master answers a client's requests in the order they were sent, so a request need
not wait for the answers of those before it: a put that does not wait for its commit
:meth:`MasterLink.post`-s it, and its answer is handed to its callback before the answer
of any later request is read (or at :meth:`MasterLink.drain`). A request the master does
not answer in time raises :class:`MasterUnavailableError` and fails every posted one
with it, since the socket is reset and nothing sent before comes back; a refusal raises
:class:`StoreError`.

The master is named by its endpoint (``tcp://host:7400``), or by the etcd that names it
(``etcd://h1:2379[,h2:2379...][/prefix]``): masters started with ``--etcd`` campaign for
the role ``kvstore-master`` there, and the one that leads publishes its endpoint
(:mod:`transfer_engine.control.etcd_leader`). A link to such a master looks the leader
up again when the master goes silent (:meth:`MasterLink.follow`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from kvstore.errors import MasterUnavailableError, StoreError
from transfer_engine.control.auth import Signer
from transfer_engine.control.etcd_client import ETCD_SCHEME
from transfer_engine.control.etcd_leader import leader_of
from transfer_engine.control.messages import Message
from transfer_engine.control.request import SignedClient
from transfer_engine.errors import TransferEngineError

__all__ = ["MASTER_ROLE", "MasterLink", "locate_master", "moved_master"]

MASTER_ROLE = "kvstore-master"


def locate_master(master: str, timeout: float = 5.0) -> str:
    """The endpoint to reach the master at: ``master`` itself, or the endpoint that the
    leading master published in the etcd that ``master`` names."""
    if not master.startswith(ETCD_SCHEME):
        return master
    try:
        address = leader_of(master, MASTER_ROLE, timeout)
    except TransferEngineError as exc:
        raise MasterUnavailableError(f"no kvstore master found through {master}: "
                                     f"{exc}") from exc
    host, _, port = address.removeprefix("tcp://").rpartition(":")
    if not address.startswith("tcp://") or not host or not port.isdigit() \
            or not 0 < int(port) < 65536:
        raise MasterUnavailableError(f"no kvstore master found through {master}: it names "
                                     f"{address[:200]!r}, not a tcp://HOST:PORT endpoint")
    return address


def moved_master(master: str, current: str, timeout: float = 5.0) -> str | None:
    """After the master at ``current`` went silent: the endpoint of another master that
    leads now, if ``master`` names the master through etcd and one does; else None.
    Raises ``MasterUnavailableError`` when etcd names no leader."""
    if not master.startswith(ETCD_SCHEME):
        return None
    address = locate_master(master, timeout)
    return address if address != current else None


OnReply = Callable[[Message | Exception], None]


class MasterLink(SignedClient):
    """One DEALER socket to the master. Requests are answered in the order sent: one
    waited for at a time, after those :meth:`post`-ed before it, whose answers go to
    their callbacks first. Not thread-safe: the caller serialises its use."""

    def __init__(self, master: str, signer: Signer | None) -> None:
        self.master = master
        address = locate_master(master)

        def timed_out(op: str, timeout: float) -> Exception:
            return MasterUnavailableError(f"no answer from the master at {self.address} "
                                          f"in {timeout}s to {op}")

        def refused(op: str, reason: str) -> Exception:
            return StoreError(f"the master refused {op}: {reason}")

        super().__init__(None, address, signer, peer="kvstore-master",
                         name="kvstore master link", ipv6=False, timeout_error=timed_out,
                         refused_error=refused)
        self._posted: deque[tuple[Message, OnReply]] = deque()

    def follow(self, timeout: float = 5.0) -> bool:
        """After the master went silent: True if another master leads now (the link is
        pointed at it, and anything posted to the old one fails); False if the master
        is named by its endpoint, or still leads."""
        try:
            address = moved_master(self.master, self.address, timeout)
        except MasterUnavailableError:
            return False
        if address is None:
            return False
        lost = list(self._posted)
        self._posted.clear()
        moved = MasterUnavailableError(f"the master moved from {self.address} to {address}")
        for _, on_reply in lost:
            on_reply(moved)
        self.retarget(address)
        return True

    def request(self, msg: Message, timeout: float,
                between: Callable[[], None] | None = None) -> Message:
        """Sends ``msg`` and returns its answer; ``between`` runs while the master works
        on it (its exception is raised once the answer is read, which would otherwise
        pair with the next request). Unanswered because another master took over
        (:meth:`follow`), it is asked once more of the new one, unless work already ran
        ``between`` sending and answer."""
        try:
            return self._request(msg, timeout, between)
        except MasterUnavailableError:
            if not self.follow(min(timeout, 5.0)) or between is not None:
                raise
            return self._request(msg, timeout, None)

    def _request(self, msg: Message, timeout: float,
                 between: Callable[[], None] | None) -> Message:
        self.send(msg)
        error: BaseException | None = None
        if between is not None:
            try:
                between()
            except BaseException as exc:
                error = exc
        self.drain(timeout)
        reply = self._answer(msg, timeout)
        if error is not None:
            raise error
        return reply

    def post(self, msg: Message, on_reply: OnReply) -> None:
        """Sends a request without waiting: ``on_reply`` gets its answer (or the error
        that stood for it) when a later request is answered, or at :meth:`drain`."""
        self.send(msg)
        self._posted.append((msg, on_reply))

    def drain(self, timeout: float) -> None:
        """Takes the answers of every posted request."""
        while self._posted:
            msg, on_reply = self._posted.popleft()
            try:
                reply: Message | Exception = self._answer(msg, timeout)
            except MasterUnavailableError as exc:
                on_reply(exc)
                raise  # the socket was reset: nothing sent before comes back
            except StoreError as exc:
                reply = exc
            on_reply(reply)

    def _answer(self, msg: Message, timeout: float) -> Message:
        try:
            return self.receive(msg.kind, timeout)
        except MasterUnavailableError as exc:
            lost = list(self._posted)
            self._posted.clear()
            for _, on_reply in lost:
                on_reply(exc)
            raise
