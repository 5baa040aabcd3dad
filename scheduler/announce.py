"""Announces a serving instance (a vLLM or SGLang HTTP server) in the registry so that
routers find it: a member of role ``prefill`` or ``decode`` whose ``transports`` map
carries ``"http": {"url": ...}``. The record's lease lives as long as this process (or
the :class:`Announcement`); when it ends, routers see the member leave or expire.

    python -m scheduler.announce --registry tcp://10.0.0.1:7100 --name prefill-0 \\
        --role prefill --url http://10.0.0.2:8100 --pod pod-a --zone zone-1
"""

from __future__ import annotations

import argparse
import signal
import socket
import threading
import uuid
from typing import Any

from transfer_engine.control.client import RegistryStore
from transfer_engine.control.metastore import MemberRecord, MetadataStore

__all__ = ["http_record", "Announcement", "main"]


def http_record(name: str, role: str, url: str, *, pod: str = "", zone: str = "",
                host: str = "", kv_tokens: int | None = None) -> MemberRecord:
    """The member record of a serving instance reachable at ``url``."""
    http: dict[str, Any] = {"url": url}
    if kv_tokens:
        http["kv_tokens"] = kv_tokens
    return MemberRecord(name, uuid.uuid4().hex[:16], role=role,
                        host=host or socket.gethostname(), pod=pod, zone=zone,
                        transports={"http": http})


class Announcement:
    """Keeps ``record`` in the registry at ``registry`` until :meth:`close`.

    :param timeout: seconds for each registry request.
    """

    def __init__(self, registry: str, record: MemberRecord, *, timeout: float = 5.0,
                 auth: Any = None) -> None:
        self.record = record
        self.store: MetadataStore = RegistryStore(registry, auth=auth, timeout=timeout,
                                                  name=record.name)
        try:
            self.store.put(record, timeout)
        except BaseException:
            self.store.close()
            raise
        self._closed = False

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self.store.delete(self.record.name, 2.0)
        finally:
            self.store.close()

    def __enter__(self) -> Announcement:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m scheduler.announce",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--registry", required=True)
    ap.add_argument("--name", required=True)
    ap.add_argument("--role", required=True, choices=["prefill", "decode"])
    ap.add_argument("--url", required=True, help="the server's base URL")
    ap.add_argument("--pod", default="")
    ap.add_argument("--zone", default="")
    ap.add_argument("--kv-tokens", type=int, help="KV capacity in tokens (decode)")
    args = ap.parse_args(argv)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    record = http_record(args.name, args.role, args.url, pod=args.pod, zone=args.zone,
                         kv_tokens=args.kv_tokens)
    with Announcement(args.registry, record):
        print(f"announced {args.name} ({args.role}) at {args.url}", flush=True)
        try:
            stop.wait()
        except KeyboardInterrupt:
            pass


if __name__ == "__main__":
    main()
