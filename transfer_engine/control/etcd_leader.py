"""One leader for a role, kept in etcd: who serves as the store's master, and where.

A candidate holds the key ``<prefix>/leaders/<role>`` under a lease of ``ttl`` seconds,
taken only while the key is absent (a transaction on its create revision), with its
endpoint as the value. It renews the lease every ttl/3. A leader that cannot renew
(killed, frozen, cut off) loses the key when the lease runs out, and a standby's next
attempt takes it. The leader learns of its own loss no later than etcd does: it counts
the lease from the moment it *sent* its last successful renewal, and gives up at 0.9 of
the lease, so two leaders never serve at once on their own clocks' say.

Followers (the store's nodes and clients) read the key (:func:`leader_of`) when they
start and whenever their leader goes silent.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from transfer_engine.control.etcd_client import (
    EtcdClient,
    b64,
    key_prefix,
    parse_etcd_address,
    unb64,
)
from transfer_engine.errors import (
    ClosedError,
    TransferEngineError,
    TransferTimeout,
    UnknownPeerError,
)

__all__ = ["EtcdLeader", "leader_of"]

log = logging.getLogger(__name__)


def _leader_key(path: str, role: str) -> bytes:
    if not role or "/" in role:
        raise ValueError(f"role must be non-empty without '/', got {role!r}")
    return (key_prefix(path) + "/leaders/" + role).encode()


def leader_of(address: str, role: str, timeout: float = 5.0) -> str:
    """The value (endpoint) the current leader of ``role`` published; raises
    ``UnknownPeerError`` when none leads, ``ConnectError`` when etcd cannot be reached."""
    endpoints, path = parse_etcd_address(address)
    client = EtcdClient(endpoints, timeout)
    try:
        reply = client.call("/v3/kv/range", {"key": b64(_leader_key(path, role))},
                            timeout, "leader")
    finally:
        client.close()
    for kv in reply.get("kvs", []):
        return unb64(kv.get("value")).decode("utf-8", "replace")
    raise UnknownPeerError(f"no leader of {role!r} in etcd", peer=role, op="leader")


class EtcdLeader:
    """A candidate for leading ``role``; :meth:`campaign` returns once it leads.

    :param address: etcd address (``etcd://h1:2379[,h2:2379...][/prefix]``).
    :param role: what is led (``kvstore-master``).
    :param value: what followers read: where the leader serves.
    :param ttl: the lease, seconds: how long a dead leader keeps the role.
    :param on_lost: called once (from the renewal thread) when leadership is lost.
    """

    def __init__(self, address: str, role: str, value: str, *, ttl: float = 3.0,
                 timeout: float = 5.0, on_lost: Callable[[], None] | None = None) -> None:
        endpoints, path = parse_etcd_address(address)
        self._key = _leader_key(path, role)
        self.role = role
        self.value = value
        self.ttl = ttl
        self._client = EtcdClient(endpoints, timeout)
        self._on_lost = on_lost
        self._lease = 0
        self._stop = threading.Event()
        self._leading = threading.Event()
        self._keeper: threading.Thread | None = None

    @property
    def leading(self) -> bool:
        return self._leading.is_set()

    @property
    def lease(self) -> int:
        """The etcd lease the lead is held under (0 before the first win)."""
        return self._lease

    def campaign(self, timeout: float | None = None, poll: float = 0.2) -> None:
        """Waits until this candidate leads (checking every ``poll`` seconds); raises
        ``TransferTimeout`` after ``timeout`` seconds (None: until closed)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        said = ""
        while not self._stop.is_set():
            try:
                if self._try_once():
                    return
            except TransferEngineError as exc:
                if str(exc) != said:  # once per cause, not every poll
                    said = str(exc)
                    log.warning("campaign for %s: %s (trying again every %gs)",
                                self.role, exc, poll)
            if deadline is not None and time.monotonic() >= deadline:
                raise TransferTimeout(f"did not become leader of {self.role!r} in "
                                      f"{timeout}s", peer=self.role, op="campaign")
            self._stop.wait(poll)
        raise ClosedError("the candidate was closed", peer=self.role, op="campaign")

    def _try_once(self) -> bool:
        granted = time.monotonic()
        reply = self._client.call("/v3/lease/grant", {"TTL": max(1, round(self.ttl))},
                                  None, "campaign")
        lease = int(reply["ID"])
        txn = {"compare": [{"key": b64(self._key), "target": "CREATE",
                            "create_revision": "0"}],
               "success": [{"request_put": {"key": b64(self._key),
                                            "value": b64(self.value.encode()),
                                            "lease": str(lease)}}]}
        won = bool(self._client.call("/v3/kv/txn", txn, None, "campaign").get("succeeded"))
        if not won:
            self._revoke(lease)
            return False
        self._lease = lease
        self._leading.set()
        self._keeper = threading.Thread(target=self._keep, args=(granted,), daemon=True,
                                        name=f"te-etcd-leader-{self.role}")
        self._keeper.start()
        log.info("leading %s as %s", self.role, self.value)
        return True

    def _keep(self, renewed: float) -> None:
        while not self._stop.wait(self.ttl / 3):
            sent = time.monotonic()
            try:
                reply = self._client.call("/v3/lease/keepalive", {"ID": str(self._lease)},
                                          self.ttl / 3, "heartbeat")
                if int(reply.get("result", {}).get("TTL", 0)) > 0:
                    renewed = sent
                    continue
                reason = "its lease ran out"
            except TransferEngineError as exc:
                if time.monotonic() < renewed + 0.9 * self.ttl:
                    continue
                reason = f"no renewal for {0.9 * self.ttl:.3g}s ({exc})"
            self._lost(reason)
            return

    def _lost(self, reason: str) -> None:
        if not self._leading.is_set():
            return
        self._leading.clear()
        log.warning("lost the lead of %s: %s", self.role, reason)
        if self._on_lost is not None:
            self._on_lost()

    def _revoke(self, lease: int) -> None:
        try:
            self._client.revoke(lease, None, "resign")
        except TransferEngineError as exc:
            log.info("revoking an etcd lease: %s (it runs out by itself)", exc)

    def cancel(self) -> None:
        """Ends a :meth:`campaign` in progress (it raises ``ClosedError``); only sets a
        flag, so a signal handler may call it."""
        self._stop.set()

    def resign(self) -> None:
        """Gives the role up at once (a standby may take it at its next try)."""
        self._stop.set()
        if self._keeper is not None and self._keeper is not threading.current_thread():
            self._keeper.join(self.ttl)
        if self._leading.is_set():
            self._leading.clear()
            self._revoke(self._lease)

    def close(self) -> None:
        self.resign()
        self._client.close()

    def __enter__(self) -> EtcdLeader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
