"""The engines' Prometheus port: real engines moving random bytes, scraped over HTTP."""

from __future__ import annotations

import re
import shutil
import socket
import ssl
import subprocess
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from transfer_engine.descriptor import Descriptor
from transfer_engine.engine import Engine
from transfer_engine.latency import BUCKETS, Latencies
from transfer_engine.metrics import serve_metrics

pytest.importorskip("prometheus_client", reason="pip install 'transfer-engine[metrics]'")


def scrape(url: str, context: ssl.SSLContext | None = None) -> dict[str, float]:
    text = urllib.request.urlopen(url, timeout=10, context=context).read().decode()
    return {m[0]: float(m[1]) for m in re.findall(r"^(te_engine\S+) (\S+)$", text, re.M)}


def test_latencies_fall_in_their_buckets() -> None:
    lat = Latencies()
    lat.observe("read", "tcp", 0.0001)  # on a bound: that bucket
    lat.observe("read", "tcp", 0.003)
    lat.observe("read", "tcp", 99.0)  # past the last bound
    lat.observe("write", "shm", 0.02)
    snap = lat.snapshot()
    counts, total = snap[("read", "tcp")]
    assert len(counts) == len(BUCKETS) + 1 and sum(counts) == 3
    assert counts[0] == 1 and counts[BUCKETS.index(0.005)] == 1 and counts[-1] == 1
    assert total == pytest.approx(99.0031)
    assert sum(snap[("write", "shm")][0]) == 1


def test_scrape_counts_what_the_engines_moved() -> None:
    """Two engines, a WRITE and a READ of 1 MiB of random bytes over tcp: the counters,
    the peers and a latency histogram per operation; closing frees the port."""
    size = 1 << 20
    rng = np.random.default_rng(5)
    with Engine("m-a", transports=["tcp"]) as a, Engine("m-b", transports=["tcp"]) as b:
        src = rng.integers(0, 256, size, dtype=np.uint8)
        back = np.zeros(size, dtype=np.uint8)
        remote = np.zeros(size, dtype=np.uint8)
        s_src, s_back = a.register(src, name="src"), a.register(back, name="back")
        b.register(remote, name="dst")
        peer = a.connect(b.endpoint)
        dst = peer.segment("dst")
        a.write(peer, [(Descriptor(s_src, 0, size), Descriptor(dst, 0, size))]).wait(10)
        a.read(peer, [(Descriptor(s_back, 0, size), Descriptor(dst, 0, size))]).wait(10)
        assert np.array_equal(remote, src) and np.array_equal(back, src)
        with serve_metrics([a, b]) as server:
            got = scrape(server.url)
            port = server.port
        assert got['te_engine_events_total{engine="m-a",event="transfers_done"}'] == 2
        assert got['te_engine_events_total{engine="m-a",event="bytes_write"}'] == size
        assert got['te_engine_events_total{engine="m-a",event="bytes_read"}'] == size
        assert got['te_engine_peers{engine="m-a"}'] == 1
        assert got['te_engine_transfers_in_flight{engine="m-a"}'] == 0
        for op in ("write", "read"):
            labels = f'engine="m-a",op="{op}",transport="tcp"'
            assert got[f"te_engine_transfer_seconds_count{{{labels}}}"] == 1
            assert got[f"te_engine_transfer_seconds_sum{{{labels}}}"] > 0
            inf = f'te_engine_transfer_seconds_bucket{{engine="m-a",le="+Inf",op="{op}",' \
                  'transport="tcp"}'
            assert got[inf] == 1
    with socket.socket() as probe, pytest.raises(ConnectionRefusedError):
        probe.connect(("127.0.0.1", port))


def test_only_loopback_without_mutual_tls() -> None:
    with Engine("m-c") as engine:
        with pytest.raises(ValueError, match="open to other machines"):
            serve_metrics(engine, host="0.0.0.0")
        with pytest.raises(ValueError, match="needs certfile, keyfile and client_cafile"):
            serve_metrics(engine, certfile="/nonexistent")


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")
def test_mutual_tls_admits_only_certified_clients(tmp_path: Path) -> None:
    """With TLS the port answers a client whose certificate the given CA signed and
    refuses one without."""
    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=tmp_path, check=True, capture_output=True,
                       timeout=60)

    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=ca",
        "-keyout", "ca.key", "-out", "ca.pem")
    for who in ("server", "client"):
        run("req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=127.0.0.1", "-keyout",
            f"{who}.key", "-out", f"{who}.csr")
        (tmp_path / "ext").write_text("subjectAltName=IP:127.0.0.1\n")
        run("x509", "-req", "-in", f"{who}.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
            "-CAcreateserial", "-days", "1", "-extfile", "ext", "-out", f"{who}.pem")
    with Engine("m-tls") as engine, serve_metrics(
            engine, certfile=str(tmp_path / "server.pem"),
            keyfile=str(tmp_path / "server.key"),
            client_cafile=str(tmp_path / "ca.pem")) as server:
        url = f"https://127.0.0.1:{server.port}/metrics"
        ctx = ssl.create_default_context(cafile=str(tmp_path / "ca.pem"))
        with pytest.raises((urllib.error.URLError, ssl.SSLError, ConnectionError)):
            scrape(url, ctx)  # no client certificate
        ctx.load_cert_chain(str(tmp_path / "client.pem"), str(tmp_path / "client.key"))
        assert 'te_engine_peers{engine="m-tls"}' in scrape(url, ctx)
