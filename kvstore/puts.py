"""The kvstore client's put path: place, write, commit.

A batch costs one round trip to the master to place every key (space on ``replicas``
distinct nodes), one engine WRITE per node, then one round trip to commit. Keys the
master has no room for yet are answered RETRY and placed again after a short back-off;
keys whose every replica's node failed during the write are placed again (a few
times). A put with ``wait=False`` posts its commit and returns: the answer is taken
before the client's next request, and keys it could not store are reported by
:meth:`~kvstore.client.Client.flush`.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from kvstore.client_state import I64, U64, ClientState, Job, Where, expect
from kvstore.errors import InvalidArgumentError, PutError, StoreError
from kvstore.index import has_duplicates
from kvstore.keys import crc, key_rows
from kvstore.protocol import MAX_BATCH, KvCommit, KvCommitted, KvPlaced, KvPut, Status, column, pack
from kvstore.transfers import buffer_span, memory_view
from transfer_engine.control.messages import Message

__all__ = ["Puts"]

_PUT_ATTEMPTS = 3  # rewrites of keys whose nodes all failed or left during the write


def _bytes_view(value: Any, i: int) -> memoryview:
    """``value``'s bytes (a numpy array's in C order); anything that is not a buffer is
    the caller's error, named by its place in the batch."""
    if isinstance(value, np.ndarray):
        return memoryview(np.ascontiguousarray(value).reshape(-1).view(np.uint8))  # type: ignore[arg-type]
    try:
        return memoryview(value).cast("B")
    except TypeError as exc:
        raise InvalidArgumentError(f"value {i}: not a contiguous bytes-like object "
                                   f"({type(value).__name__}): {exc}") from None


@dataclass
class Settle:
    """What a put's commit answer is applied to: the keys it placed (``rows``), which
    of them were written (``ok``, indices), their versions, places and lengths."""

    rows: U64
    ok: npt.NDArray[np.int64]
    versions: U64
    where: Where
    lengths: I64


class Puts(ClientState):
    """Mixed into :class:`kvstore.client.Client`: ``put``, ``batch_put``, ``put_from``
    and their commits."""

    def _settled(self, settle: Settle, done: Message) -> tuple[np.ndarray, np.ndarray]:
        """Takes a commit's answer: notes where the stored keys are; returns (indices
        into the put's keys) those whose every replica was lost, and those refused."""
        done = expect(done, KvCommitted, self._link.address)
        ok = settle.ok
        st = column(done.status, "<i1", settle.rows.shape[0], "status", self._link.address)
        self._remember(settle.rows, ok[st[ok] == Status.OK], settle.versions, settle.where,
                       settle.lengths)
        return (ok[st[ok] == Status.FAILED],
                ok[(st[ok] != Status.OK) & (st[ok] != Status.FAILED)])

    def _settled_late(self, settle: Settle, done: Message | Exception) -> None:
        """A commit posted by a put that did not wait: keys not stored are kept for
        :meth:`flush` to report."""
        if isinstance(done, Exception):
            bad, why = settle.ok, str(done)
        else:
            lost, refused = self._settled(settle, done)
            bad, why = np.concatenate((lost, refused)), "commit refused or replicas lost"
        if bad.size:
            rows = settle.rows[bad]
            self._late_failed += [int(a) | int(b) << 64 for a, b in rows.tolist()]
            self._late_reasons.append(f"{bad.size} keys: {why}")

    def flush(self) -> None:
        """Waits for the commits of puts made with ``wait=False``; raises
        :class:`PutError` naming their keys that were not stored (once)."""
        with self._lock:
            if self._closed:
                raise StoreError("the client is closed")
            try:
                self._link.drain(self.timeout)
            finally:
                failed, reasons = self._late_failed, self._late_reasons
                self._late_failed, self._late_reasons = [], []
            if failed:
                raise PutError(f"{len(failed)} values of earlier puts not stored "
                               f"({'; '.join(reasons)})", list[object](failed))

    def _put(self, rows: U64, addrs: I64, lens: I64, *, ttl: float | None,
             if_absent: bool, replicas: int | None, checks: U64 | None,
             wait: bool = True) -> None:
        """Stores each value ``[addrs[i], +lens[i])`` (registered memory) under key
        ``rows[i]``; raises :class:`PutError` naming the keys that were not stored.
        ``wait`` False: returns once the bytes are written and the commit is sent (see
        :meth:`batch_put`)."""
        n = rows.shape[0]
        if n == 0:
            return
        if n > MAX_BATCH:
            for s in range(0, n, MAX_BATCH):
                e = s + MAX_BATCH
                self._put(rows[s:e], addrs[s:e], lens[s:e], ttl=ttl, if_absent=if_absent,
                          replicas=replicas, checks=None if checks is None else checks[s:e],
                          wait=wait)
            return
        if has_duplicates(rows):
            raise InvalidArgumentError("keys in one put must be distinct")
        if checks is None:
            checks = np.zeros(n, dtype=np.uint64)
        deadline = time.monotonic() + self.timeout
        todo = np.arange(n)
        failed_keys: list[int] = []
        reasons: list[str] = []
        delay = 0.0005
        rewrites = 0
        while todo.size:
            asked = time.monotonic()  # the master's deadline runs from after this
            placed = self._request(KvPut(
                keys=rows[todo].tobytes(), lengths=pack(lens[todo], "<i8"),
                checksums=pack(checks[todo], "<u8"), replicas=replicas or self.replicas,
                ttl=float(ttl or 0.0), if_absent=if_absent, release=self._take_release(),
                writer=self.engine.name))
            placed = expect(placed, KvPlaced, self._link.address)
            where = Where.of(placed, todo.size, self._link.address)
            ok = np.flatnonzero(where.status == Status.OK)
            if ok.size:
                jobs: dict[int, list[Job]] = {}
                for i in ok.tolist():
                    j = int(todo[i])
                    for r in range(where.pools.shape[1]):
                        p = int(where.pools[i, r])
                        if p < 0:
                            break
                        jobs.setdefault(p, []).append(
                            (int(addrs[j]), int(where.offsets[i, r]), int(lens[j]), j))
                # no write starts past this, nor runs on: once the put expires, the
                # nodes fence us off, and its space goes to others
                limit = min(deadline, asked + 0.8 * placed.deadline_s)
                bad = self._move(True, jobs, where.nodes, limit, start_by=limit)
                reasons += [f"{where.nodes[b][0]}: {e}" for b, e in bad.items()]
                versions = column(placed.versions, "<u8", todo.size, "versions")
                if self._tier is not None:
                    # the tier serves a value only at the version the master holds, so
                    # one whose commit fails is never served
                    wrote = np.flatnonzero(~np.isin(where.pools[ok, 0], list(bad)))
                    js = todo[ok[wrote]]
                    self._tier.fill(rows[js], versions[ok[wrote]],
                                    [memory_view(int(addrs[j]), int(lens[j])) for j in js],
                                    promotion=False)
                commit = KvCommit(put_id=placed.put_id,
                                  failed=[str(where.nodes[b][0]) for b in bad],
                                  release=self._take_release())
                settle = Settle(rows[todo], ok, versions, where, lens[todo])
                if not wait:
                    self._link.post(commit, functools.partial(self._settled_late, settle))
                    again = todo[:0]
                else:
                    done = self._request(commit)
                    lost, refused = self._settled(settle, done)
                    failed_keys += todo[refused].tolist()
                    if refused.size:
                        reasons.append(f"{refused.size} keys: commit refused")
                    # every replica's node failed or left during the write: placed
                    # again (on the nodes still up) a few times, then given up
                    if lost.size and rewrites < _PUT_ATTEMPTS:
                        again = todo[lost]
                        rewrites += 1
                    else:
                        again = todo[:0]
                        if lost.size:
                            failed_keys += todo[lost].tolist()
                            reasons.append(f"{lost.size} keys: every node holding them "
                                           f"failed or left during {_PUT_ATTEMPTS + 1} writes")
            else:
                again = todo[:0]
            for code in (Status.NO_SPACE, Status.TOO_LARGE, Status.RECOVERING):
                hit = todo[where.status == code]
                if hit.size:
                    failed_keys += hit.tolist()
                    reasons.append(f"{hit.size} keys: {code.name}")
            todo = np.concatenate((todo[where.status == Status.RETRY], again))
            if again.size and todo.size == again.size:
                continue  # nothing waits for space: place the lost keys again now
            if todo.size:
                if time.monotonic() + delay > deadline:
                    failed_keys += todo.tolist()
                    reasons.append(f"{todo.size} keys: no space freed within {self.timeout}s")
                    break
                time.sleep(delay)
                delay = min(delay * 2, 0.02)
        if failed_keys:
            keys: list[object] = [int(rows[j, 0]) | int(rows[j, 1]) << 64
                                  for j in sorted(failed_keys)]
            raise PutError(f"{len(keys)} of {n} values not stored ({'; '.join(reasons)})",
                           keys)

    def batch_put(self, keys: object, values: Sequence[Any], *, ttl: float | None = None,
                  if_absent: bool = False, replicas: int | None = None,
                  wait: bool = True) -> None:
        """Stores ``values`` (bytes-like) under ``keys``, replacing older values; readers
        see either the old or the whole new value. ``if_absent``: keys already stored
        are left as they are. ``ttl`` seconds (None: until evicted). Raises
        :class:`PutError` (the keys it names keep their old values).

        ``wait=False`` (a cache storing what it computed, off its critical path): returns
        once the bytes are written and the commit is sent, without waiting for the
        master's answer. The master takes the commit before any later request of this
        client (so this client's next get sees the values); other clients see them a
        moment later. Keys the commit could not store are not written again: they are
        counted, and :meth:`flush` names them. Values are still copied before return, and
        space or placement problems are still raised here."""
        rows = key_rows(keys)
        views = [_bytes_view(v, i) for i, v in enumerate(values)]
        if len(views) != rows.shape[0]:
            raise InvalidArgumentError(f"{rows.shape[0]} keys but {len(views)} values")
        lens = np.array([v.nbytes for v in views], dtype=np.int64)
        with self._lock:
            staging, base = self._stage(int(lens.sum()) + 64 * len(views))
            offs = np.zeros(len(views), dtype=np.int64)
            pos = 0
            for i, v in enumerate(views):
                offs[i] = pos
                staging[pos:pos + v.nbytes] = np.frombuffer(v, dtype=np.uint8)
                pos += (v.nbytes + 63) & ~63
            checks = (np.array([crc(v) for v in views], dtype=np.uint64)
                      if self.checksum else None)
            self._put(rows, offs + base, lens, ttl=ttl, if_absent=if_absent,
                      replicas=replicas, checks=checks, wait=wait)

    def put(self, key: object, value: Any, *, ttl: float | None = None,
            if_absent: bool = False, replicas: int | None = None) -> None:
        """One value; see :meth:`batch_put`."""
        self.batch_put([key], [value], ttl=ttl, if_absent=if_absent, replicas=replicas)

    def put_from(self, keys: object, buffers: Sequence[Any], *, ttl: float | None = None,
                 if_absent: bool = False, replicas: int | None = None,
                 wait: bool = True) -> None:
        """Zero-copy put: each value is a buffer (numpy array, memoryview) lying inside
        memory registered with :meth:`register_buffer` (reusable once this returns, also
        with ``wait=False``, see :meth:`batch_put`)."""
        rows = key_rows(keys)
        spans = [buffer_span(b, writable=False) for b in buffers]
        if len(spans) != rows.shape[0]:
            raise InvalidArgumentError(f"{rows.shape[0]} keys but {len(spans)} buffers")
        self.put_from_addresses(rows, [a for a, _ in spans], [n for _, n in spans], ttl=ttl,
                                if_absent=if_absent, replicas=replicas, wait=wait)

    def put_from_addresses(self, keys: object, addresses: Sequence[int],
                           sizes: Sequence[int], *, ttl: float | None = None,
                           if_absent: bool = False, replicas: int | None = None,
                           wait: bool = True) -> None:
        """As :meth:`put_from`, with raw addresses inside registered buffers."""
        rows = key_rows(keys)
        addrs = np.asarray(addresses, dtype=np.int64)
        lens = np.asarray(sizes, dtype=np.int64)
        if addrs.shape != (rows.shape[0],) or lens.shape != addrs.shape or (lens < 0).any():
            raise InvalidArgumentError("one address and one size >= 0 per key")
        with self._lock:
            self._local(addrs, lens)  # refuse unregistered memory before anything moves
            checks = None
            if self.checksum:
                checks = np.array([crc(memory_view(a, n)) for a, n in
                                   zip(addrs.tolist(), lens.tolist(), strict=True)],
                                  dtype=np.uint64)
            self._put(rows, addrs, lens, ttl=ttl, if_absent=if_absent, replicas=replicas,
                      checks=checks, wait=wait)
