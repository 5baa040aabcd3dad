"""Compatibility checks shared by the framework connectors.

Two workers may exchange KV bytes only if they agree on what the bytes mean (model,
dtype, page/block size, layout). Each side describes itself as a flat map of such
*factors*; the hash of that map travels in the handshake, and on a mismatch the factors
themselves name what differs. Pure; imports no framework.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

__all__ = ["compat_hash", "describe_mismatch"]


def compat_hash(factors: dict[str, Any]) -> str:
    """A short, order-independent hash of JSON-serialisable ``factors``."""
    return hashlib.sha256(json.dumps(factors, sort_keys=True).encode()).hexdigest()[:16]


def describe_mismatch(mine: dict[str, Any], theirs: dict[str, Any]) -> str:
    """``"key: ours=.. peer=..; ..."`` for every factor that differs."""
    keys = sorted(set(mine) | set(theirs))
    diffs = [f"{k}: ours={mine.get(k)!r} peer={theirs.get(k)!r}" for k in keys
             if mine.get(k) != theirs.get(k)]
    return "; ".join(diffs) or "factors equal, hash differs"
