"""Request traces in the ``shared/traces/`` format: one JSON object per line with
``timestamp`` (ms from the start), ``input_length``, ``output_length`` and ``hash_ids``
(one id per block of the prompt; equal ids at equal positions mean an equal prefix).

Ids are chained into keys (a key names a block and everything before it), so prefix
matching never depends on how a trace numbers its blocks. ``hit_bound`` is the share of
blocks an unlimited cache would serve: a block hits when its prefix was seen before.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt

from scheduler.errors import TraceError

__all__ = ["Trace", "load_trace", "synthetic_trace"]


@dataclass(frozen=True)
class Trace:
    """Requests in arrival order: arrival (seconds), prompt and output tokens, keys."""

    name: str
    arrival_s: npt.NDArray[np.float64]
    input_tokens: npt.NDArray[np.int64]
    output_tokens: npt.NDArray[np.int64]
    keys: list[tuple[int, ...]]
    hit_bound: float

    def __len__(self) -> int:
        return len(self.keys)

    def head(self, n: int) -> Trace:
        """The first ``n`` requests (the bound recomputed for them)."""
        keys = self.keys[:n]
        return Trace(self.name, self.arrival_s[:n], self.input_tokens[:n],
                     self.output_tokens[:n], keys, _hit_bound(keys))


def _hit_bound(keys: list[tuple[int, ...]]) -> float:
    seen: set[int] = set()
    hits = total = 0
    for row in keys:
        total += len(row)
        for key in row:
            if key in seen:
                hits += 1
            else:
                seen.add(key)
    return hits / total if total else 0.0


def _build(name: str, rows: list[tuple[float, int, int, list[int]]]) -> Trace:
    rows.sort(key=lambda r: r[0])  # stable: equal timestamps keep file order
    chain: dict[tuple[int, int], int] = {}
    keys = []
    for _, _, _, ids in rows:
        prev = -1
        row = []
        for block in ids:
            prev = chain.setdefault((prev, block), len(chain))
            row.append(prev)
        keys.append(tuple(row))
    t0 = rows[0][0] if rows else 0.0
    return Trace(name,
                 np.array([r[0] - t0 for r in rows], np.float64),
                 np.array([r[1] for r in rows], np.int64),
                 np.array([r[2] for r in rows], np.int64),
                 keys, _hit_bound(keys))


def load_trace(path: str | Path, limit: int | None = None) -> Trace:
    """Reads a JSONL trace (the first ``limit`` lines when given). Raises
    :class:`TraceError` naming the line of the first malformed request."""
    path = Path(path)
    rows: list[tuple[float, int, int, list[int]]] = []
    try:
        with path.open(encoding="utf-8") as fh:
            for lineno, line in enumerate(fh, 1):
                if limit is not None and len(rows) >= limit:
                    break
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                    ts, inp, out = obj["timestamp"], obj["input_length"], obj["output_length"]
                    ids = obj.get("hash_ids", [])
                    if not (isinstance(ts, int | float) and isinstance(inp, int)
                            and isinstance(out, int) and isinstance(ids, list)
                            and all(isinstance(i, int) for i in ids)
                            and ts >= 0 and inp > 0 and out >= 0):
                        raise ValueError("fields have the wrong types or signs")
                except (ValueError, KeyError, TypeError) as exc:
                    raise TraceError(f"{path}:{lineno}: bad request: {exc}") from exc
                rows.append((ts / 1000.0, inp, out, ids))
    except OSError as exc:
        raise TraceError(f"cannot read trace {path}: {exc}") from exc
    if not rows:
        raise TraceError(f"trace {path} holds no requests")
    return _build(path.name, rows)


def synthetic_trace(requests: int = 500, *, seed: int = 0, rate: float = 5.0,
                    block_tokens: int = 512, sessions: int = 40,
                    system_blocks: int = 2) -> Trace:
    """A small conversation-like trace: sessions whose turns extend their earlier
    prompts, behind a few shared system prompts; Poisson arrivals at ``rate`` per
    second. For tests and examples."""
    rng = np.random.default_rng(seed)
    next_id = 0
    systems = []
    for _ in range(3):
        systems.append(list(range(next_id, next_id + system_blocks)))
        next_id += system_blocks
    history: list[list[int]] = []
    rows: list[tuple[float, int, int, list[int]]] = []
    t = 0.0
    for _ in range(requests):
        t += float(rng.exponential(1.0 / rate))
        if history and (len(history) >= sessions or rng.random() < 0.6):
            s = int(rng.integers(len(history)))
        else:
            history.append(list(systems[int(rng.integers(len(systems)))]))
            s = len(history) - 1
        grow = int(rng.integers(1, 6))
        history[s] = history[s] + list(range(next_id, next_id + grow))
        next_id += grow
        ids = history[s][:64]
        tokens = len(ids) * block_tokens - int(rng.integers(0, block_tokens))
        rows.append((t, tokens, int(rng.integers(10, 400)), list(ids)))
    return _build(f"synthetic-{seed}", rows)
