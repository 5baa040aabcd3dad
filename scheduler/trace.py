"""Request traces in the ``shared/traces/`` format: one JSON object per line with
``timestamp`` (ms from the start), ``input_length``, ``output_length`` and ``hash_ids``
(one id per block of the prompt; equal ids at equal positions mean an equal prefix).

Ids are chained into keys (a key names a block and everything before it), so prefix
matching never depends on how a trace numbers its blocks. ``hit_bound`` is the share of
blocks an unlimited cache would serve: a block hits when its prefix was seen before.

:func:`read_trace` is the one check of a trace's lines (other readers, such as
``bench.store_trace``, build on it): a line must be UTF-8 JSON, an object, with a finite
``timestamp`` in ``[0, 2**53)`` ms (whole milliseconds exact), an ``input_length`` in
``[1, 2**63)``, an ``output_length`` in ``[0, 2**63)`` and ``hash_ids`` (if present) of
ids in ``[0, 2**64)``, no more than prompt tokens; ``true``/``false`` are not numbers
here, nor are ``NaN`` and ``Infinity``. Anything else raises :class:`TraceError` naming
the file and line.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt

from scheduler.errors import TraceError

__all__ = ["Trace", "TraceLine", "load_trace", "read_trace", "synthetic_trace"]


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


MAX_TIMESTAMP_MS = 1 << 53
"""Timestamps stay below this many ms (every whole millisecond is exact in a float)."""
MAX_LENGTH = (1 << 63) - 1
MAX_HASH_ID = (1 << 64) - 1


@dataclass(frozen=True)
class TraceLine:
    """One request line of a trace file, checked."""

    line: int  # 1-based, for messages
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: list[int] | None  # None: the line has no ``hash_ids``


def read_trace(path: str | Path, limit: int | None = None) -> Iterator[TraceLine]:
    """The requests of a JSONL trace in file order (the first ``limit`` when given),
    each checked as the module says; blank lines are skipped. Raises
    :class:`TraceError` naming the file and line of the first malformed one, or when
    the file cannot be read."""
    path = Path(path)
    count = 0
    try:
        with path.open("rb") as fh:  # bytes: a line that is not UTF-8 gets its number too
            for lineno, raw in enumerate(fh, 1):
                if limit is not None and count >= limit:
                    return
                if not raw.strip():
                    continue
                try:
                    req = _parse(raw, lineno)
                except (ValueError, RecursionError) as exc:
                    raise TraceError(f"{path}:{lineno}: bad request: {exc}") from exc
                count += 1
                yield req
    except OSError as exc:
        raise TraceError(f"cannot read trace {path}: {exc}") from exc


def _parse(raw: bytes, lineno: int) -> TraceLine:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"not UTF-8 ({exc.reason} at byte {exc.start})") from exc
    obj = json.loads(text, parse_constant=_no_constant)
    if not isinstance(obj, dict):
        raise ValueError(f"a request is a JSON object, not {type(obj).__name__}")
    for name in ("timestamp", "input_length", "output_length"):
        if name not in obj:
            raise ValueError(f"no {name!r}")
    ts = obj["timestamp"]
    # NaN and the infinities fail the comparison; a huge int does not become a float
    if isinstance(ts, bool) or not isinstance(ts, int | float) or \
            not 0 <= ts < MAX_TIMESTAMP_MS:
        raise ValueError(f"timestamp {_show(ts)} is not a number of ms in [0, 2**53)")
    ids = obj.get("hash_ids")
    if "hash_ids" in obj:
        if not isinstance(ids, list):
            raise ValueError(f"hash_ids is a {type(ids).__name__}, not a list of ids")
        for i, h in enumerate(ids):
            _integer(h, f"hash_ids[{i}]", 0, MAX_HASH_ID)
    inp = _integer(obj["input_length"], "input_length", 1, MAX_LENGTH)
    out = _integer(obj["output_length"], "output_length", 0, MAX_LENGTH)
    if ids is not None and len(ids) > inp:
        raise ValueError(f"{len(ids)} hash_ids for {inp} prompt tokens (a block holds one "
                         "token at least)")
    return TraceLine(lineno, float(ts), inp, out, ids)


def _integer(value: object, name: str, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"{name} {_show(value)} is not an integer in [{low}, {high}]")
    return value


def _show(value: object) -> str:
    """``value`` for a message, cut short (a trace line may hold a 4000-digit number)."""
    text = json.dumps(value) if not isinstance(value, int) or abs(value) < 10**30 \
        else f"of {len(str(abs(value)))} digits"
    return text if len(text) <= 40 else text[:37] + "..."


def _no_constant(name: str) -> float:
    raise ValueError(f"{name} is not a number a trace may hold")


def load_trace(path: str | Path, limit: int | None = None) -> Trace:
    """Reads a JSONL trace (the first ``limit`` requests when given). Raises
    :class:`TraceError` naming the line of the first malformed request (see
    :func:`read_trace`)."""
    rows = [(r.timestamp_ms / 1000.0, r.input_length, r.output_length, r.hash_ids or [])
            for r in read_trace(path, limit)]
    if not rows:
        raise TraceError(f"trace {path} holds no requests")
    return _build(Path(path).name, rows)


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
