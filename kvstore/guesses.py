"""Reads a ``get_into`` starts before the master answers.

The client remembers where it last saw each key (its puts and gets; the first replica,
its version, node incarnation, segment and offset). A ``get_into`` starts reading the
keys it remembers while the master locates the batch, and keeps a key's bytes only where
the master reports the same version in the same place; the other keys are read after.
Sound because an object stays where it was put until it is retired, and never comes
back once retired: if the master then reports the same version at the same place (and
leases it), the bytes read were that version's throughout.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from kvstore.client_state import I64, U64, ClientState, Job, Where
from kvstore.errors import InvalidArgumentError
from transfer_engine.errors import TransferEngineError
from transfer_engine.handle import TransferHandle

__all__ = ["Guesses", "Guess"]

_GUESSES = 1 << 16  # remembered key locations (about 200 bytes each)


@dataclass
class Guess:
    """Reads :meth:`Guesses._speculate` started: ``jobs`` as for ``_move``, keyed by
    index into ``nodes`` (node rows); ``picked[i]``: the location guessed for key i."""

    picked: dict[int, tuple[int, tuple[str, ...], int, int]]
    jobs: dict[int, list[Job]]
    nodes: list[tuple[str, ...]]
    handles: list[tuple[int, TransferHandle]]
    failed: dict[int, BaseException]


class Guesses(ClientState):
    """Mixed into :class:`kvstore.client.Client`: key locations remembered, and the
    reads started from them."""

    def _remember(self, rows: U64, idx: npt.NDArray[np.int64], versions: U64,
                  where: Where, lengths: I64) -> None:
        """Notes where keys ``idx`` live (their first replica), for :meth:`_speculate`."""
        if idx.size == 0 or not self._guessing:
            return
        guesses = self._guesses
        node_rows = where.node_rows()
        for (k0, k1), version, p, off, length in zip(
                rows[idx].tolist(), versions[idx].tolist(), where.pools[idx, 0].tolist(),
                where.offsets[idx, 0].tolist(), lengths[idx].tolist(), strict=True):
            if p >= 0:
                guesses[(k0, k1)] = (version, node_rows[p], off, length)
        while len(guesses) > _GUESSES:  # the oldest noted go first
            guesses.popitem(last=False)

    def _speculate(self, rows: U64, dest: I64, caps: I64) -> Guess | None:
        """Starts reading the keys whose place we remember into ``dest``, before the
        master confirms it. Sound because an object stays where it was put until it is
        retired, and never comes back once retired: if the master then reports the same
        version at the same place (and leases it), the bytes read were that version's
        throughout. Keys it reports otherwise are read again (their buffers may hold
        stale bytes meanwhile; a missing key's buffer is not defined)."""
        guesses = self._guesses
        nodes: list[tuple[str, ...]] = []
        index: dict[tuple[str, ...], int] = {}
        jobs: dict[int, list[Job]] = {}
        picked: dict[int, tuple[int, tuple[str, ...], int, int]] = {}
        for i, (key, addr, cap) in enumerate(zip(map(tuple, rows.tolist()), dest.tolist(),
                                                  caps.tolist(), strict=True)):
            g = guesses.get(key)
            if g is None or not 0 < g[3] <= cap:
                continue
            row = g[1]
            j = index.get(row)
            if j is None:
                cached = self._peers.get(row[0])
                if (cached is None or cached[0] != row[1] or cached[1].lost is not None
                        or not self._usable(row[0])):
                    continue  # only nodes we hold a live connection to, same incarnation
                j = index[row] = len(nodes)
                nodes.append(row)
            jobs.setdefault(j, []).append((addr, g[2], g[3], i))
            picked[i] = g
        if not picked:
            return None
        try:
            handles, failed = self._post_moves(False, jobs, nodes, blame=False)
        except InvalidArgumentError:
            return None  # not registered memory: the plain path says so precisely
        return Guess(picked, jobs, nodes, handles, failed)

    def _confirm(self, guess: Guess, found: npt.NDArray[np.bool_], versions: U64,
                 where: Where, lengths: I64) -> npt.NDArray[np.bool_]:
        """Waits for :meth:`_speculate`'s reads; True for keys the master placed where
        they were read (same version, length, node incarnation, segment and offset)."""
        failed = guess.failed
        failed.update(self._wait_moves(guess.handles, guess.nodes,
                                       time.monotonic() + self.timeout, blame=False))
        guess.handles = []
        ok = np.zeros(found.shape[0], dtype=bool)
        node_rows = where.node_rows()
        for node, items in guess.jobs.items():
            if node in failed:
                continue
            for _, off, length, i in items:
                version, row, _, _ = guess.picked[i]
                if not found[i] or int(versions[i]) != version or int(lengths[i]) != length:
                    continue
                for r in range(where.pools.shape[1]):
                    p = int(where.pools[i, r])
                    if p < 0:
                        break
                    if int(where.offsets[i, r]) == off and node_rows[p] == row:
                        ok[i] = True
                        break
        self.guessed_reads += int(ok.sum())
        return ok

    def _abandon(self, guess: Guess) -> None:
        """Stops :meth:`_speculate`'s reads still running (the get failed before it
        could confirm them): nothing lands in the caller's buffers after it returns."""
        for _, handle in guess.handles:
            handle.cancel()  # no-op on one that finished
        for _, handle in guess.handles:
            try:
                handle.wait(self.timeout)
            except TransferEngineError:
                pass
        guess.handles = []
