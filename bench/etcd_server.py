"""A real etcd for tests and benches: started on loopback in a temporary folder."""

from __future__ import annotations

import http.client
import shutil
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from bench.fleet import end_process, free_port

ETCD = "etcd"


def etcd_skip_reason() -> str | None:
    if shutil.which(ETCD) is None:
        return ("etcd is not installed (Debian: apt-get install etcd-server; "
                "scripts/setup_etcd.sh does it)")
    return None


def _healthy(port: int) -> bool:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=1)
    try:
        conn.request("POST", "/v3/kv/range", '{"key": "AA=="}')
        return conn.getresponse().status == 200
    except OSError:
        return False
    finally:
        conn.close()


@contextmanager
def etcd_server(data_dir: Path, start_timeout: float = 20.0) -> Iterator[str]:
    """Runs one etcd member on free loopback ports; yields ``etcd://127.0.0.1:PORT``
    and stops it (and removes its data) afterwards, pass or fail."""
    client, peer = free_port(), free_port()
    log = open(data_dir / "etcd.log", "wb")  # noqa: SIM115  (closed below)
    proc = subprocess.Popen(
        [ETCD, "--name", "te-test", "--data-dir", str(data_dir / "etcd"),
         "--listen-client-urls", f"http://127.0.0.1:{client}",
         "--advertise-client-urls", f"http://127.0.0.1:{client}",
         "--listen-peer-urls", f"http://127.0.0.1:{peer}",
         "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
         "--initial-cluster", f"te-test=http://127.0.0.1:{peer}"],
        stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + start_timeout
        while not _healthy(client):
            if proc.poll() is not None or time.monotonic() > deadline:
                tail = (data_dir / "etcd.log").read_text()[-800:]
                raise RuntimeError(f"etcd did not start: {tail}")
            time.sleep(0.05)
        yield f"etcd://127.0.0.1:{client}"
    finally:
        end_process(proc)
        log.close()
        shutil.rmtree(data_dir / "etcd", ignore_errors=True)
