"""transfer_engine_bench: one quick loopback run end to end, and its refusals."""

from __future__ import annotations

import json
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
    from tests import hardware

    if hardware.rdma_skip_reason() is None:
        pytest.skip("this host has a usable RDMA device")
    rc = main(["--local", "--protocol", "rdma", "--device_name", "mlx5_0", "--duration",
               "0.5"])
    assert rc == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err
    assert err.startswith("transfer_engine_bench: error: --protocol rdma needs device mlx5_0")


def test_metadata_server_other_than_p2p_is_refused(capsys: pytest.CaptureFixture[str]
                                                   ) -> None:
    rc = main(["--local", "--metadata_server", "etcd://10.0.0.1:2379"])
    assert rc == 2
    assert "not supported" in capsys.readouterr().err


def test_initiator_needs_a_target(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--mode", "initiator"]) == 2
    assert "--segment_id" in capsys.readouterr().err
