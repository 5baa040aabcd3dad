"""The store's client: asks the master where, then moves the bytes itself.

A batch costs one round trip to the master to place or locate every key, then one
engine WRITE or READ per storage node (all nodes at once, each a :class:`Blocks` of the
batch's values on that node), then, for a put, one round trip to commit. Leases taken by
gets are released on the next request, with no round trip of their own. A ``get_into``
hides the locate: it starts reading where each key was last seen (by this client's puts
and gets) while the master answers, and keeps a key's bytes only where the master
reports the same version in the same place; the other keys are read after.

Keys are 128-bit on the wire. An ``int`` key (e.g. a chained block hash from
:func:`kvstore.block_hashes`) is used as it is, as are ``bytes`` of exactly 16 bytes (the
same key, little-endian); a ``str`` (its UTF-8 bytes) or other ``bytes`` is hashed
(BLAKE2b-128), so Mooncake-style string keys work too and distinct strings never share
one (see :mod:`kvstore.keys`). Batches may also be ``uint64`` arrays of shape ``(n,)`` or
``(n, 2)`` (low word first).

Guarantees: a get returns the bytes of a committed put, never a half-written,
uncommitted or reused range (the master's lease keeps the space; a read that completes
after its lease ran out is repeated). When a node dies during a get, the keys it held
are read from another replica, or the get raises :class:`ObjectUnavailableError`
naming the key. With ``verify=True`` a value whose CRC32 does not match is read from
another replica, or fails the same way. A ``get_into`` buffer whose key comes back
missing may have been written (with bytes of an older value); its content is not defined.

This module holds the client's life cycle, its get path and its queries; the rest is
mixed in from one module each (see :mod:`kvstore.client_state`): :mod:`kvstore.puts`,
:mod:`kvstore.transfers` (moving the bytes), :mod:`kvstore.guesses` (reads started
before the master answers). :class:`Lookup` (:mod:`kvstore.lookup`), :func:`key_rows` and
:func:`crc` (:mod:`kvstore.keys`) are importable from here too.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from typing import Any

import numpy as np
import numpy.typing as npt

from kvstore.client_state import I64, U64, Where, expect
from kvstore.errors import InvalidArgumentError, ObjectUnavailableError
from kvstore.guesses import Guess, Guesses
from kvstore.keys import crc, key_int, key_rows
from kvstore.link import MasterLink
from kvstore.lookup import Lookup, leading, query
from kvstore.protocol import (
    MAX_BATCH,
    KvFound,
    KvGet,
    KvLocated,
    KvRemove,
    KvStats,
    KvStatsReply,
    Status,
    column,
)
from kvstore.puts import Puts
from kvstore.tiers import LocalTier
from kvstore.transfers import STAGING_KEEP, Transfers, buffer_span, memory_view, staging_pieces
from transfer_engine import Engine
from transfer_engine.closeable import Closeable
from transfer_engine.control.auth import AuthConfig
from transfer_engine.errors import ProtocolError, TransferEngineError
from transfer_engine.peer import Peer
from transfer_engine.segment import Segment

__all__ = ["Client", "Lookup", "key_rows", "crc"]

log = logging.getLogger(__name__)


class Client(Puts, Guesses, Transfers, Closeable):
    """A client of the cluster store.

    Parameters:
        master: the master's endpoint, e.g. ``tcp://127.0.0.1:7400``.
        engine: the engine that moves the bytes (not closed by the client); default one
            of its own on ``host``.
        replicas: copies of each put value, on distinct nodes (fewer when fewer nodes
            are up).
        staging_bytes: registered memory for ``put``/``get`` of plain bytes (grows to
            the largest batch, up to 64 MiB or ``staging_bytes`` if more: a get of more
            is read in pieces, and a larger value in memory of its own, given back
            after); ``put_from``/``get_into`` use your registered buffers.
        max_value_bytes: the largest value ``get``/``batch_get`` accept; the master
            naming a longer one is refused (:class:`InvalidArgumentError`), since the
            client would allocate what it claims. ``get_into`` is bounded by its buffers.
        checksum: record a CRC32 of each value on put (what ``verify`` checks); costs a
            pass over the bytes (about 3.6 GB/s here).
        timeout: seconds for a master request and for a batch's transfers.
        auth: control-message signing, as for engines and the master.
        local_cache_bytes: memory for a local DRAM tier in front of the cluster (0:
            none): gets are served from it when the master's version matches, values
            read or written are kept in it; see :mod:`kvstore.tiers` for the rule that
            keeps it from serving stale values.
        local_max_value_bytes: the largest value the local tier keeps.
    """

    def __init__(self, master: str, *, engine: Engine | None = None, name: str | None = None,
                 host: str = "127.0.0.1", replicas: int = 1, staging_bytes: int = 16 << 20,
                 checksum: bool = False, timeout: float = 10.0,
                 auth: AuthConfig | str | bytes | None = None, local_cache_bytes: int = 0,
                 local_max_value_bytes: int = 4 << 20, max_value_bytes: int = 1 << 30
                 ) -> None:
        self._closed = True
        if not isinstance(auth, AuthConfig):
            auth = AuthConfig(secret=auth) if auth is not None else AuthConfig.from_env()
        if not 1 <= replicas <= 4:
            raise InvalidArgumentError(f"replicas must be 1..4, not {replicas}")
        for what, v in (("staging_bytes", staging_bytes), ("max_value_bytes", max_value_bytes)):
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise InvalidArgumentError(f"{what} must be an int > 0, not {v!r}")
        self.max_value_bytes = max_value_bytes
        self.replicas = replicas
        self.checksum = checksum
        self.timeout = timeout
        self._stack = ExitStack()
        try:
            if engine is None:
                engine = self._stack.enter_context(
                    Engine(name or f"kvclient-{uuid.uuid4().hex[:8]}", host=host, auth=auth))
            self.engine = engine
            self._link = MasterLink(master, auth.signer())
            self._stack.callback(self._link.close)
            self._tier: LocalTier | None = None
            if local_cache_bytes:
                self._tier = self._stack.enter_context(
                    LocalTier(local_cache_bytes, max_value_bytes=local_max_value_bytes))
        except BaseException:
            self._stack.close()
            raise
        self._lock = threading.RLock()
        self._release: list[int] = []
        self._peers: dict[str, tuple[str, Peer]] = {}  # node -> (incarnation, peer)
        self._bad: dict[str, float] = {}  # node -> monotonic time until we skip it
        self._buffers: list[tuple[int, int, Segment]] = []  # sorted (start, end, seg)
        self._staging: np.ndarray | None = None
        self._staging_seg: Segment | None = None
        self._staging_min = staging_bytes
        self._staging_keep = max(staging_bytes, STAGING_KEEP)
        # key -> (version, node row, offset, length) of a replica seen lately: a get_into
        # starts reading there while the master confirms it (see _speculate)
        self._guesses: OrderedDict[tuple[int, int], tuple[int, tuple[str, ...], int, int]] = \
            OrderedDict()
        self._guessing = False  # from the first get_into on: only it can use them
        self._late_failed: list[int] = []  # keys of puts that did not wait, not stored
        self._late_reasons: list[str] = []
        self.remote_hits = 0
        self.guessed_reads = 0
        self._closed = False

    def __repr__(self) -> str:
        return (f"<Client master={self._link.address} peers={len(self._peers)} "
                f"{'CLOSED' if self._closed else 'OPEN'}>")

    def close(self) -> None:
        """Releases leases still held (best effort) and everything the client owns."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            try:  # commits of puts that did not wait: sent already, their answers read
                self._link.drain(min(self.timeout, 5.0))
            except TransferEngineError:
                pass
            if self._late_failed:
                log.warning("kvstore client: %d values of puts that did not wait were not "
                            "stored (%s)", len(self._late_failed), "; ".join(self._late_reasons))
            if self._release:
                try:
                    self._link.request(KvStats(release=self._take_release()), 1.0)
                except TransferEngineError:
                    pass  # they expire on their own
            if self._staging_seg is not None:
                self._staging_seg.close()
            self._stack.close()

    # -- get ---------------------------------------------------------------------------

    def _locate(self, rows: U64, between: Callable[[], None] | None = None
                ) -> tuple[U64, Where, I64, U64, float]:
        """(versions, replicas, lengths, checksums, lease end) of each key; ``between``
        runs while the master works on the request. A malformed answer raises
        :class:`ProtocolError` naming the master (its lease is still released)."""
        started = time.monotonic()
        master = self._link.address
        reply = expect(self._request(KvGet(keys=rows.tobytes(), release=self._take_release()),
                                     between), KvLocated, master)
        n = rows.shape[0]
        if reply.lease_id:
            if not 0 < reply.lease_id < 1 << 64:  # it goes back as a u64 with the next request
                raise ProtocolError(f"kv-located: lease id {reply.lease_id} is not a u64",
                                    peer=master)
            self._release.append(reply.lease_id)
        if reply.lease_s < 0:
            raise ProtocolError(f"kv-located: lease of {reply.lease_s} s", peer=master)
        return (column(reply.versions, "<u8", n, "versions", master), Where.of(reply, n, master),
                column(reply.lengths, "<i8", n, "lengths", master),
                column(reply.checksums, "<u8", n, "checksums", master), started + reply.lease_s)

    def _sizes(self, rows: U64, found: npt.NDArray[np.bool_], lengths: I64, staged: bool
               ) -> I64:
        """The found keys' lengths (0 for the others), refused when negative or, for a get
        into staging, over ``max_value_bytes``: the client would allocate what the master
        claims."""
        lengths = np.where(found, lengths, 0)
        bad = (lengths < 0) | ((lengths > self.max_value_bytes) if staged else False)
        if not bad.any():
            return lengths
        i = int(np.flatnonzero(bad)[0])
        what = f"kv-located: {int(lengths[i])} bytes for key {key_int(rows[i]):#x}"
        if lengths[i] < 0:
            raise ProtocolError(f"{what}: a length is never negative", peer=self._link.address)
        # true or not, the value is too large to stage: the caller's choice, not the master's
        raise InvalidArgumentError(f"{what}: over this client's max_value_bytes="
                                   f"{self.max_value_bytes} for values read into staging "
                                   "(get_into reads larger ones into your buffers)")

    def _get(self, rows: U64, dest: I64 | None, caps: I64 | None, verify: bool
             ) -> tuple[I64, list[bytes | None]]:
        """Reads every key into ``dest[i]`` (registered memory of ``caps[i]`` bytes) or,
        with ``dest`` None, through staging. Returns (lengths, -1 where missing; without
        ``dest``, the values, None where missing)."""
        guessed: list[Guess] = []
        between: Callable[[], None] | None = None
        self._guessing |= dest is not None
        if dest is not None and caps is not None and not verify and self._tier is None \
                and self._guesses:
            def speculate() -> None:
                assert dest is not None and caps is not None
                g = self._speculate(rows, dest, caps)
                if g is not None:
                    guessed.append(g)
            between = speculate
        try:
            for _attempt in range(2):
                versions, where, lengths, checks, lease_end = self._locate(rows, between)
                between = None
                guess = guessed[0] if guessed and guessed[0].handles else None
                found = where.status == Status.OK
                lengths = self._sizes(rows, found, lengths, staged=dest is None)
                out = np.where(found, lengths, -1)
                values: list[bytes | None] = []
                if dest is None:
                    values = self._read_staged(rows, found, versions, where, lengths, checks,
                                               verify)
                else:
                    assert caps is not None
                    small = found & (lengths > caps)
                    if small.any():
                        i = int(np.flatnonzero(small)[0])
                        raise InvalidArgumentError(
                            f"key {i}: value of {int(lengths[i])} bytes does not fit its "
                            f"{int(caps[i])}-byte buffer")
                    self._local(dest[found], lengths[found])
                    self._fetch(rows, found, found, versions, where, dest, lengths, checks,
                                verify, guess)
                self._remember(rows, np.flatnonzero(found), versions, where, lengths)
                if time.monotonic() < lease_end:
                    return out, values
                log.info("kvstore client: a read outlived its lease; reading again")
            raise ObjectUnavailableError("reads keep outliving their leases (master lease_s "
                                         "too short for these transfers?)")
        finally:
            for g in guessed:
                if g.handles:
                    self._abandon(g)

    def _read_staged(self, rows: U64, found: npt.NDArray[np.bool_], versions: U64,
                     where: Where, lengths: I64, checks: U64, verify: bool
                     ) -> list[bytes | None]:
        """The found keys' values, read through the staging buffer in pieces of at most
        the staging kept between calls, so a large batch does not grow it for good (a
        value larger than that is a piece of its own, in a buffer given back after)."""
        n = rows.shape[0]
        padded = (lengths + 63) & ~63
        values: list[bytes | None] = [None] * n
        pieces = staging_pieces(padded, found, self._staging_keep)
        if not pieces and self._tier is not None:  # the tier still drops what is gone
            self._fetch(rows, found, found, versions, where, np.zeros(n, dtype=np.int64),
                        lengths, checks, verify)
        try:
            for piece in pieces:
                sizes = padded[piece]
                offs = np.zeros(n, dtype=np.int64)
                offs[piece] = np.cumsum(sizes) - sizes
                # no local here keeps the buffer (see _staged)
                base = self._stage(int(sizes.sum()))[1]
                want = np.zeros(n, dtype=bool)
                want[piece] = True
                self._fetch(rows, want, found, versions, where, offs + base, lengths, checks,
                            verify)
                for i, o, m in zip(piece.tolist(), offs[piece].tolist(),
                                   lengths[piece].tolist(), strict=True):
                    values[i] = self._staged(o, m)
        finally:
            self._trim_staging()
        return values

    def _fetch(self, rows: U64, want: npt.NDArray[np.bool_], found: npt.NDArray[np.bool_],
               versions: U64, where: Where, addrs: I64, lengths: I64, checks: U64,
               verify: bool, guess: Guess | None = None) -> None:
        """Gets the keys ``want`` (some of those ``found``) to ``addrs``: from the local
        tier, from the reads a guess started, or else from the nodes (then kept in the
        local tier)."""
        remote = want.copy()
        if self._tier is not None:  # it also drops its copies of keys not found
            sel = np.flatnonzero(want | ~found)
            served = self._tier.serve(rows[sel], versions[sel], found[sel], addrs[sel],
                                      checks[sel] if verify else None, crc)
            remote[sel[served]] = False
        if guess is not None:
            remote = remote & ~self._confirm(guess, want, versions, where, lengths)
        self._read(rows, remote, where, addrs, lengths, checks, verify)
        self.remote_hits += int(remote.sum())
        if self._tier is not None and remote.any():
            got = np.flatnonzero(remote)
            self._tier.fill(rows[got], versions[got],
                            [memory_view(int(addrs[i]), int(lengths[i])) for i in got],
                            promotion=True)

    def _read(self, rows: U64, found: npt.NDArray[np.bool_], where: Where, addrs: I64,
              lengths: I64, checks: U64, verify: bool) -> None:
        n = rows.shape[0]
        nrep = (where.pools >= 0).sum(axis=1)
        tried = np.zeros_like(where.pools, dtype=bool)
        why: dict[int, list[str]] = {}
        pending = np.flatnonzero(found & (lengths > 0))
        deadline = time.monotonic() + self.timeout
        nodes = where.nodes
        for _ in range(where.pools.shape[1] + 1):
            if pending.size == 0:
                return
            jobs: dict[int, list[tuple[int, int, int, int]]] = {}
            chosen: dict[int, int] = {}
            lost: list[int] = []
            for i in pending.tolist():
                pick = -1
                for s in range(int(nrep[i])):
                    r = (i + s) % int(nrep[i])  # spread a batch over the replicas
                    if not tried[i, r] and self._usable(str(nodes[where.pools[i, r]][0])):
                        pick = r
                        break
                if pick < 0:
                    lost.append(i)
                    continue
                tried[i, pick] = True
                chosen[i] = pick
                jobs.setdefault(int(where.pools[i, pick]), []).append(
                    (int(addrs[i]), int(where.offsets[i, pick]), int(lengths[i]), i))
            if lost:
                i = lost[0]
                key = key_int(rows[i])
                raise ObjectUnavailableError(
                    f"no readable replica of key {key:#x} ({len(lost)} of {n} keys): "
                    f"{'; '.join(why.get(i, ['every replica node failed recently']))}",
                    key=key, reasons=why.get(i, []))
            bad = self._move(False, jobs, nodes, deadline)
            again: list[int] = []
            for node, items in jobs.items():
                for _, _, _, i in items:
                    if node in bad:
                        why.setdefault(i, []).append(f"{nodes[node][0]}: {bad[node]}")
                        again.append(i)
            if verify:
                for i, r in chosen.items():
                    if int(where.pools[i, r]) in bad or not checks[i]:
                        continue
                    if crc(memory_view(int(addrs[i]), int(lengths[i]))) != int(checks[i]):
                        why.setdefault(i, []).append(f"{nodes[where.pools[i, r]][0]}: "
                                                     "checksum mismatch")
                        again.append(i)
            pending = np.array(sorted(set(again)), dtype=np.int64)
        if pending.size:
            raise ObjectUnavailableError(f"{pending.size} keys could not be read")

    def batch_get(self, keys: object, *, verify: bool = False) -> list[bytes | None]:
        """Values of ``keys`` (None where missing). ``verify``: check the CRC32 recorded
        at put (values put without one are not checked). Raises
        :class:`ObjectUnavailableError` when a key's every replica fails, and
        :class:`ProtocolError` when the master's answer is malformed and
        :class:`InvalidArgumentError` when it names a value over ``max_value_bytes`` (the
        client stays usable)."""
        rows = key_rows(keys)
        with self._lock:
            return self._get(rows, None, None, verify)[1]

    def get(self, key: object, *, verify: bool = False) -> bytes | None:
        return self.batch_get([key], verify=verify)[0]

    def get_into(self, keys: object, buffers: Sequence[Any], *, verify: bool = False
                 ) -> list[int | None]:
        """Zero-copy get into buffers lying inside registered memory; returns each value's
        length (None where missing)."""
        rows = key_rows(keys)
        spans = [buffer_span(b, writable=True) for b in buffers]
        if len(spans) != rows.shape[0]:
            raise InvalidArgumentError(f"{rows.shape[0]} keys but {len(spans)} buffers")
        return self.get_into_addresses(rows, [a for a, _ in spans], [n for _, n in spans],
                                       verify=verify)

    def get_into_addresses(self, keys: object, addresses: Sequence[int],
                           sizes: Sequence[int], *, verify: bool = False
                           ) -> list[int | None]:
        """As :meth:`get_into`, with raw addresses inside registered buffers."""
        rows = key_rows(keys)
        addrs = np.asarray(addresses, dtype=np.int64)
        caps = np.asarray(sizes, dtype=np.int64)
        if addrs.shape != (rows.shape[0],) or caps.shape != addrs.shape:
            raise InvalidArgumentError("one address and one size per key")
        out: list[int | None] = []
        with self._lock:
            for s in range(0, max(1, rows.shape[0]), MAX_BATCH):
                e = s + MAX_BATCH
                lengths, _ = self._get(rows[s:e], addrs[s:e], caps[s:e], verify)
                out += [None if n < 0 else n for n in lengths.tolist()]
        return out

    # -- queries -----------------------------------------------------------------------

    def batch_exists(self, keys: object) -> npt.NDArray[np.bool_]:
        with self._lock:
            return query(keys, self._request, self._take_release)

    def exists(self, key: object) -> bool:
        return bool(self.batch_exists([key])[0])

    def longest_prefix(self, block_hashes: object) -> int:
        """How many leading blocks of a chain of block hashes are stored (one round trip
        for the whole chain)."""
        return leading(self.batch_exists(block_hashes))

    def batch_remove(self, keys: object) -> npt.NDArray[np.bool_]:
        """Removes keys; True where one was stored. Readers holding a lease finish
        reading the old bytes."""
        rows = key_rows(keys)
        out = np.zeros(rows.shape[0], dtype=bool)
        with self._lock:
            if self._tier is not None:
                self._tier.invalidate(rows)
            for s in range(0, rows.shape[0], MAX_BATCH):
                reply = expect(self._request(KvRemove(keys=rows[s:s + MAX_BATCH].tobytes(),
                                                      release=self._take_release())),
                               KvFound, self._link.address)
                st = column(reply.status, "<i1", min(MAX_BATCH, rows.shape[0] - s), "status",
                            self._link.address)
                out[s:s + MAX_BATCH] = st == Status.OK
        return out

    def remove(self, key: object) -> bool:
        return bool(self.batch_remove([key])[0])

    def stats(self) -> dict[str, Any]:
        """The master's view (objects, pools and free space, leases, counters such as
        ``demotions``, ``disk_hits``, ``disk_promotions``) and this client's:
        ``remote_hits`` (values read from nodes), ``guessed_reads`` (values a
        ``get_into`` read before the master answered), ``late_put_failures`` (values of
        puts that did not wait, not stored, not yet reported by :meth:`flush`), and with
        a local tier ``local_hits``,
        ``promotions`` (remote hits kept locally), ``local_writes``, ``local_stale``
        (copies dropped: another version, or the key is gone), ``local_evictions``,
        ``local_entries``."""
        with self._lock:
            reply = expect(self._request(KvStats(release=self._take_release())),
                           KvStatsReply, self._link.address)
            out = dict(reply.stats)
            out["remote_hits"] = self.remote_hits
            out["guessed_reads"] = self.guessed_reads
            out["late_put_failures"] = len(self._late_failed)
            if self._tier is not None:
                out.update(self._tier.counters())
            return out

