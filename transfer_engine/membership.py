"""Registry glue: join with our record, publish changes, follow peers' events."""

from __future__ import annotations

import logging

from transfer_engine.control.auth import AuthConfig
from transfer_engine.control.client import RegistryStore
from transfer_engine.control.etcd_store import ETCD_SCHEME, EtcdStore
from transfer_engine.control.metastore import (
    EventKind,
    MemberEvent,
    MemberRecord,
    MetadataStore,
)
from transfer_engine.errors import (
    TransferEngineError,
)
from transfer_engine.state import EngineState

log = logging.getLogger(__name__)


class Membership(EngineState):
    """What the engine does with a registry (a part of :class:`Engine`)."""

    def _member_record(self) -> MemberRecord:
        meta = self.metadata()
        rdma = self._transports.get("rdma")
        nics = list(rdma.info("devices") or []) if rdma is not None else []
        return MemberRecord(self.name, self.incarnation, self.role, meta["hostname"],
                            self.pod, self.zone, self.endpoint, meta["transports"], nics,
                            meta["segments"])

    def _join(self, registry: str | MetadataStore, auth: AuthConfig) -> None:
        store: MetadataStore
        if isinstance(registry, str) and registry.startswith(ETCD_SCHEME):
            store = EtcdStore(registry, timeout=self.timeout, name=self.name)
            self._stack.callback(store.close)
        elif isinstance(registry, str):
            store = RegistryStore(registry, auth=auth, timeout=self.timeout, name=self.name)
            self._stack.callback(store.close)
        else:
            store = registry
        store.put(self._member_record(), self.timeout)
        self._stack.callback(self._leave, store)
        self._stack.callback(store.watch(self._on_member_event).close)
        self.membership = store

    def _leave(self, store: MetadataStore) -> None:
        try:
            store.delete(self.name, min(self.timeout, 2.0))
        except TransferEngineError as exc:
            log.info("leaving the registry: %s", exc)

    def _publish(self) -> None:
        """Sends our current record (segments changed) to the registry, without waiting."""
        store = self.membership
        if store is None or self._closed:
            return
        store.publish(self._member_record())

    def _on_member_event(self, event: MemberEvent) -> None:
        if event.name == self.name or self._closed:
            return
        with self._lock:
            peer = self._peers.get(event.name)
        if peer is None or peer.lost is not None:
            return
        if event.kind in (EventKind.LEAVE, EventKind.EXPIRE):
            self.peer_lost(event.name, f"registry: {event.kind.value} ({event.reason})")
        elif (event.kind is EventKind.JOIN and event.record is not None
              and peer.info.incarnation not in ("", event.record.incarnation)):
            self.peer_lost(event.name, "registry: restarted with a new incarnation")

    def members(self, role: str | None = None) -> list[MemberRecord]:
        """Current registry members (all, or of one role); [] without a registry."""
        if self.membership is None:
            return []
        return self.membership.list(role, self.timeout)
