"""Argument checks of :class:`~kvstore.store.KVStore`: numbers, TTLs, clocks, values.

The store checks every argument before it touches anything, so a rejected call raises
an :class:`~kvstore.errors.InvalidArgumentError` and leaves the store unchanged; these
are the checks that do not depend on the store's configuration.
"""

from __future__ import annotations

import math
import numbers

import numpy as np
import numpy.typing as npt

from kvstore.errors import InvalidArgumentError

__all__ = ["int_arg", "real_arg", "check_ttl", "check_clock", "as_view", "last_occurrences"]

I64 = npt.NDArray[np.int64]
U64 = npt.NDArray[np.uint64]


def int_arg(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise InvalidArgumentError(f"{name} must be an int, not {type(value).__name__}")
    if value < minimum:
        raise InvalidArgumentError(f"{name} must be >= {minimum}, not {value}")
    return int(value)


def real_arg(name: str, value: object) -> float:
    """``value`` as a finite float; bools and non-numbers are refused."""
    if isinstance(value, bool | np.bool_) or not isinstance(value, numbers.Real):
        raise InvalidArgumentError(f"{name} must be a number, not {type(value).__name__}")
    try:
        out = float(value)
    except (OverflowError, ValueError, TypeError) as exc:
        raise InvalidArgumentError(f"{name} is not a usable number: {value!r}") from exc
    if not math.isfinite(out):
        raise InvalidArgumentError(f"{name} must be finite, not {out}")
    return out


def check_ttl(ttl: object) -> float:
    seconds = real_arg("ttl", ttl)
    if not seconds > 0:
        raise InvalidArgumentError(f"ttl must be finite and > 0 seconds, not {seconds}")
    return seconds


def check_clock(clock: object) -> None:
    """Calls ``clock`` once: a clock that fails or is not a number fails here, not in a
    later put."""
    if not callable(clock):
        raise InvalidArgumentError(f"clock must be callable, not {type(clock).__name__}")
    try:
        now = clock()
    except Exception as exc:
        raise InvalidArgumentError(f"clock() raised {exc!r}") from exc
    real_arg("clock()", now)


def as_view(value: object) -> memoryview:
    """``value`` as a flat byte view (no copy); anything else is InvalidArgumentError."""
    if isinstance(value, str) or value is None:
        raise InvalidArgumentError(f"a value must be bytes-like, not {type(value).__name__}")
    try:
        view = memoryview(value)  # type: ignore[arg-type]
    except (TypeError, ValueError, BufferError) as exc:  # ValueError: a released view
        raise InvalidArgumentError(
            f"a value must be bytes-like, not {type(value).__name__}: {exc}"
        ) from exc
    if not view.c_contiguous:
        raise InvalidArgumentError("a value must be C-contiguous")
    if view.format == "B" and view.ndim == 1:
        return view
    try:
        return view.cast("B")
    except (TypeError, ValueError):  # formats cast() refuses (structs, ...): reinterpret
        return memoryview(np.frombuffer(view, dtype=np.uint8))  # type: ignore[arg-type]


def last_occurrences(rows: U64) -> I64 | None:
    """Indices (ascending) of the last occurrence of each distinct key row, or None when
    all rows are distinct."""
    n = rows.shape[0]
    if n < 2:
        return None
    rev = rows[::-1]
    if rows.shape[1] == 1:
        _, first = np.unique(rev[:, 0], return_index=True)
    else:
        _, first = np.unique(rev, axis=0, return_index=True)
    if first.size == n:
        return None
    return np.sort(n - 1 - first)
