"""``python -m transfer_engine.lab up|down``: build or remove a fleet lab from a shell.

    python -m transfer_engine.lab up --hosts 4 --nics 2 --rate-mbit 1000 --delay-ms 1 --zones 2
    ip netns exec te-lab-h0 env TE_TOPOLOGY_FILE=/run/te-lab/lab/te-lab-h0.topology.json ...
    python -m transfer_engine.lab down

``up`` prints the lab's hosts as JSON (namespace, zone, pod, NIC addresses, topology
file) and whether its delays come from the userspace delay line (``delay_line``: a
kernel without netem), and leaves the lab in place; ``down`` removes it, delay line
included.
"""

from __future__ import annotations

import argparse
import json
import sys

from transfer_engine.lab.fleet import Lab, LabConfig, down
from transfer_engine.lab.netns import LabError, lab_skip_reason


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m transfer_engine.lab")
    sub = parser.add_subparsers(dest="cmd", required=True)
    up = sub.add_parser("up", help="create the lab (removing an old one of that name)")
    up.add_argument("--hosts", type=int, default=2)
    up.add_argument("--nics", type=int, default=1)
    up.add_argument("--rate-mbit", type=float, default=1000.0)
    up.add_argument("--delay-ms", type=float, default=0.0)
    up.add_argument("--zones", type=int, default=1)
    up.add_argument("--cross-zone-delay-ms", type=float, default=0.0)
    up.add_argument("--delay-line", action="store_true",
                    help="wire ports through the userspace delay line (for set_loss)")
    up.add_argument("--name", default="lab", help="lab tag: 1-8 of [a-z0-9]")
    dn = sub.add_parser("down", help="remove the lab")
    dn.add_argument("--name", default="lab")
    args = parser.parse_args(argv)
    reason = lab_skip_reason()
    if reason:
        print(f"cannot build a lab here: {reason}", file=sys.stderr)
        return 2
    try:
        if args.cmd == "down":
            print(json.dumps({"removed": down(args.name)}))
            return 0
        config = LabConfig(hosts=args.hosts, nics=args.nics, rate_mbit=args.rate_mbit,
                           delay_ms=args.delay_ms, zones=args.zones,
                           cross_zone_delay_ms=args.cross_zone_delay_ms,
                           delay_line=args.delay_line, tag=args.name)
        lab = Lab(config)  # left up on purpose: `down` removes it
        print(json.dumps({"lab": args.name, "delay_line": lab.wired,
                          "hosts": [h.to_json() for h in lab.hosts]}, indent=1))
        return 0
    except (LabError, ValueError) as exc:
        print(f"lab {args.cmd} failed: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
