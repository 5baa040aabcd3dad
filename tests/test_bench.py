"""transfer_engine_bench: one quick loopback run end to end, and its refusals."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest

from bench.transfer_engine_bench import main

REQUIRED = ["protocol", "block_size", "batch_size", "gbps", "p50_us", "p99_us",
            "cpu_s_per_gb_initiator", "cpu_s_per_gb_target", "verified"]


@pytest.mark.parametrize("operation", ["write", "read"])
def test_local_tcp_run_writes_json_and_verifies(tmp_path: Path, operation: str,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "bench.json"
    rc = main(["--local", "--duration", "0.5", "--protocol", "tcp", "--block_size", "65536",
               "--batch_size", "8", "--operation", operation, "--json", str(out)])
    assert rc == 0, capsys.readouterr()
    res = json.loads(out.read_text())
    for key in REQUIRED:
        assert key in res, key
    assert res["verified"] is True
    assert res["protocol"] == "tcp" and res["transport"] == "tcp"
    assert res["operation"] == operation
    assert res["block_size"] == 65536 and res["batch_size"] == 8
    assert res["gbps"] > 0 and res["p99_us"] >= res["p50_us"] > 0
    assert res["cpu_s_per_gb_initiator"] > 0 and res["cpu_s_per_gb_target"] > 0
    assert res["coalescable_pairs"] == 0  # shuffled slots by default
    assert len(res["runs"]) == 1
    assert "GB/s" in capsys.readouterr().out


def test_rdma_without_device_is_a_clear_usage_error(capsys: pytest.CaptureFixture[str]
                                                    ) -> None:
    from tests.helpers import hardware

    if hardware.rdma_skip_reason() is None:
        pytest.skip("this host has a usable RDMA device")
    rc = main(["--local", "--protocol", "rdma", "--device_name", "mlx5_0", "--duration",
               "0.5"])
    assert rc == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err
    assert err.startswith("transfer_engine_bench: error: --protocol rdma needs device mlx5_0")


def test_use_vram_says_what_is_missing(capsys: pytest.CaptureFixture[str]) -> None:
    """GPU memory needs torch with CUDA; the emulated NICs move host memory only. Where a
    GPU is, scripts/gpu_check.sh runs --use_vram for real."""
    assert main(["--local", "--use_vram", "--protocol", "rdma", "--emulated"]) == 2
    assert "--emulated" in capsys.readouterr().err
    try:
        import torch

        if torch.cuda.is_available():
            return
    except ImportError:
        pass
    assert main(["--local", "--use_vram", "--duration", "0.3"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("transfer_engine_bench: error: --use_vram")


def test_metadata_server_other_than_p2p_or_a_registry_is_refused(
        capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["--local", "--metadata_server", "redis://127.0.0.1:6379"])
    assert rc == 2
    assert "not supported" in capsys.readouterr().err


def test_target_found_by_name_through_etcd(tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    """Mooncake's way: both sides join the metadata server (a real etcd here) and the
    initiator finds the target by its name."""
    from bench.etcd_server import etcd_server, etcd_skip_reason  # noqa: PLC0415

    reason = etcd_skip_reason()
    if reason:
        pytest.skip(reason)
    with etcd_server(tmp_path) as etcd:
        out = tmp_path / "etcd.json"
        rc = main(["--local", "--duration", "0.3", "--protocol", "tcp", "--block_size",
                   "65536", "--batch_size", "4", "--metadata_server", etcd + "/bench",
                   "--local_server_name", "bench-target-by-name", "--json", str(out)])
        assert rc == 0, capsys.readouterr()
    assert json.loads(out.read_text())["verified"] is True


def test_initiator_needs_a_target(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--mode", "initiator"]) == 2
    assert "--segment_id" in capsys.readouterr().err


def test_socket_baseline_runs_under_the_congestion_control_asked_for() -> None:
    from bench.baselines import socket_baseline
    from transfer_engine.transport.tcp import LOOPBACK_CONGESTION

    if not hasattr(socket, "TCP_CONGESTION"):
        pytest.skip("TCP_CONGESTION is Linux only")
    with open("/proc/sys/net/ipv4/tcp_congestion_control") as f:
        default = f.read().strip()
    host = socket_baseline(65536, 8 << 20, duration=1.0, buffer_size=16 << 20, warmup=0.0)
    auto = socket_baseline(65536, 8 << 20, duration=1.0, buffer_size=16 << 20, warmup=0.0,
                           congestion="auto")
    assert host["congestion"] == default
    assert auto["congestion"] in LOOPBACK_CONGESTION
    assert host["gbps"] > 0 and auto["gbps"] > 0


def test_a_baseline_congestion_control_the_host_refuses_is_a_usage_error(
        capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["--local", "--baseline", "--baseline_congestion", "no-such-cc"])
    assert rc == 2
    err = capsys.readouterr().err
    assert "--baseline_congestion" in err and "'no-such-cc' refused by this host" in err


def test_a_run_with_a_secret_file_is_authenticated(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.delenv("TE_CONTROL_SECRET", raising=False)
    monkeypatch.delenv("TE_CONTROL_SECRET_FILE", raising=False)
    secret = tmp_path / "secret"
    secret.write_text("bench-secret-of-at-least-16-bytes\n")
    out = tmp_path / "results" / "auth.json"  # a folder that does not exist yet
    rc = main(["--local", "--duration", "0.3", "--protocol", "tcp", "--block_size", "65536",
               "--batch_size", "4", "--secret-file", str(secret), "--json", str(out)])
    assert rc == 0, capsys.readouterr()
    res = json.loads(out.read_text())
    assert res["authenticated"] is True and res["verified"] is True
    assert "authenticated" in capsys.readouterr().out


def test_a_short_secret_file_is_a_usage_error(tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    secret = tmp_path / "secret"
    secret.write_text("short")
    assert main(["--local", "--secret-file", str(secret)]) == 2
    assert "16 bytes" in capsys.readouterr().err


def test_many_peers_bench_counts_threads_and_verifies(tmp_path: Path) -> None:
    from bench.peers import main as peers_main
    from transfer_engine.transport.stream.pump import worker_count

    out = tmp_path / "peers.json"
    assert peers_main(["--peers", "6", "--procs", "2", "--rounds", "1", "--block_size",
                       "4096", "--batch_size", "4", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["verified"] and res["peers"] == 6
    assert res["fanout_gbps"] > 0 and res["one_peer_gbps"] > 0 and res["fanout_vs_one"] > 0
    assert res["data_plane_threads_after"] <= worker_count() + 1


def test_charts_draw_without_matplotlib(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                        ) -> None:
    """--plot needs no extra dependency: without matplotlib the chart is an SVG beside
    the asked path, with one bar per value; mismatched series are refused."""
    import builtins

    from bench.charts import bars

    real_import = builtins.__import__

    def no_matplotlib(name: str, *args: object, **kwargs: object) -> object:
        if name.startswith("matplotlib"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    out = bars(["shm\n0 streams", "tcp\n16 streams"],
               {"local TTFT": [60.0, 170.0], "first TTFT": [68.0, 100.0]},
               tmp_path / "sub" / "chart.png", ylabel="ms (p50)")
    assert out == tmp_path / "sub" / "chart.svg"
    svg = out.read_text()
    assert svg.startswith("<svg") and svg.count("<rect") == 4 + 2  # bars + legend
    assert "first TTFT: 100" in svg
    log = bars(["a"], {"x": [0.002]}, tmp_path / "log.png", ylabel="s", log=True)
    assert log.read_text().count("<rect") == 2
    with pytest.raises(ValueError, match="2 values for 1 groups"):
        bars(["a"], {"x": [1.0, 2.0]}, tmp_path / "bad.png", ylabel="s")


def test_pd_serving_gap_windows_and_quantiles() -> None:
    """The serving bench's accounting: a running stream's gap belongs to a probe's
    kind when it ends inside one of that kind's windows."""
    from bench.pd_serving import gaps_in, quantile

    windows = [(1.0, 2.0), (5.0, 6.0)]
    gaps = [(0.5, 0.1), (1.5, 0.2), (2.0, 0.3), (3.0, 0.4), (5.5, 0.5), (7.0, 0.6)]
    assert gaps_in(windows, gaps) == [0.2, 0.3, 0.5]
    assert gaps_in([], gaps) == []
    assert quantile([3.0], 0.99) == 3.0
    assert quantile([1.0, 2.0, 3.0], 0.5) == 2.0
    assert quantile([float(i) for i in range(101)], 0.99) == 99.0


def test_nic_priority_matrix_and_auto_discovery(tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    """Mooncake's two NIC flags: a topology (here ours, three NICs on loopback) read from
    ``--nic_priority_matrix``, and ``--auto_discovery`` opening one tcp rail per NIC pair
    over it; a file that is not a topology is a usage error."""
    topo = tmp_path / "topo.json"
    topo.write_text(json.dumps({"nics": [
        {"name": f"eth{j}", "numa_node": j, "port_state": "ACTIVE",
         "link_rate_gbps": 1, "address": "127.0.0.1"} for j in range(3)]}))
    out = tmp_path / "nics.json"
    rc = main(["--local", "--duration", "0.3", "--protocol", "tcp", "--block_size", "1M",
               "--batch_size", "4", "--nic_priority_matrix", str(topo), "--auto_discovery",
               "--json", str(out)])
    assert rc == 0, capsys.readouterr()
    res = json.loads(out.read_text())
    assert res["verified"] is True
    assert "rails {'tcp': 3}" in capsys.readouterr().out  # a rail per NIC (default: 2)
    bad = tmp_path / "bad.json"
    bad.write_text('{"cpu:0": "mlx5_0"}')
    assert main(["--local", "--nic_priority_matrix", str(bad)]) == 2
    assert "--nic_priority_matrix" in capsys.readouterr().err
