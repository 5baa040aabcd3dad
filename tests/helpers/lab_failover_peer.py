"""The initiator of the NIC failover test, run inside a lab host.

    python tests/helpers/lab_failover_peer.py HOST ENDPOINT NIC_TIMEOUT [NIC_WAIT]

Prints ``RAILS``, then for each line of stdin: ``go`` runs one step, a 16 MiB WRITE
(printing ``STARTED`` once posted, then ``WROTE ok|<error>``), a READ back and its
byte comparison (``EXACT True|False|<error>``), and how many works moved between NICs
(``FAILOVERS``);
``rails`` prints the NICs of the peer's open rails (``RAILS``).
"""

from __future__ import annotations

import sys
import time

import numpy as np

from transfer_engine import Descriptor, Engine, TransferEngineError
from transfer_engine.transport.tcp import TcpTransport

MiB = 1 << 20


def main() -> None:
    host, endpoint, nic_timeout = sys.argv[1], sys.argv[2], float(sys.argv[3])
    nic_wait = float(sys.argv[4]) if len(sys.argv) > 4 else None
    tcp = TcpTransport(host=host, nics="auto", rails=1, nic_timeout=nic_timeout,
                       nic_wait=nic_wait)
    with Engine("init", host=host, transports=[tcp], timeout=5, peer_timeout=30) as eng:
        data = np.random.default_rng(3).integers(0, 256, 16 * MiB, np.uint8)
        back = np.zeros_like(data)
        src, dst_local = eng.register(data), eng.register(back)
        peer = eng.connect(endpoint)
        dst = peer.segment("dst")
        pairs = [(Descriptor(src, i * MiB, MiB), Descriptor(dst, i * MiB, MiB))
                 for i in range(16)]
        print("RAILS", ",".join(str(r.nic) for r in peer.rails["tcp"]), flush=True)
        for _ in range(64):  # bounded: a test sends a few dozen lines at most
            line = sys.stdin.readline().strip()
            if line == "rails":
                print("RAILS", ",".join(str(r.nic) for r in peer.rails["tcp"]
                                        if not r.closed), flush=True)
                continue
            if line != "go":
                return
            t0 = time.monotonic()
            handle = eng.write(peer, pairs)
            print("STARTED", flush=True)
            try:
                handle.wait(60)
                print("WROTE ok", round(time.monotonic() - t0, 2), flush=True)
            except TransferEngineError as exc:
                print("WROTE", type(exc).__name__, round(time.monotonic() - t0, 2),
                      str(exc).replace("\n", " "), flush=True)
                continue
            try:
                eng.read(peer, [(Descriptor(dst_local, i * MiB, MiB),
                                 Descriptor(dst, i * MiB, MiB)) for i in range(16)]
                         ).wait(60)
            except TransferEngineError as exc:
                print("EXACT", type(exc).__name__, flush=True)  # the read back failed
                continue
            print("EXACT", bool(np.array_equal(data, back)), flush=True)
            print("FAILOVERS", tcp.failovers, flush=True)


if __name__ == "__main__":
    main()
