"""Membership in etcd: a :class:`MetadataStore` over etcd's v3 JSON gateway.

For fleets that already run etcd (or outgrow one registry process). No client library:
etcd 3.4+ serves its v3 API as JSON over HTTP (``/v3/kv/range``, ``/v3/lease/grant``,
``/v3/watch``, ...), which ``http.client`` speaks in a few lines.

Layout: member ``NAME`` is the key ``<prefix>/members/NAME`` (default prefix ``/te``),
its value the msgpack of :meth:`MemberRecord.to_wire`, attached to a lease of ``ttl``
seconds that a keep-alive thread renews every ``ttl / 3``. A holder that dies stops
renewing; etcd deletes the key when the lease runs out and every watcher sees
``EXPIRE``. A member that leaves first overwrites its value with a leaving marker and
then revokes its lease, so watchers (who get the deleted value with each delete) tell
``LEAVE`` from ``EXPIRE``. If a lease is lost while we live (etcd restarted, a long
pause), the keep-alive thread grants a new one and puts the record again: a restarted
etcd relearns its members within ``ttl / 3``.

A watch reads the current members at one revision (a ``JOIN`` each), then streams
changes from the next revision, so nothing is missed or shown twice between the two.
Each subscription holds one HTTP stream and one thread; ``close()`` shuts its socket.

Security: etcd's own authentication and TLS are the operator's; this store speaks plain
HTTP and is meant for an etcd on loopback or a trusted network. Records are validated
(:meth:`MemberRecord.from_wire`) on the way in, so a bad value is skipped and logged.
"""

from __future__ import annotations

import builtins
import http.client
import json
import logging
import threading
import time
from typing import Any

import msgpack

from transfer_engine.control.etcd_client import (
    ETCD_SCHEME,
    Endpoint,
    EtcdClient,
    b64,
    etcd_request,
    key_prefix,
    parse_etcd_address,
    shut,
    unb64,
)
from transfer_engine.control.metastore import (
    EventCallback,
    EventKind,
    MemberEvent,
    MemberRecord,
    MetadataStore,
    Subscription,
)
from transfer_engine.errors import (
    ClosedError,
    ProtocolError,
    TransferEngineError,
    UnknownPeerError,
)

__all__ = ["EtcdStore", "ETCD_SCHEME", "etcd_request"]

log = logging.getLogger(__name__)

_LEAVING = b"\x00leaving"  # value a member writes just before revoking its lease


def _prefix_end(prefix: bytes) -> bytes:
    """The smallest key above every key starting with ``prefix`` (etcd's range_end)."""
    return prefix[:-1] + bytes([prefix[-1] + 1])


class EtcdStore(MetadataStore):
    """Members as leased keys in etcd.

    :param address: ``etcd://host:port`` (or ``http://host:port``), optionally with a key
        prefix as its path (``etcd://127.0.0.1:2379/fleet-a``; default ``/te``). A
        cluster lists its members: ``etcd://h1:2379,h2:2379,h3:2379/fleet-a``; requests,
        keep-alives and watches move to another member when one is lost.
    :param ttl: lease of each record, seconds (etcd grants at least about 2).
    :param timeout: seconds for each request when a call gives none.
    :param name: for thread names and logs.
    """

    def __init__(self, address: str, *, ttl: float = 3.0, timeout: float = 5.0,
                 name: str = "client") -> None:
        endpoints, path = parse_etcd_address(address)
        self.address = address
        self._client = EtcdClient(endpoints, timeout)
        prefix = key_prefix(path) + "/members/"
        self._prefix = prefix.encode()
        self.ttl = ttl
        self.timeout = timeout
        self.name = name
        self._lock = threading.Lock()
        # one put, delete or lease renewal at a time: a renewal racing a delete must
        # not bring a record back
        self._put_lock = threading.Lock()
        self._own: dict[str, tuple[MemberRecord, int]] = {}  # name -> (record, lease)
        self._watches: dict[int, _Watch] = {}
        self._ids = iter(range(1, 1 << 62))
        self._stop = threading.Event()
        self._keeper: threading.Thread | None = None
        self._closed = False

    @property
    def leases(self) -> dict[str, int]:
        """The etcd lease each record this store put is kept alive under, by name."""
        with self._lock:
            return {name: lease for name, (_, lease) in self._own.items()}

    # --- HTTP ---------------------------------------------------------------------

    def _call(self, path: str, body: dict[str, Any], timeout: float | None,
              op: str) -> dict[str, Any]:
        """One JSON request to the gateway; errors become the engine's own."""
        if self._closed:
            raise ClosedError("etcd store is closed", peer="etcd", op=op)
        return self._client.call(path, body, timeout or self.timeout, op)

    def _key(self, name: str) -> bytes:
        if not name or "/" in name:
            raise ValueError(f"member name must be non-empty without '/', got {name!r}")
        return self._prefix + name.encode()

    def _grant(self, timeout: float | None) -> int:
        reply = self._call("/v3/lease/grant", {"TTL": max(1, round(self.ttl))}, timeout,
                           "lease")
        return int(reply["ID"])

    def _put_value(self, name: str, value: bytes, lease: int, timeout: float | None
                   ) -> None:
        self._call("/v3/kv/put", {"key": b64(self._key(name)), "value": b64(value),
                                  "lease": str(lease)}, timeout, "register")

    # --- MetadataStore --------------------------------------------------------------

    def put(self, record: MemberRecord, timeout: float | None = None) -> None:
        with self._put_lock:
            self._put_locked(record, timeout)
        self._ensure_keeper()

    def _put_locked(self, record: MemberRecord, timeout: float | None) -> None:
        held = self._own.get(record.name)
        lease = held[1] if held is not None else self._grant(timeout)
        value = msgpack.packb(record.to_wire())
        try:
            self._put_value(record.name, value, lease, timeout)
        except ProtocolError:
            if held is None:
                raise
            # the lease ran out under us (etcd restarted, a long pause): take a new one
            lease = self._grant(timeout)
            self._put_value(record.name, value, lease, timeout)
        with self._lock:
            self._own[record.name] = (record, lease)

    def get(self, name: str, timeout: float | None = None) -> MemberRecord:
        reply = self._call("/v3/kv/range", {"key": b64(self._key(name))}, timeout,
                           "lookup")
        for kv in reply.get("kvs", []):
            record = self._decode(kv)
            if record is not None:
                return record
        raise UnknownPeerError("no member of that name", peer=name, op="lookup")

    def delete(self, name: str, timeout: float | None = None) -> None:
        with self._put_lock:
            with self._lock:
                held = self._own.pop(name, None)
            if held is None:
                return
            lease = held[1]
            try:
                self._put_value(name, _LEAVING, lease, timeout)
            except ProtocolError:
                pass  # the lease is gone already, and with it the key
            if self._closed:
                raise ClosedError("etcd store is closed", peer="etcd", op="leave")
            self._client.revoke(lease, timeout or self.timeout, "leave")

    def list(self, role: str | None = None, timeout: float | None = None
             ) -> builtins.list[MemberRecord]:
        records, _ = self._snapshot(timeout)
        return [r for r in records if role in (None, r.role)]

    def _snapshot(self, timeout: float | None) -> tuple[builtins.list[MemberRecord], int]:
        """Every member, sorted by name, and the revision they were read at."""
        reply = self._call("/v3/kv/range", {"key": b64(self._prefix),
                                            "range_end": b64(_prefix_end(self._prefix))},
                           timeout, "list")
        records = [r for r in map(self._decode, reply.get("kvs", [])) if r is not None]
        return sorted(records, key=lambda r: r.name), int(reply["header"]["revision"])

    def _decode(self, kv: dict[str, Any]) -> MemberRecord | None:
        value = unb64(kv.get("value"))
        if value == _LEAVING or not value:
            return None
        try:
            return MemberRecord.from_wire(msgpack.unpackb(value), peer="etcd")
        except (ProtocolError, ValueError, msgpack.UnpackException) as exc:
            log.warning("skipping a bad member record at %r: %s", unb64(kv.get("key")),
                        exc)
            return None

    def watch(self, callback: EventCallback) -> Subscription:
        records, revision = self._snapshot(None)
        wid = next(self._ids)
        w = _Watch(self, callback, {r.name: r for r in records}, revision + 1, wid)
        with self._lock:
            if self._closed:
                raise ClosedError("etcd store is closed", peer="etcd", op="watch")
            self._watches[wid] = w
        for record in records:
            w.deliver(MemberEvent(EventKind.JOIN, record.name, record))
        w.start()
        self._ensure_keeper()

        def cancel() -> None:
            with self._lock:
                self._watches.pop(wid, None)
            w.close()
        return Subscription(cancel)

    # --- leases -------------------------------------------------------------------

    def _ensure_keeper(self) -> None:
        with self._lock:
            if self._keeper is not None or self._closed:
                return
            self._keeper = threading.Thread(target=self._keep_alive, daemon=True,
                                            name=f"te-etcd-lease-{self.name}")
            self._keeper.start()

    def _keep_alive(self) -> None:
        """Renews our leases every ttl/3, and moves watches off a member gone silent."""
        while not self._stop.wait(self.ttl / 3):
            self._check_watches()
            with self._lock:
                held = dict(self._own)
            for name, (record, lease) in held.items():
                try:
                    reply = self._call("/v3/lease/keepalive", {"ID": str(lease)},
                                       self.ttl / 3, "heartbeat")
                    alive = int(reply.get("result", {}).get("TTL", 0)) > 0
                    if not alive:
                        self._renew(name, record, lease)
                except TransferEngineError as exc:
                    if not self._closed:
                        log.info("etcd keep-alive of %s: %s", name, exc)

    def _check_watches(self) -> None:
        """A watch's member that was killed ends its stream, but one that froze or lost
        its cluster keeps the stream open and silent: a watch quiet for a ttl has its
        member asked a quorum read, and moves to another member if that fails."""
        with self._lock:
            watches = list(self._watches.values())
        now = time.monotonic()
        verdicts: dict[Endpoint, bool] = {}
        for w in watches:
            endpoint = w.endpoint
            if endpoint is None or now - max(w.heard, self._client.answered.get(
                    endpoint, 0.0)) < self.ttl:
                continue  # it spoke lately (a keep-alive of ours answered there too)
            if endpoint not in verdicts:
                verdicts[endpoint] = self._client.serves(endpoint, self.ttl / 3)
            if verdicts[endpoint]:
                w.heard = now
            else:
                log.info("etcd member %s:%s is not serving; moving a watch", *endpoint)
                w.reconnect()

    def _renew(self, name: str, record: MemberRecord, lease: int) -> None:
        """Puts ``record`` under a new lease, unless it left or changed meanwhile."""
        with self._put_lock:
            with self._lock:
                if self._own.get(name) != (record, lease):
                    return
                del self._own[name]  # its lease is gone: put takes a new one
            log.info("etcd lease of %s ran out; registering again", name)
            try:
                self._put_locked(record, self.ttl / 3)
            except TransferEngineError:
                with self._lock:  # the next round tries again
                    self._own.setdefault(name, (record, lease))
                raise

    def close(self) -> None:
        """Stops watches and keep-alives. Our keys are left to expire with their leases
        (call :meth:`delete` first to leave at once)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            watches = list(self._watches.values())
            self._watches.clear()
            keeper = self._keeper
        self._stop.set()
        for w in watches:
            w.close()
        if keeper is not None:
            keeper.join(self.timeout + self.ttl)
        self._client.close()

    def __repr__(self) -> str:
        state = "CLOSED" if self._closed else f"own={len(self._own)}"
        host, port = self._client.current
        return f"<EtcdStore {host}:{port}{self._prefix.decode()} {state}>"


class _Compacted(ProtocolError):
    """A watch's revision was compacted away; it starts over from a snapshot."""


class _Watch:
    """One prefix watch: an HTTP stream of events read by its own thread."""

    def __init__(self, store: EtcdStore, callback: EventCallback,
                 known: dict[str, MemberRecord], start_revision: int, wid: int) -> None:
        self._store = store
        self._callback = callback
        self._known = known
        self._start_revision = start_revision
        self._conn: http.client.HTTPConnection | None = None
        self.endpoint: Endpoint | None = None  # the member this watch streams from
        self.heard = time.monotonic()  # when that member last spoke
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name=f"te-etcd-watch-{store.name}-{wid}")

    def start(self) -> None:
        self._thread.start()

    def deliver(self, event: MemberEvent) -> None:
        if self._stopped.is_set():
            return
        try:
            self._callback(event)
        except Exception:
            log.exception("etcd watch callback failed")

    def _open(self) -> http.client.HTTPResponse:
        prefix = self._store._prefix
        body = {"create_request": {"key": b64(prefix), "range_end": b64(_prefix_end(prefix)),
                                   "start_revision": str(self._start_revision),
                                   "prev_kv": True}}
        conn, resp, endpoint = self._store._client.open_stream("/v3/watch", body)
        self._conn, self.endpoint, self.heard = conn, endpoint, time.monotonic()
        return resp

    def _run(self) -> None:
        backoff = 0.1
        while not self._stopped.is_set():
            moved = True
            try:
                resp = self._open()
                if self._stopped.is_set():
                    break
                for line in iter(resp.readline, b""):
                    if self._stopped.is_set():
                        break
                    self.heard = time.monotonic()
                    self._handle(json.loads(line).get("result", {}))
                    backoff = 0.1
            except _Compacted:
                moved = False  # the member is fine: resume on it from the snapshot
            except (OSError, ValueError, http.client.HTTPException,
                    TransferEngineError) as exc:
                if self._stopped.is_set():
                    break
                log.info("etcd watch interrupted (%s); resuming", exc)
            finally:
                if self._conn is not None:
                    self._conn.close()
            if moved and self.endpoint is not None and not self._stopped.is_set():
                # the stream ended: its member stopped or restarted; resume on the next
                self._store._client.demote(self.endpoint)
                self.endpoint = None
            if self._stopped.wait(backoff):
                break
            backoff = min(2.0, backoff * 2)

    def reconnect(self) -> None:
        """Ends the current stream; the watch resumes from its revision elsewhere."""
        shut(self._conn)

    def _handle(self, result: dict[str, Any]) -> None:
        if result.get("canceled") or result.get("compact_revision"):
            # our revision was compacted away: start over from a fresh snapshot
            records, revision = self._store._snapshot(None)
            fresh = {r.name: r for r in records}
            for name in [n for n in self._known if n not in fresh]:
                del self._known[name]
                self.deliver(MemberEvent(EventKind.LEAVE, name, reason="absent from etcd"))
            for record in records:
                self._upsert(record)
            self._start_revision = revision + 1
            raise _Compacted("etcd watch restarted after compaction", peer="etcd")
        for ev in result.get("events", []):
            kv = ev.get("kv", {})
            self._start_revision = int(kv.get("mod_revision", 0)) + 1
            name = unb64(kv.get("key"))[len(self._store._prefix):].decode(
                "utf-8", "replace")
            if ev.get("type") == "DELETE":
                prev = unb64(ev.get("prev_kv", {}).get("value"))
                if self._known.pop(name, None) is not None:
                    kind = EventKind.LEAVE if prev == _LEAVING else EventKind.EXPIRE
                    reason = "left" if kind is EventKind.LEAVE else "lease ran out"
                    self.deliver(MemberEvent(kind, name, reason=reason))
                continue
            changed = self._store._decode(kv)
            if changed is not None:
                self._upsert(changed)

    def _upsert(self, record: MemberRecord) -> None:
        old = self._known.get(record.name)
        if old == record:
            return
        self._known[record.name] = record
        same = old is not None and old.incarnation == record.incarnation
        self.deliver(MemberEvent(EventKind.UPDATE if same else EventKind.JOIN, record.name,
                                 record))

    def close(self) -> None:
        self._stopped.set()
        shut(self._conn)
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(5.0)
