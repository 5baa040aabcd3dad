"""An initiator in its own process that WRITEs to a peer's ``dst`` segment in a loop,
for tests that stop it mid-transfer (SIGSTOP) and fence it off the target.

Usage: python -m tests.helpers.late_writer NAME ENDPOINT SIZE TRANSPORT
Prints 'WROTE' after its first write has landed, then writes until one fails, prints
'FAILED <error class>' and exits (or 'BOUND' after 30 s of writes that all landed).
"""

from __future__ import annotations

import sys
import time

import numpy as np

from transfer_engine import Descriptor, Engine
from transfer_engine.errors import TransferEngineError


def main() -> None:
    name, endpoint, size, transport = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    src = np.random.default_rng(7).integers(0, 256, size, dtype=np.uint8)
    with Engine(name, transports=[transport], timeout=10.0) as engine:
        seg = engine.register(src)
        peer = engine.connect(endpoint)
        pairs = [(Descriptor(seg, 0, size), Descriptor(peer.segment("dst"), 0, size))]
        engine.write(peer, pairs).wait(10)
        print("WROTE", flush=True)
        end = time.monotonic() + 30
        while time.monotonic() < end:
            try:
                engine.write(peer, pairs).wait(10)
            except TransferEngineError as exc:
                print("FAILED", type(exc).__name__, flush=True)
                return
        print("BOUND", flush=True)


if __name__ == "__main__":
    main()
