"""A fleet member in a lab host: joins the registry with its host's pod and zone, waits
for ``N`` members, prints how it sees each (``path_class`` from their records), and
stays until stdin closes.

    python tests/helpers/lab_member.py NAME HOST REGISTRY POD ZONE N
"""

from __future__ import annotations

import json
import sys
import time

from scheduler.policy import path_class
from transfer_engine import Engine


def main() -> None:
    name, host, registry, pod, zone, n = sys.argv[1:7]
    with Engine(name, host=host, transports=["tcp"], registry=registry, role="decode",
                pod=pod, zone=zone, timeout=10) as engine:
        deadline = time.monotonic() + 30
        members = engine.members()
        while len(members) < int(n) and time.monotonic() < deadline:
            time.sleep(0.05)
            members = engine.members()
        me = next(m for m in members if m.name == name)
        print(json.dumps({m.name: [m.host, m.zone, m.pod,
                                   path_class(me.to_wire(), m.to_wire()).name]
                          for m in members}), flush=True)
        sys.stdin.read()


if __name__ == "__main__":
    main()
