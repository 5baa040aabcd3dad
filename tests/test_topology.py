"""Topology discovery and NIC choice, on fake sysfs trees built in tmp_path.

The tree mirrors a real two-socket GPU server: each socket has a root port with a PCIe
switch below it holding two GPUs and one NIC, and socket 1 has a second NIC straight on
a root port.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from transfer_engine.topology import (
    Gpu,
    Nic,
    Topology,
    TopologyFileError,
    discover,
    load,
    load_topology_file,
    normalize_bus_id,
    nvml_gpu_bus_ids,
    parse_topology,
    preferred_nics,
    stripe_weights,
)

SW0 = "pci0000:16/0000:16:00.0/0000:17:00.0"  # socket 0: root port, switch upstream port
SW1 = "pci0000:a0/0000:a0:00.0/0000:a1:00.0"  # socket 1
DEVICES = {
    # name: (pci path, numa)
    "gpu0": (f"{SW0}/0000:18:00.0/0000:19:00.0", 0),
    "gpu1": (f"{SW0}/0000:18:04.0/0000:1a:00.0", 0),
    "mlx5_0": (f"{SW0}/0000:18:08.0/0000:1b:00.0", 0),
    "gpu2": (f"{SW1}/0000:a2:00.0/0000:a3:00.0", 1),
    "mlx5_1": (f"{SW1}/0000:a2:08.0/0000:a5:00.0", 1),
    "mlx5_2": ("pci0000:c0/0000:c0:01.0/0000:c1:00.0", 1),  # socket 1, no switch
}
GPU_BUS_IDS = ["00000000:19:00.0", "00000000:1A:00.0", "00000000:A3:00.0"]


def make_sysfs(root: Path, nics: dict[str, tuple[str, str, str]] | None = None) -> Path:
    """Builds devices/, bus/pci/devices/ links and class/infiniband/ entries."""
    nics = nics if nics is not None else {
        "mlx5_0": ("4: ACTIVE", "200 Gb/sec (4X HDR)", "InfiniBand"),
        "mlx5_1": ("4: ACTIVE", "100 Gb/sec (4X EDR)", "InfiniBand"),
        "mlx5_2": ("4: ACTIVE", "400 Gb/sec (4X NDR)", "Ethernet"),
    }
    for name, (path, numa) in DEVICES.items():
        dev = root / "devices" / path
        dev.mkdir(parents=True, exist_ok=True)
        (dev / "numa_node").write_text(f"{numa}\n")
        bus = root / "bus" / "pci" / "devices"
        bus.mkdir(parents=True, exist_ok=True)
        os.symlink(os.path.relpath(dev, bus), bus / path.rsplit("/", 1)[1])
        if name in nics:
            state, rate, layer = nics[name]
            cls = root / "class" / "infiniband" / name
            cls.mkdir(parents=True)
            os.symlink(os.path.relpath(dev, cls), cls / "device")
            port = cls / "ports" / "1"
            port.mkdir(parents=True)
            (port / "state").write_text(state + "\n")
            (port / "rate").write_text(rate + "\n")
            (port / "link_layer").write_text(layer + "\n")
    return root


@pytest.fixture
def topo(tmp_path: Path) -> Topology:
    return discover(make_sysfs(tmp_path), gpu_bus_ids=lambda: GPU_BUS_IDS)


def test_discover_reads_nics(topo: Topology) -> None:
    assert [n.name for n in topo.nics] == ["mlx5_0", "mlx5_1", "mlx5_2"]
    nic0 = topo.nic("mlx5_0")
    assert nic0 is not None
    assert nic0.numa_node == 0 and nic0.port_state == "ACTIVE" and nic0.active
    assert nic0.link_rate_gbps == 200.0 and nic0.link_layer == "InfiniBand"
    assert nic0.pci_path == DEVICES["mlx5_0"][0]
    assert topo.nic("nope") is None


def test_discover_reads_gpus_by_bus_id(topo: Topology) -> None:
    assert [(g.index, g.pci_bus_id, g.numa_node) for g in topo.gpus] == [
        (0, "0000:19:00.0", 0), (1, "0000:1a:00.0", 0), (2, "0000:a3:00.0", 1)]
    assert topo.gpus[2].pci_path == DEVICES["gpu2"][0]


def test_gpu_same_switch_first_then_numa_then_rest(topo: Topology) -> None:
    assert preferred_nics(topo, "cuda:0") == ["mlx5_0", "mlx5_2", "mlx5_1"]
    # gpu2 shares a switch with mlx5_1; mlx5_2 is on its NUMA node but not its switch
    assert preferred_nics(topo, "cuda:2") == ["mlx5_1", "mlx5_2", "mlx5_0"]


def test_host_memory_prefers_its_numa_node_then_rate(topo: Topology) -> None:
    assert preferred_nics(topo, "cpu:0") == ["mlx5_0", "mlx5_2", "mlx5_1"]
    assert preferred_nics(topo, "cpu:1") == ["mlx5_2", "mlx5_1", "mlx5_0"]
    assert preferred_nics(topo, "cpu") == ["mlx5_2", "mlx5_0", "mlx5_1"]  # by rate


def test_unknown_gpu_and_bad_location(topo: Topology) -> None:
    assert preferred_nics(topo, "cuda:9") == ["mlx5_2", "mlx5_0", "mlx5_1"]
    with pytest.raises(ValueError, match="location"):
        preferred_nics(topo, "tpu:0")


def test_down_ports_are_left_out(tmp_path: Path) -> None:
    root = make_sysfs(tmp_path, {
        "mlx5_0": ("1: DOWN", "10 Gb/sec (4X SDR)", "InfiniBand"),
        "mlx5_1": ("4: ACTIVE", "100 Gb/sec (4X EDR)", "InfiniBand")})
    topo = discover(root, gpu_bus_ids=lambda: GPU_BUS_IDS)
    assert topo.nic("mlx5_0") is not None and not topo.nic("mlx5_0").active  # type: ignore[union-attr]
    assert preferred_nics(topo, "cuda:0") == ["mlx5_1"]
    assert preferred_nics(topo, "cuda:0", only_active=False) == ["mlx5_0", "mlx5_1"]


def test_first_active_port_is_chosen(tmp_path: Path) -> None:
    root = make_sysfs(tmp_path, {"mlx5_0": ("1: DOWN", "", "Ethernet")})
    port2 = root / "class" / "infiniband" / "mlx5_0" / "ports" / "2"
    port2.mkdir()
    (port2 / "state").write_text("4: ACTIVE\n")
    (port2 / "rate").write_text("25 Gb/sec (1X EDR)\n")
    (nic,) = discover(root, gpu_bus_ids=list).nics
    assert (nic.port, nic.port_state, nic.link_rate_gbps) == (2, "ACTIVE", 25.0)


def test_empty_or_missing_sysfs_means_no_nics(tmp_path: Path) -> None:
    assert discover(tmp_path, gpu_bus_ids=list) == Topology()
    (tmp_path / "class" / "infiniband").mkdir(parents=True)
    assert discover(tmp_path, gpu_bus_ids=list).nics == ()


def test_missing_numa_and_broken_device_link(tmp_path: Path) -> None:
    cls = tmp_path / "class" / "infiniband" / "rxe0"
    cls.mkdir(parents=True)
    os.symlink("/nonexistent/device", cls / "device")
    (nic,) = discover(tmp_path, gpu_bus_ids=list).nics
    assert (nic.name, nic.numa_node, nic.pci_path, nic.port_state) == ("rxe0", -1, "",
                                                                        "UNKNOWN")


def test_normalize_bus_id() -> None:
    assert normalize_bus_id("00000000:3B:00.0") == "0000:3b:00.0"
    assert normalize_bus_id(b"0001:3b:00.1") == "0001:3b:00.1"
    with pytest.raises(ValueError):
        normalize_bus_id("3b:00")


def test_nvml_absent_or_without_driver_means_no_gpus() -> None:
    assert nvml_gpu_bus_ids() == []  # no NVIDIA driver here (or pynvml not installed)


def test_stripe_weights_follow_link_rate(topo: Topology) -> None:
    weights = stripe_weights(topo.nics)
    assert weights == pytest.approx([200 / 700, 100 / 700, 400 / 700])
    unknown = [Nic("a", link_rate_gbps=100.0), Nic("b")]
    assert stripe_weights(unknown) == pytest.approx([0.5, 0.5])
    assert stripe_weights([Nic("a"), Nic("b"), Nic("c")]) == pytest.approx([1 / 3] * 3)
    assert stripe_weights([]) == []


# --- topology files -------------------------------------------------------------------

def test_our_format_round_trips(topo: Topology, tmp_path: Path) -> None:
    path = tmp_path / "topo.json"
    path.write_text(json.dumps(topo.to_json()))
    loaded = load_topology_file(path)
    assert loaded == topo
    assert preferred_nics(loaded, "cuda:2") == preferred_nics(topo, "cuda:2")


def test_mooncake_priority_matrix(tmp_path: Path) -> None:
    path = tmp_path / "mc.json"
    path.write_text(json.dumps({
        "cpu:0": [["mlx5_0", "mlx5_1"], ["mlx5_2", "mlx5_3"]],
        "cuda:0": [["mlx5_2"], ["mlx5_0"]],
        "cuda:1": [["mlx5_3"]]}))
    topo = load_topology_file(path)
    assert [n.name for n in topo.nics] == ["mlx5_0", "mlx5_1", "mlx5_2", "mlx5_3"]
    assert all(n.active for n in topo.nics)
    assert preferred_nics(topo, "cuda:0")[:2] == ["mlx5_2", "mlx5_0"]
    assert preferred_nics(topo, "cpu:0") == ["mlx5_0", "mlx5_1", "mlx5_2", "mlx5_3"]
    assert preferred_nics(topo, "cuda:1")[0] == "mlx5_3"
    assert sorted(preferred_nics(topo, "cuda:7")) == ["mlx5_0", "mlx5_1", "mlx5_2",
                                                      "mlx5_3"]


def test_preferences_in_our_format_override_inference(topo: Topology) -> None:
    data = topo.to_json()
    data["preferences"] = {"cuda:0": [["mlx5_1"], []]}
    forced = parse_topology(data)
    assert preferred_nics(forced, "cuda:0") == ["mlx5_1", "mlx5_0", "mlx5_2"]


@pytest.mark.parametrize("content,match", [
    ("not json", "cannot read"),
    ('{"cpu:0": "mlx5_0"}', "must be"),
    ('{"cpu:0": [["mlx5_0"], [1]]}', "NIC names"),
    ('["mlx5_0"]', "expected a map"),
    ('{"nics": [{"nom": "x"}]}', "bad nic"),
])
def test_bad_files_are_rejected(tmp_path: Path, content: str, match: str) -> None:
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(TopologyFileError, match=match):
        load_topology_file(path)
    with pytest.raises(ValueError):  # also a ValueError, for callers that expect one
        load_topology_file(path)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(TopologyFileError, match="cannot read"):
        load_topology_file(tmp_path / "absent.json")


def test_load_prefers_env_file_over_discovery(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "t.json"
    path.write_text(json.dumps(Topology((Nic("x", port_state="ACTIVE"),)).to_json()))
    monkeypatch.setenv("TE_TOPOLOGY_FILE", str(path))
    assert [n.name for n in load(sysfs_root=tmp_path).nics] == ["x"]
    monkeypatch.delenv("TE_TOPOLOGY_FILE")
    assert load(sysfs_root=tmp_path / "empty").nics == ()
    assert load(path).nics[0].name == "x"


def test_gpu_dataclass_defaults() -> None:
    assert Gpu(0, "0000:19:00.0").numa_node == -1


def test_importing_the_package_pulls_in_no_hardware_library() -> None:
    code = ("import sys, transfer_engine, transfer_engine.topology, transfer_engine.gpu, "
            "transfer_engine.transport.rdma.plan, transfer_engine.transport.rdma\n"
            "bad = [m for m in ('pyverbs', 'cupy', 'torch', 'pynvml') if m in sys.modules]\n"
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parents[1])
