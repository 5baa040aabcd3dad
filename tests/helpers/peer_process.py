"""A target engine in its own process, for tests that kill or spawn peers.

Usage: python -m tests.helpers.peer_process NAME SIZE SEED TRANSPORTS
Prints 'ENDPOINT <endpoint>' once ready, then serves until stdin closes. With
``TE_PEER_DEVICE=cuda`` its ``dst`` segment is GPU memory (cupy) holding the same bytes.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import numpy as np

from transfer_engine import Engine


def main() -> None:
    name, size, seed, transports = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    buf: Any = np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)
    if os.environ.get("TE_PEER_DEVICE") == "cuda":
        import cupy

        buf = cupy.asarray(buf)
    with Engine(name, transports=transports.split(",")) as engine:
        engine.register(buf, name="dst")
        print("ENDPOINT", engine.endpoint, flush=True)
        sys.stdin.read()  # parent closes stdin (or dies) to stop us


if __name__ == "__main__":
    main()
