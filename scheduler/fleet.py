"""The live view of a prefill/decode fleet: who is there, where, how loaded, and which
prefixes each prefill instance caches.

Each role is a :class:`Pool` of array columns (one slot per instance ever seen), so the
router scores a thousand instances with a few NumPy operations instead of a Python loop.
The view is fed by:

- registry events (:meth:`Fleet.apply`, :meth:`Fleet.watch`): ``JOIN``/``UPDATE`` add or
  relabel an instance, ``LEAVE``/``EXPIRE`` retire it and drop its cache;
- load reports (:meth:`Fleet.report`), or an ``UPDATE`` whose record carries one;
- the router's own bookkeeping (:meth:`Fleet.dispatched`, :meth:`Fleet.prefill_done`,
  :meth:`Fleet.decode_done`);
- the breakers (an ejected instance is masked out until it half-opens);
- the store's prefix index (``store_prefix``: leading blocks the KV store holds).

A serving instance announces itself as a registry member of role ``prefill`` or
``decode`` whose ``transports`` map carries ``"http": {"url": ..., "kv_tokens": ...,
"load": {"queue": ..., "kv_used": ...}}`` (see :mod:`scheduler.announce`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from scheduler.policy import BreakerState, TrafficPolicy
from scheduler.prefix import PrefixIndex
from transfer_engine.control.metastore import (
    EventKind,
    MemberEvent,
    MemberRecord,
    MetadataStore,
    Subscription,
)

__all__ = ["ROLES", "Pool", "Fleet", "StorePrefix"]

ROLES = ("prefill", "decode")
StorePrefix = Callable[[Sequence[Hashable]], int]
F64 = npt.NDArray[np.float64]


class Pool:
    """The instances of one role, as columns indexed by slot.

    Columns: ``alive`` (joined and not left), ``ejected`` (breaker open), ``pod`` and
    ``zone`` (interned label codes), ``free_at`` (when its queued prefill work ends,
    clock seconds), ``queue`` (requests outstanding), ``kv_used`` / ``kv_cap`` (tokens).
    """

    def __init__(self, role: str) -> None:
        self.role = role
        self.names: list[str] = []
        self.urls: list[str] = []
        self.labels: list[tuple[str, str, str]] = []  # (host, pod, zone)
        self.slot: dict[str, int] = {}
        self.alive = np.zeros(0, bool)
        self.ejected = np.zeros(0, bool)
        self.pod = np.zeros(0, np.int64)
        self.zone = np.zeros(0, np.int64)
        self.free_at = np.zeros(0, np.float64)
        self.queue = np.zeros(0, np.int64)
        self.kv_used = np.zeros(0, np.float64)
        self.kv_cap = np.zeros(0, np.float64)

    def __len__(self) -> int:
        return len(self.names)

    def _grow(self, n: int) -> None:
        for col in ("alive", "ejected", "pod", "zone", "free_at", "queue", "kv_used",
                    "kv_cap"):
            old = getattr(self, col)
            new = np.zeros(n, old.dtype)
            new[:len(old)] = old
            setattr(self, col, new)

    def add(self, name: str, url: str, labels: tuple[str, str, str], pod: int, zone: int,
            kv_cap: float) -> int:
        slot = self.slot.get(name)
        if slot is None:
            slot = len(self.names)
            if slot >= len(self.alive):
                self._grow(max(8, 2 * len(self.alive)))
            self.names.append(name)
            self.urls.append(url)
            self.labels.append(labels)
            self.slot[name] = slot
        self.urls[slot], self.labels[slot] = url, labels
        self.pod[slot], self.zone[slot], self.kv_cap[slot] = pod, zone, kv_cap
        self.alive[slot] = True
        return slot

    def usable(self) -> npt.NDArray[np.bool_]:
        """Slots a request may go to (alive, not ejected), as a mask."""
        n = len(self.names)
        return self.alive[:n] & ~self.ejected[:n]

    def meta(self, slot: int) -> dict[str, str]:
        host, pod, zone = self.labels[slot]
        return {"name": self.names[slot], "host": host, "pod": pod, "zone": zone}

    def __repr__(self) -> str:
        n = len(self.names)
        return (f"<Pool {self.role} live={int(self.usable().sum())}/{n} "
                f"queued={int(self.queue[:n].sum())}>")


class Fleet:
    """Prefill and decode pools, the prefill prefix caches, and the breakers' view.

    :param cache_blocks: blocks each prefill instance's prefix cache holds (LRU).
    :param kv_tokens: KV capacity of a decode instance that does not say its own.
    :param traffic: the traffic policy whose breakers mask instances out (one is made
        when ``None``).
    :param store_prefix: leading blocks of a request the KV store holds (``None``: no
        store).
    :param require_url: ignore members that announce no HTTP URL (a router serving
        HTTP can only use those).
    """

    def __init__(self, *, cache_blocks: int = 1000, kv_tokens: float = 400_000,
                 traffic: TrafficPolicy | None = None,
                 store_prefix: StorePrefix | None = None, require_url: bool = False) -> None:
        self.pools = {role: Pool(role) for role in ROLES}
        self.prefill, self.decode = self.pools["prefill"], self.pools["decode"]
        self.prefix = PrefixIndex(cache_blocks)
        self.kv_tokens = kv_tokens
        self.traffic = traffic if traffic is not None else TrafficPolicy()
        self.traffic.breakers.on_change = self._on_breaker
        self.store_prefix = store_prefix
        self.require_url = require_url
        self.lock = threading.RLock()
        self._codes: dict[str, int] = {}
        self._role_of: dict[str, str] = {}

    def _code(self, label: str) -> int:
        return self._codes.setdefault(label, len(self._codes))

    # --- membership ---------------------------------------------------------------

    def add(self, name: str, role: str, *, host: str = "", pod: str = "", zone: str = "",
            url: str = "", kv_tokens: float | None = None) -> int:
        """Adds (or relabels) an instance; returns its slot in its role's pool."""
        if role not in self.pools:
            raise ValueError(f"role must be one of {ROLES}, not {role!r}")
        with self.lock:
            old = self._role_of.get(name)
            if old is not None and old != role:
                self.remove(name)
            pool = self.pools[role]
            slot = pool.add(name, url, (host, pod, zone), self._code("pod:" + pod),
                            self._code("zone:" + zone),
                            float(kv_tokens if kv_tokens else self.kv_tokens))
            self._role_of[name] = role
            self.traffic.breakers.add(name, role)
            return slot

    def remove(self, name: str) -> None:
        """Retires an instance: no new requests, its cache forgotten."""
        with self.lock:
            role = self._role_of.pop(name, None)
            if role is None:
                return
            pool = self.pools[role]
            slot = pool.slot[name]
            pool.alive[slot] = False
            pool.ejected[slot] = False
            pool.queue[slot] = 0
            pool.kv_used[slot] = 0.0
            if role == "prefill":
                self.prefix.drop(slot)
            self.traffic.breakers.remove(name)

    def apply(self, event: MemberEvent) -> None:
        """Applies a registry event (a :meth:`MetadataStore.watch` callback)."""
        if event.kind in (EventKind.LEAVE, EventKind.EXPIRE):
            self.remove(event.name)
            return
        record = event.record
        if record is None or record.role not in self.pools:
            return
        http = _http_info(record)
        url = str(http.get("url") or "")
        if self.require_url and not url:
            return
        kv = http.get("kv_tokens")
        self.add(record.name, record.role, host=record.host, pod=record.pod,
                 zone=record.zone, url=url,
                 kv_tokens=float(kv) if isinstance(kv, int | float) and kv > 0 else None)
        load = http.get("load")
        if isinstance(load, dict):
            queue, kv_used = load.get("queue"), load.get("kv_used")
            self.report(record.name,
                        queue=int(queue) if isinstance(queue, int) else None,
                        kv_used=float(kv_used) if isinstance(kv_used, int | float) else None)

    def watch(self, store: MetadataStore) -> Subscription:
        """Follows ``store``'s membership from now on (current members first)."""
        return store.watch(self.apply)

    def report(self, name: str, *, queue: int | None = None, kv_used: float | None = None
               ) -> None:
        """A load report from an instance (its own count of queued requests, KV tokens
        in use); it replaces the router's estimate."""
        with self.lock:
            role = self._role_of.get(name)
            if role is None:
                return
            pool = self.pools[role]
            slot = pool.slot[name]
            if queue is not None and queue >= 0:
                pool.queue[slot] = queue
            if kv_used is not None and kv_used >= 0:
                pool.kv_used[slot] = kv_used

    def _on_breaker(self, name: str, state: BreakerState) -> None:
        role = self._role_of.get(name)
        if role is not None:
            pool = self.pools[role]
            pool.ejected[pool.slot[name]] = state is BreakerState.OPEN

    # --- the router's bookkeeping ---------------------------------------------------

    def dispatched(self, prefill: int | None, decode: int, keys: Sequence[Hashable],
                   prefill_s: float, kv_tokens: float, now: float) -> None:
        """A request went to ``prefill`` (``None``: prefilled on the decode instance)
        for ``prefill_s`` estimated seconds, then to ``decode`` holding ``kv_tokens``."""
        with self.lock:
            pool = self.decode if prefill is None else self.prefill
            slot = decode if prefill is None else prefill
            pool.free_at[slot] = max(now, pool.free_at[slot]) + prefill_s
            pool.queue[slot] += 1
            if prefill is not None:
                self.prefix.insert(prefill, keys)
                self.decode.queue[decode] += 1
            self.decode.kv_used[decode] += kv_tokens

    def prefill_done(self, prefill: int | None, decode: int, now: float) -> None:
        """The prefill of a dispatched request ended (or failed)."""
        with self.lock:
            if prefill is None:
                return
            pool = self.prefill
            pool.queue[prefill] = max(0, pool.queue[prefill] - 1)
            if pool.queue[prefill] == 0:
                pool.free_at[prefill] = min(pool.free_at[prefill], now)

    def decode_done(self, decode: int, kv_tokens: float, now: float,
                    local_prefill: bool = False) -> None:
        """A request left ``decode`` (finished or failed), releasing its KV."""
        with self.lock:
            pool = self.decode
            pool.queue[decode] = max(0, pool.queue[decode] - 1)
            pool.kv_used[decode] = max(0.0, pool.kv_used[decode] - kv_tokens)
            if local_prefill and pool.queue[decode] == 0:
                pool.free_at[decode] = min(pool.free_at[decode], now)

    def __repr__(self) -> str:
        return f"<Fleet {self.prefill!r} {self.decode!r} {self.prefix!r}>"


def _http_info(record: MemberRecord) -> dict[str, Any]:
    info = record.transports.get("http") if isinstance(record.transports, dict) else None
    return info if isinstance(info, dict) else {}
