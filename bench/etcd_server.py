"""A real etcd for tests and benches, one member or a cluster, started on loopback in a
temporary folder."""

from __future__ import annotations

import http.client
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from bench.fleet import end_process, free_port
from transfer_engine.control.etcd_client import ETCD_SCHEME, etcd_request
from transfer_engine.errors import TransferEngineError

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


@dataclass
class EtcdMember:
    """One running member: its name, client port and process."""

    name: str
    client_port: int
    proc: subprocess.Popen[bytes]
    log_path: Path

    @property
    def url(self) -> str:
        return f"127.0.0.1:{self.client_port}"


@dataclass
class EtcdCluster:
    """Members started by :func:`etcd_cluster`; ``address`` lists them all."""

    members: list[EtcdMember] = field(default_factory=list)

    @property
    def address(self) -> str:
        return ETCD_SCHEME + ",".join(m.url for m in self.members)

    def leader(self, timeout: float = 10.0) -> int:
        """Index of the member that leads now (asks the live members)."""
        deadline = time.monotonic() + timeout
        while True:
            for member in self.members:
                if member.proc.poll() is not None:
                    continue
                try:
                    status = etcd_request("127.0.0.1", member.client_port,
                                          "/v3/maintenance/status", {}, 1, "status")
                except TransferEngineError:
                    continue
                leader = str(status.get("leader", ""))
                if leader and leader != "0" and leader == str(
                        status.get("header", {}).get("member_id")):
                    return self.members.index(member)
            if time.monotonic() > deadline:
                raise RuntimeError("etcd cluster has no leader")
            time.sleep(0.1)

    def kill(self, index: int) -> None:
        """Takes member ``index`` away as a crash would (SIGKILL)."""
        end_process(self.members[index].proc, signal.SIGKILL)


def _start(name: str, data_dir: Path, client: int, peer: int, cluster: str,
           token: str) -> EtcdMember:
    log_path = data_dir / f"{name}.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [ETCD, "--name", name, "--data-dir", str(data_dir / name),
             "--listen-client-urls", f"http://127.0.0.1:{client}",
             "--advertise-client-urls", f"http://127.0.0.1:{client}",
             "--listen-peer-urls", f"http://127.0.0.1:{peer}",
             "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
             "--initial-cluster", cluster, "--initial-cluster-token", token,
             # a loopback cluster: elect within about half a second of losing a leader
             "--heartbeat-interval", "50", "--election-timeout", "500"],
            stdout=log, stderr=subprocess.STDOUT)
    return EtcdMember(name, client, proc, log_path)


@contextmanager
def etcd_cluster(data_dir: Path, members: int = 3, start_timeout: float = 30.0
                 ) -> Iterator[EtcdCluster]:
    """Runs ``members`` etcd members on free loopback ports as one cluster, and stops
    them (and removes their data) afterwards, pass or fail."""
    ports = [(free_port(), free_port()) for _ in range(members)]
    names = [f"te-{i}" for i in range(members)]
    initial = ",".join(f"{n}=http://127.0.0.1:{peer}"
                       for n, (_, peer) in zip(names, ports, strict=True))
    token = f"te-{os.getpid()}-{ports[0][1]}"
    cluster = EtcdCluster()
    try:
        for name, (client, peer) in zip(names, ports, strict=True):
            cluster.members.append(_start(name, data_dir, client, peer, initial, token))
        deadline = time.monotonic() + start_timeout
        for member in cluster.members:
            while not _healthy(member.client_port):
                if member.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"etcd member {member.name} did not start: "
                                       f"{member.log_path.read_text()[-800:]}")
                time.sleep(0.05)
        yield cluster
    finally:
        for member in cluster.members:
            end_process(member.proc)
            shutil.rmtree(data_dir / member.name, ignore_errors=True)


@contextmanager
def etcd_server(data_dir: Path, start_timeout: float = 20.0) -> Iterator[str]:
    """Runs one etcd member on free loopback ports; yields ``etcd://127.0.0.1:PORT``
    and stops it (and removes its data) afterwards, pass or fail."""
    with etcd_cluster(data_dir, 1, start_timeout) as cluster:
        yield cluster.address
