"""Runs a membership registry on its own: ``python -m transfer_engine.registry``.
The service lives in :mod:`transfer_engine.control.registry`.

Without a control secret (``TE_CONTROL_SECRET`` / ``TE_CONTROL_SECRET_FILE``) it binds
``tcp://127.0.0.1:7100`` and refuses a network-reachable ``--bind`` unless ``--insecure``
(or ``TE_ALLOW_INSECURE=1``) says the network is trusted; with a secret it binds
``tcp://0.0.0.0:7100`` by default.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading

from transfer_engine.control.auth import AuthConfig
from transfer_engine.control.limits import RegistryLimits
from transfer_engine.control.registry import Registry

__all__ = ["Registry", "main"]


def main(argv: list[str] | None = None) -> None:
    """Serves until interrupted (SIGINT/SIGTERM) or until stdin closes with ``--stdin``.
    Prints ``REGISTRY <endpoint> epoch=<epoch> auth=<hmac|none>`` once serving."""
    defaults = RegistryLimits()
    parser = argparse.ArgumentParser(prog="python -m transfer_engine.registry",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--bind", default=None,
                        help="ZeroMQ endpoint to bind (port 0: any free port); default "
                             "tcp://127.0.0.1:7100, or tcp://0.0.0.0:7100 with a secret")
    parser.add_argument("--insecure", action="store_true", default=None,
                        help="allow a network-reachable --bind without a control secret "
                             "(trusted networks only; also TE_ALLOW_INSECURE=1)")
    parser.add_argument("--interval", type=float, default=1.0,
                        help="heartbeat interval members are told to use, seconds")
    parser.add_argument("--max-missed", type=int, default=3,
                        help="silent intervals after which a member is dropped")
    parser.add_argument("--max-members", type=int, default=defaults.max_members,
                        help="members at most (new names beyond it are refused)")
    parser.add_argument("--join-rate", type=float, default=defaults.join_rate,
                        help="registrations per second per source address (0: no limit)")
    parser.add_argument("--join-burst", type=int, default=defaults.join_burst,
                        help="registrations a source address may make at once")
    parser.add_argument("--log-bytes", type=int, default=defaults.log_bytes,
                        help="bytes of events kept for watchers that fall behind")
    parser.add_argument("--stdin", action="store_true",
                        help="stop when stdin closes (for launchers and tests)")
    parser.add_argument("-v", "--verbose", action="store_true")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    auth = AuthConfig.from_env()  # TE_CONTROL_SECRET / TE_CONTROL_SECRET_FILE
    bind = args.bind or ("tcp://0.0.0.0:7100" if auth.secret else "tcp://127.0.0.1:7100")
    try:
        limits = RegistryLimits(max_members=args.max_members, join_rate=args.join_rate,
                                join_burst=args.join_burst, log_bytes=args.log_bytes)
        registry = Registry(bind, auth=auth, interval=args.interval,
                            max_missed=args.max_missed, limits=limits,
                            allow_insecure=args.insecure)
    except ValueError as exc:
        parser.error(str(exc))
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    with registry:
        print(f"REGISTRY {registry.endpoint} epoch={registry.epoch} "
              f"auth={'hmac' if auth.secret else 'none'}", flush=True)
        if args.stdin:
            def stop_at_eof() -> None:
                sys.stdin.read()
                stop.set()
            threading.Thread(target=stop_at_eof, daemon=True, name="registry-stdin").start()
        try:
            while not stop.wait(0.5):
                pass
        except KeyboardInterrupt:
            pass


if __name__ == "__main__":
    main()
