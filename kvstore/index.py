"""Partial-key cuckoo index: 12-slot buckets of 8-bit tags, a location per slot, a stash.

Layout (all NumPy, so a batch is a handful of vectorised operations):

* ``tags  uint8[num_buckets, 12]`` - 0 marks an empty slot, 1..255 is a key's tag. It is
  the ``[:, :12]`` view of a padded ``uint8[num_buckets, 16]`` array whose 4 pad bytes per
  row are always 0, so it is *not* contiguous: index it 2-D (``ravel``/``reshape(-1)``
  would copy the table, and writes to the copy would be lost);
* ``locs  int64[num_buckets, 12]`` - where the record lives (an arena byte offset);
* ``ref   uint8[num_buckets, 12]`` - the CLOCK reference bit of :mod:`kvstore.ttl`; it lives
  here so that cuckoo displacement carries it along with the entry.

A slot's flat position is ``bucket * 12 + slot`` everywhere (it indexes ``locs.ravel()``
and ``ref.ravel()``); only the tag gather in ``_find`` sees the padding.

Why the padding: a lookup batch of 4,096 keys gathers 8,192 random bucket rows of tags,
the largest single cost of a batch at 10 M keys. A 12-byte row can straddle a cache line
and an axis-0 ``np.take`` copies it with a generic row loop; a 16-byte row is aligned and
gathers as one ``V16`` item. Measured on a noisy 2-core VM (ranges over repeated runs):
the gather alone 215-480 us with 12-byte rows versus 115-175 us with 16-byte rows;
``_find`` for a 4,096-key batch (half hits) at 10 M keys, best of 3, 595-620 us versus
420-430 us; ``python -m bench.kvstore_bench --keys 10000000`` 4.7-6.0 M versus 6.5-7.6 M
lookups/s. The padding costs 4 bytes per bucket (4 MB at 10 M keys).

A key hashes (splitmix64) to ``h``; its primary bucket is ``h & mask``, its tag the top 8
bits of ``h`` (never 0), and its alternate bucket ``b ^ ALT[tag]`` where ``ALT`` is a fixed
table of 256 odd numbers. XOR makes the map an involution, so an entry sitting in either
bucket finds the other one from ``(bucket, tag)`` alone: displacement never reads a key.
``ALT`` is odd, so the two buckets always differ.

Full keys are not kept here. Records in the arena start with their key (key-in-value), so
a candidate slot is confirmed by gathering the key at its location through ``keys_at``
(one fancy-index over the arena's ``uint64`` view). Against a parallel
``uint64[num_buckets, 12]`` key column we measured, at 10 M keys, 5.0 us versus 3.7 us to
gather the ~2,250 candidate keys of a 4,096-key batch: about 0.3% of the ~430 us ``_find``
takes per batch, while the column would cost 8 bytes per slot (~100 MB at 10 M keys) and
would have to follow every compaction. So the index stays tag + location only. Tag false
positives are 24/255 per lookup, so confirmation gathers about one key per hit and 0.1
per miss.

Insert first places what it can without displacement (each key goes to the emptier of its
two buckets; keys racing for one bucket are ranked so each takes a different free slot),
then runs a bounded breadth-first search for a displacement path per remaining key, then
uses the stash. A batch that cannot be placed completely is rolled back: the index is left
holding exactly the entries it had (positions may differ after displacement).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

import numpy as np
import numpy.typing as npt

from kvstore.errors import CapacityError, InvalidArgumentError, KeyFormatError

__all__ = ["CuckooIndex", "SLOTS", "ABSENT", "KeysAt", "hash_keys", "has_duplicates"]

SLOTS = 12
"""Slots per bucket."""

ROW_BYTES = 16
"""Bytes per bucket row of the tag array: ``SLOTS`` tags, then pad bytes that stay 0."""
_ROW_SHIFT = ROW_BYTES.bit_length() - 1
assert ROW_BYTES == 1 << _ROW_SHIFT >= SLOTS

ABSENT = -1
"""Location and position of a key that is not in the index."""

U64 = npt.NDArray[np.uint64]
I64 = npt.NDArray[np.int64]
KeysAt = Callable[[I64], U64]
"""Returns the full keys (``uint64[n, key_words]``) of the records at the given locations."""

_C1 = np.uint64(0xBF58476D1CE4E5B9)
_C2 = np.uint64(0x94D049BB133111EB)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _mix(x: U64) -> U64:
    """splitmix64 finaliser; block hashes are already random, this guards against
    structured keys (counters, small integers) piling into few buckets."""
    x = x ^ (x >> np.uint64(30))
    x = x * _C1
    x = x ^ (x >> np.uint64(27))
    x = x * _C2
    return x ^ (x >> np.uint64(31))


def hash_keys(keys: U64) -> U64:
    """64-bit hash of each key row of ``uint64[n, w]``."""
    h = _mix(keys[:, 0])
    for j in range(1, keys.shape[1]):
        h = _mix(h ^ (keys[:, j] + _GOLDEN * np.uint64(j)))
    return h


_ALT: I64 = (
    (_mix(np.arange(256, dtype=np.uint64) * _GOLDEN + np.uint64(1)) >> np.uint64(2)) | np.uint64(1)
).astype(np.int64)


class CuckooIndex:
    """Maps keys to record locations; see the module docstring for the scheme.

    Parameters:
        num_buckets: buckets in the table, a power of two (``SLOTS`` slots each).
        keys_at: reads the full keys of records at locations, for confirmation.
        key_words: 1 for 64-bit keys, 2 for 128-bit keys.
        stash_size: entries kept aside when displacement fails.
        max_search: buckets a breadth-first displacement search may visit per key.
    """

    def __init__(
        self,
        num_buckets: int,
        keys_at: KeysAt,
        *,
        key_words: int = 1,
        stash_size: int = 16,
        max_search: int = 2048,
    ) -> None:
        if num_buckets < 2 or num_buckets & (num_buckets - 1):
            raise InvalidArgumentError(
                f"num_buckets must be a power of two >= 2, not {num_buckets}"
            )
        if key_words not in (1, 2):
            raise InvalidArgumentError(f"key_words must be 1 or 2, not {key_words}")
        self.num_buckets = num_buckets
        self.key_words = key_words
        self.mask = num_buckets - 1
        self.max_search = max_search
        self._keys_at = keys_at
        # Tags live in 16-byte rows (12 tags + 4 zero pad bytes): aligned rows never
        # straddle a cache line and gather as one 16-byte item (see _find).
        self._tag_rows = np.zeros((num_buckets, ROW_BYTES), dtype=np.uint8)
        self._tag_items = self._tag_rows.view(f"V{ROW_BYTES}").reshape(num_buckets)
        self._tags = self._tag_rows[:, :SLOTS]
        self.locs = np.full((num_buckets, SLOTS), -1, dtype=np.int64)
        self.ref = np.zeros((num_buckets, SLOTS), dtype=np.uint8)
        self._count = 0
        self.stash_tags = np.zeros(stash_size, dtype=np.uint8)
        self.stash_bucket = np.zeros(stash_size, dtype=np.int64)
        self.stash_locs = np.full(stash_size, -1, dtype=np.int64)
        self._stash_count = 0

    @classmethod
    def for_capacity(
        cls, entries: int, keys_at: KeysAt, *, max_load: float = 0.9, **kwargs: int
    ) -> CuckooIndex:
        """An index with room for ``entries`` at a load factor of at most ``max_load``."""
        need = max(2, -(-int(entries) // max(1, int(SLOTS * max_load))))
        return cls(1 << (need - 1).bit_length(), keys_at, **kwargs)

    # -- sizes -------------------------------------------------------------------------

    def __len__(self) -> int:
        return self._count + self._stash_count

    @property
    def tags(self) -> npt.NDArray[np.uint8]:
        """``uint8[num_buckets, SLOTS]``, 0 where a slot is empty. A view into the padded
        rows, so it is not contiguous: ``tags.ravel()``/``reshape(-1)`` copy (writes to
        the copy are lost, and it costs the whole table); index it 2-D, or use
        :meth:`occupied` for a range of flat positions."""
        return self._tags

    def occupied(self, start: int, end: int) -> npt.NDArray[np.bool_]:
        """Whether each flat slot position in ``[start, end)`` holds an entry (stash not
        included); reads only the buckets of that range."""
        b0, b1 = start // SLOTS, -(-end // SLOTS)
        # astype: a new C-contiguous array (reshape is a view), ~1.6x `!= 0` on the view
        occ = self._tags[b0:b1].astype(np.bool_).reshape(-1)
        return occ[start - b0 * SLOTS : end - b0 * SLOTS]

    @property
    def slots(self) -> int:
        """Slots in the table proper (the stash is not counted)."""
        return self.num_buckets * SLOTS

    @property
    def load_factor(self) -> float:
        return len(self) / self.slots

    @property
    def stash_count(self) -> int:
        return self._stash_count

    def __repr__(self) -> str:
        return (
            f"<CuckooIndex buckets={self.num_buckets} entries={len(self)} "
            f"load={self.load_factor:.3f} stash={self._stash_count}>"
        )

    # -- hashing -----------------------------------------------------------------------

    def check_keys(self, keys: npt.ArrayLike) -> U64:
        """``keys`` as a C-contiguous ``uint64[n, key_words]``; rejects other shapes."""
        arr = np.asarray(keys)
        if arr.dtype != np.uint64:
            raise KeyFormatError(f"keys must be a uint64 array, not {arr.dtype}")
        if self.key_words == 1 and arr.ndim == 1:
            arr = arr[:, None]
        if arr.ndim != 2 or arr.shape[1] != self.key_words:
            want = "(n,)" if self.key_words == 1 else f"(n, {self.key_words})"
            raise KeyFormatError(f"keys must have shape {want}, not {arr.shape}")
        return np.ascontiguousarray(arr)

    def _hash(self, keys: U64, h: U64 | None = None
              ) -> tuple[I64, npt.NDArray[np.uint8], I64]:
        if h is None:
            h = hash_keys(keys)
        b1 = (h & np.uint64(self.mask)).astype(np.int64)
        tag = (h >> np.uint64(56)).astype(np.uint8)
        tag |= tag == 0  # 0 marks empty; map it to 1
        b2 = (b1 ^ np.take(_ALT, tag)) & self.mask
        return b1, tag, b2

    def _alt(self, bucket: int, tag: int) -> int:
        return (bucket ^ int(_ALT[tag])) & self.mask

    # -- lookup ------------------------------------------------------------------------

    def _find(self, keys: U64, hashed: tuple[I64, npt.NDArray[np.uint8], I64] | None = None
              ) -> tuple[I64, I64]:
        """Location and position of each key; -1/-1 when absent. A position is the flat
        slot number ``bucket * SLOTS + slot``, or ``-2 - i`` for stash entry ``i``.
        ``hashed``: the keys' ``_hash``, when the caller has it."""
        n = keys.shape[0]
        b1, tag, b2 = self._hash(keys) if hashed is None else hashed
        cand = np.empty(2 * n, dtype=np.int64)  # key i: candidates 2i and 2i+1
        cand[0::2] = b1
        cand[1::2] = b2
        # Gather each candidate's 16-byte row as one item (2-3x faster than an axis-0
        # take of 12-byte rows, which may straddle cache lines), then compare flat against
        # the tag repeated to 32 bytes per key: a contiguous 1-D compare is ~10x a
        # broadcast over rows. Pad bytes are 0 and tags never are, so a pad never matches.
        wanted = np.repeat(tag, 2 * ROW_BYTES)
        match = np.take(self._tag_items, cand).view(np.uint8) == wanted
        hits = np.flatnonzero(match)  # flatnonzero on the flat mask is ~40x np.nonzero
        # hit byte h: key h // 32, candidate h // 16, slot h % 16 (shifts: ~2x faster)
        rows = hits >> (_ROW_SHIFT + 1)
        flat = np.take(cand, hits >> _ROW_SHIFT) * SLOTS + (hits & (ROW_BYTES - 1))
        cloc = np.take(self.locs.ravel(), flat)
        ok = self._confirm(cloc, keys, rows)
        loc = np.full(n, -1, dtype=np.int64)
        pos = np.full(n, -1, dtype=np.int64)
        found = rows[ok]
        loc[found] = cloc[ok]
        pos[found] = flat[ok]
        if self._stash_count:
            sm = (self.stash_tags[None, :] == tag[:, None]) & (
                self.stash_bucket[None, :] == b1[:, None]
            )
            srows, sidx = np.nonzero(sm)
            if srows.size:
                sloc = self.stash_locs[sidx]
                sok = self._confirm(sloc, keys, srows)
                loc[srows[sok]] = sloc[sok]
                pos[srows[sok]] = -2 - sidx[sok]
        return loc, pos

    def _confirm(self, cloc: I64, keys: U64, rows: I64) -> npt.NDArray[np.bool_]:
        if cloc.size == 0:
            return np.zeros(0, dtype=bool)
        stored = self._keys_at(cloc)
        if self.key_words == 1:
            return np.asarray(stored[:, 0] == keys[rows, 0])
        return np.asarray((stored == keys[rows]).all(axis=1))

    def lookup(self, keys: npt.ArrayLike, *, touch: bool = True) -> I64:
        """Location of each key, -1 where absent. ``touch`` sets the CLOCK reference bit
        of every hit."""
        k = self.check_keys(keys)
        loc, pos = self._find(k)
        if touch:
            hit = pos[pos >= 0]
            self.ref.ravel()[hit] = 1
        return loc

    def positions(self, keys: npt.ArrayLike) -> tuple[I64, I64]:
        """``(locations, positions)`` of each key (-1 where absent); see ``_find``."""
        return self._find(self.check_keys(keys))

    # -- insert ------------------------------------------------------------------------

    def insert(self, keys: npt.ArrayLike, locs: npt.ArrayLike, *,
               distinct: bool = False) -> I64:
        """Maps each key to its location; returns the previous locations (-1 for new
        keys). Keys in one batch must be distinct. The records at ``locs`` must already
        hold their keys (confirmation reads them).

        Raises :class:`CapacityError` when a key finds no slot; the batch is then rolled
        back and the index holds exactly what it held before. ``distinct``: the caller
        checked already that the keys are distinct.
        """
        k = self.check_keys(keys)
        loc = np.ascontiguousarray(np.asarray(locs, dtype=np.int64).reshape(-1))
        n = k.shape[0]
        if loc.shape[0] != n:
            raise InvalidArgumentError(f"{n} keys but {loc.shape[0]} locations")
        h = hash_keys(k)
        if not distinct and has_duplicates(k, h):
            raise InvalidArgumentError("keys in one batch must be distinct")
        b1, tag, b2 = hashed = self._hash(k, h)
        old, pos = self._find(k, hashed)
        exists = pos != ABSENT
        if exists.any():
            self._set_at(pos[exists], loc[exists])
        new = np.flatnonzero(~exists)
        if new.size == 0:
            return old
        if new.size < n:
            b1, tag, b2 = b1[new], tag[new], b2[new]
        nloc = loc[new]
        pending = self._place_direct(b1, tag, b2, nloc)
        for j, i in enumerate(pending.tolist()):
            if not self._insert_one(int(b1[i]), int(tag[i]), int(b2[i]), int(nloc[i])):
                placed = np.ones(new.size, dtype=bool)
                placed[pending[j:]] = False
                self._delete_found(*self._find(k[new[placed]]))
                if exists.any():
                    _, epos = self._find(k[exists])
                    self._set_at(epos, old[exists])
                raise CapacityError(
                    f"index full: no slot for a key after displacement search and stash "
                    f"(entries={len(self)}, load={self.load_factor:.3f}); batch rolled back"
                )
        return old

    def _place_direct(self, b1: I64, tag: npt.NDArray[np.uint8], b2: I64, loc: I64) -> I64:
        """Places keys into a free slot of one of their buckets without displacement;
        returns the indices (into the arguments) of keys left over."""
        pending = np.arange(b1.size, dtype=np.int64)
        tags = self._tags
        for rnd in range(3):
            if pending.size == 0:
                break
            p1, p2 = b1[pending], b2[pending]
            free1 = (tags[p1] == 0).sum(axis=1)
            free2 = (tags[p2] == 0).sum(axis=1)
            prefer2 = free2 > free1
            if rnd == 1:
                prefer2 = ~prefer2
            choose = np.where(prefer2, p2, p1)
            order = np.argsort(choose, kind="stable")
            cb = choose[order]
            start = np.ones(cb.size, dtype=bool)
            start[1:] = cb[1:] != cb[:-1]
            freemask = tags[cb] == 0
            if start.all():  # one key per bucket (the usual case): its first free slot
                ok = freemask.any(axis=1)
                slot = np.argmax(freemask, axis=1)
            else:
                first = np.flatnonzero(start)
                rank = np.arange(cb.size) - np.repeat(first, np.diff(np.append(first,
                                                                               cb.size)))
                ok = rank < freemask.sum(axis=1)
                slot = np.argmax(np.cumsum(freemask, axis=1) > rank[:, None], axis=1)
            flat = cb[ok] * SLOTS + slot[ok]
            idx = pending[order[ok]]
            tags[cb[ok], slot[ok]] = tag[idx]
            self.locs.ravel()[flat] = loc[idx]
            self.ref.ravel()[flat] = 0
            self._count += int(flat.size)
            pending = np.sort(pending[order[~ok]])
        return pending

    def _insert_one(self, b1: int, tag: int, b2: int, loc: int) -> bool:
        """Breadth-first search for a path to a free slot, then shifts entries along it.
        Falls back to the stash. Returns False (nothing changed) when both fail."""
        tags = self._tags
        parent: dict[int, tuple[int, int]] = {b1: (-1, -1), b2: (-1, -1)}
        queue = deque((b1, b2))
        visited = 0
        while queue and visited < self.max_search:
            b = queue.popleft()
            visited += 1
            row = tags[b]
            free = np.flatnonzero(row == 0)
            if free.size:
                self._shift_along(parent, b, int(free[0]))
                fb, fs = self._path_head
                tags[fb, fs] = tag
                self.locs[fb, fs] = loc
                self.ref[fb, fs] = 0
                self._count += 1
                return True
            alts = ((b ^ _ALT[row]) & self.mask).tolist()
            for s, a in enumerate(alts):
                if a not in parent:
                    parent[a] = (b, s)
                    queue.append(a)
        if self._stash_count < self.stash_tags.size:
            i = int(np.flatnonzero(self.stash_locs < 0)[0])
            self.stash_tags[i] = tag
            self.stash_bucket[i] = b1
            self.stash_locs[i] = loc
            self._stash_count += 1
            return True
        return False

    def _shift_along(self, parent: dict[int, tuple[int, int]], b: int, s: int) -> None:
        """Moves each entry on the path one step towards the free slot ``(b, s)``; leaves
        the freed slot at the root in ``_path_head``."""
        tags, locs, ref = self._tags, self.locs, self.ref
        while True:
            pb, ps = parent[b]
            if pb < 0:
                self._path_head = (b, s)
                return
            tags[b, s] = tags[pb, ps]
            locs[b, s] = locs[pb, ps]
            ref[b, s] = ref[pb, ps]
            b, s = pb, ps

    # -- update / delete ---------------------------------------------------------------

    def _set_at(self, pos: I64, loc: I64) -> None:
        table = pos >= 0
        self.locs.ravel()[pos[table]] = loc[table]
        self.stash_locs[-2 - pos[~table]] = loc[~table]

    def set_locations(self, positions: npt.ArrayLike, locs: npt.ArrayLike) -> None:
        """Points the entries at ``positions`` (from :meth:`entries`) at new locations;
        compaction uses this after moving records."""
        self._set_at(np.asarray(positions, dtype=np.int64), np.asarray(locs, dtype=np.int64))

    def delete(self, keys: npt.ArrayLike) -> I64:
        """Removes the keys; returns their locations (-1 where absent)."""
        loc, pos = self._find(self.check_keys(keys))
        self._delete_found(loc, pos)
        return loc

    def delete_at(self, positions: npt.ArrayLike) -> I64:
        """Removes the entries at ``positions``; returns their locations."""
        pos = np.asarray(positions, dtype=np.int64)
        table = pos >= 0
        loc = np.empty(pos.size, dtype=np.int64)
        loc[table] = self.locs.ravel()[pos[table]]
        loc[~table] = self.stash_locs[-2 - pos[~table]]
        self._delete_found(loc, pos)
        return loc

    def _delete_found(self, loc: I64, pos: I64) -> None:
        tpos = pos[pos >= 0]
        self._tags[tpos // SLOTS, tpos % SLOTS] = 0
        self.locs.ravel()[tpos] = -1
        self.ref.ravel()[tpos] = 0
        self._count -= int(tpos.size)
        spos = -2 - pos[pos <= -2]
        if spos.size:
            self.stash_locs[spos] = -1
            self.stash_tags[spos] = 0
            self._stash_count -= int(spos.size)
        if self._stash_count and tpos.size:
            self._drain_stash()

    def _drain_stash(self) -> None:
        """Moves stash entries back into the table when one of their buckets has room."""
        for i in np.flatnonzero(self.stash_locs >= 0).tolist():
            tag = int(self.stash_tags[i])
            b1 = int(self.stash_bucket[i])
            for b in (b1, self._alt(b1, tag)):
                free = np.flatnonzero(self._tags[b] == 0)
                if free.size:
                    s = int(free[0])
                    self._tags[b, s] = tag
                    self.locs[b, s] = self.stash_locs[i]
                    self.ref[b, s] = 0
                    self.stash_locs[i] = -1
                    self.stash_tags[i] = 0
                    self._stash_count -= 1
                    self._count += 1
                    break

    def entries(self) -> tuple[I64, I64]:
        """``(positions, locations)`` of every entry, table first, then stash."""
        padded = np.flatnonzero(self._tag_rows)  # pads are 0; no copy of the table
        flat = padded // ROW_BYTES * SLOTS + padded % ROW_BYTES
        sidx = np.flatnonzero(self.stash_locs >= 0)
        pos = np.concatenate((flat, -2 - sidx))
        loc = np.concatenate((self.locs.ravel()[flat], self.stash_locs[sidx]))
        return pos, loc

    def clear(self) -> None:
        self._tag_rows.fill(0)
        self.locs.fill(-1)
        self.ref.fill(0)
        self.stash_tags.fill(0)
        self.stash_locs.fill(-1)
        self._count = 0
        self._stash_count = 0


def has_duplicates(keys: U64, h: U64 | None = None) -> bool:
    """Whether two rows of ``uint64[n, w]`` are equal. Sorts one 64-bit word per row (equal
    rows give equal words; ``h``: the rows' ``hash_keys``, when known); only when words
    collide are whole rows compared."""
    if keys.shape[0] < 2:
        return False
    w = keys[:, 0] if keys.shape[1] == 1 else (hash_keys(keys) if h is None else h)
    s = np.sort(w)
    if not (s[1:] == s[:-1]).any():
        return False
    if keys.shape[1] == 1:
        return True
    return bool(np.unique(keys, axis=0).shape[0] != keys.shape[0])
