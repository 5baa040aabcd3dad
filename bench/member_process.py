"""An engine that joins a registry, in its own process, for registry benches and tests.

Usage: python -m bench.member_process NAME REGISTRY ROLE SIZE [SECRET]
Registers a segment "dst" of SIZE bytes, prints 'READY <endpoint>' once it is a member,
then one 'EVENT <kind> <name>' line per membership event, until stdin closes (it then
leaves the registry and exits).
"""

from __future__ import annotations

import sys
import threading

import numpy as np

from transfer_engine import Engine
from transfer_engine.control.metastore import MemberEvent

_out = threading.Lock()


def say(line: str) -> None:
    """One line, written whole: the events thread and the main thread both print, and
    ``print(a, b)`` writes its pieces separately, so two threads' lines could mix."""
    with _out:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()


def main() -> None:
    name, registry, role, size = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    secret = sys.argv[5] if len(sys.argv) > 5 else None
    buf = np.zeros(size, dtype=np.uint8)
    with Engine(name, transports=["tcp"], registry=registry, role=role, auth=secret,
                timeout=5.0) as engine:
        engine.register(buf, name="dst")

        def show(event: MemberEvent) -> None:
            say(f"EVENT {event.kind.value} {event.name}")

        assert engine.membership is not None
        with engine.membership.watch(show):
            say(f"READY {engine.endpoint}")
            sys.stdin.read()  # parent closes stdin (or dies) to stop us


if __name__ == "__main__":
    main()
