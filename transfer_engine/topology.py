"""Where NICs and GPUs sit, and which NICs a piece of memory should use.

A segment's bytes cross the PCIe fabric on their way to the wire; a NIC behind the same
PCIe switch as the GPU (or on the same NUMA node as host memory) avoids the inter-socket
link, which is often the bottleneck. So rails prefer, in order: NICs that share a PCIe
bridge below the host bridge with the memory's device, then NICs on the same NUMA node,
then any NIC; ties go to the faster link.

Discovery reads sysfs (``/sys/class/infiniband/*``) and asks nvidia-ml-py for GPUs
(imported lazily; without it there are simply no GPUs). Every function takes the sysfs
root as an argument, so the tests build fake trees in a temporary folder. A JSON file
overrides discovery; both our own format and Mooncake's NIC priority matrix are read:

    ours:      {"nics": [{"name": "mlx5_0", "numa_node": 0, "pci_path": "...",
                          "port_state": "ACTIVE", "link_rate_gbps": 200.0}, ...],
                "gpus": [{"index": 0, "pci_bus_id": "0000:3b:00.0", "numa_node": 0}],
                "preferences": {"cuda:0": [["mlx5_0"], ["mlx5_1"]]}}     (optional)
    Mooncake:  {"cpu:0": [["mlx5_0"], ["mlx5_1"]], "cuda:0": [["mlx5_0"], []]}
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from transfer_engine.errors import TransferEngineError

__all__ = ["Nic", "Gpu", "Topology", "TopologyFileError", "discover", "load",
           "load_topology_file", "nearest_nics", "parse_topology", "preferred_nics",
           "stripe_weights",
           "normalize_bus_id", "nvml_gpu_bus_ids", "TOPOLOGY_ENV"]

TOPOLOGY_ENV = "TE_TOPOLOGY_FILE"


class TopologyFileError(TransferEngineError, ValueError):
    """A topology file is unreadable or in neither accepted format. Nothing is loaded."""


@dataclass(frozen=True, slots=True)
class Nic:
    """One RDMA device (its first active port, else port 1)."""

    name: str
    numa_node: int = -1  # -1: unknown (single-socket machines report -1 too)
    pci_path: str = ""  # "pci0000:17/0000:17:00.0/0000:18:00.0/...", "" when unknown
    port_state: str = "UNKNOWN"  # "ACTIVE", "DOWN", ...
    link_rate_gbps: float = 0.0  # 0: unknown
    port: int = 1
    link_layer: str = ""  # "InfiniBand" or "Ethernet"
    address: str = ""  # IP address of a netdev NIC (TCP rails bind to it), "" if none

    @property
    def active(self) -> bool:
        return self.port_state == "ACTIVE"


@dataclass(frozen=True, slots=True)
class Gpu:
    index: int
    pci_bus_id: str  # "0000:3b:00.0"
    numa_node: int = -1
    pci_path: str = ""


@dataclass(frozen=True, slots=True)
class Topology:
    nics: tuple[Nic, ...] = ()
    gpus: tuple[Gpu, ...] = ()
    # location -> (preferred NIC names, other NIC names), from a file; wins over inference
    preferences: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = field(
        default_factory=dict, compare=False)

    def nic(self, name: str) -> Nic | None:
        return next((n for n in self.nics if n.name == name), None)

    def active_nics(self) -> list[Nic]:
        return [n for n in self.nics if n.active]

    def to_json(self) -> dict[str, Any]:
        """Our file format; ``parse_topology(t.to_json()) == t``."""
        return {"nics": [asdict(n) for n in self.nics],
                "gpus": [asdict(g) for g in self.gpus],
                "preferences": {k: [list(a), list(b)] for k, (a, b) in
                                self.preferences.items()}}


# --- discovery ------------------------------------------------------------------------

def _read(path: Path, default: str = "") -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return default


def _int(text: str, default: int = -1) -> int:
    try:
        return int(text)
    except ValueError:
        return default


def _pci_path(device_dir: Path, sysfs_root: Path) -> str:
    """The device's resolved path under ``<root>/devices`` (the chain of PCI bridges)."""
    try:
        real = device_dir.resolve(strict=True)
        return str(real.relative_to((sysfs_root / "devices").resolve()))
    except (OSError, ValueError):
        return ""


_RATE = re.compile(r"([\d.]+)\s*Gb/sec")


def _port(dev_dir: Path) -> tuple[int, str, float, str]:
    """(port, state, rate in Gb/s, link layer) of the first active port, else port 1."""
    ports = sorted((p for p in (dev_dir / "ports").glob("*") if p.name.isdigit()),
                   key=lambda p: int(p.name))
    chosen: tuple[int, str, float, str] | None = None
    for p in ports:
        state = _read(p / "state")  # "4: ACTIVE"
        state = state.split(":", 1)[-1].strip() if state else "UNKNOWN"
        rate_m = _RATE.search(_read(p / "rate"))
        entry = (int(p.name), state, float(rate_m.group(1)) if rate_m else 0.0,
                 _read(p / "link_layer"))
        if chosen is None or (state == "ACTIVE" and chosen[1] != "ACTIVE"):
            chosen = entry
    return chosen or (1, "UNKNOWN", 0.0, "")


def discover_nics(sysfs_root: str | os.PathLike[str] = "/sys") -> list[Nic]:
    root = Path(sysfs_root)
    ib = root / "class" / "infiniband"
    nics = []
    for dev_dir in sorted(ib.glob("*")) if ib.is_dir() else []:
        port, state, rate, layer = _port(dev_dir)
        nics.append(Nic(name=dev_dir.name,
                        numa_node=_int(_read(dev_dir / "device" / "numa_node", "-1")),
                        pci_path=_pci_path(dev_dir / "device", root),
                        port_state=state, link_rate_gbps=rate, port=port,
                        link_layer=layer))
    return nics


def normalize_bus_id(bus_id: str | bytes) -> str:
    """NVML's ``00000000:3B:00.0`` -> sysfs' ``0000:3b:00.0``."""
    text = bus_id.decode() if isinstance(bus_id, bytes) else bus_id
    parts = text.strip().lower().split(":")
    if len(parts) != 3:
        raise ValueError(f"not a PCI bus id: {bus_id!r}")
    return f"{int(parts[0], 16):04x}:{parts[1]}:{parts[2]}"


def nvml_gpu_bus_ids() -> list[str]:
    """PCI bus ids of the GPUs NVML sees, by index; [] without nvidia-ml-py or a driver."""
    try:
        import pynvml  # lazy: an optional dependency (extra [gpu])
    except ImportError:
        return []
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return []
    try:
        ids = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            ids.append(normalize_bus_id(pynvml.nvmlDeviceGetPciInfo(handle).busId))
        return ids
    except pynvml.NVMLError:
        return []
    finally:
        try:
            pynvml.nvmlShutdown()
        except pynvml.NVMLError:
            pass


def discover_gpus(sysfs_root: str | os.PathLike[str] = "/sys",
                  gpu_bus_ids: Callable[[], Sequence[str]] = nvml_gpu_bus_ids) -> list[Gpu]:
    """GPUs by index; NUMA node and PCI path come from sysfs by bus id."""
    root = Path(sysfs_root)
    gpus = []
    for index, raw in enumerate(gpu_bus_ids()):
        bus = normalize_bus_id(raw)
        dev = root / "bus" / "pci" / "devices" / bus
        gpus.append(Gpu(index, bus, _int(_read(dev / "numa_node", "-1")),
                        _pci_path(dev, root)))
    return gpus


def discover(sysfs_root: str | os.PathLike[str] = "/sys",
             gpu_bus_ids: Callable[[], Sequence[str]] = nvml_gpu_bus_ids) -> Topology:
    """NICs from sysfs and GPUs from NVML. Never raises for missing hardware."""
    return Topology(tuple(discover_nics(sysfs_root)),
                    tuple(discover_gpus(sysfs_root, gpu_bus_ids)))


def load(path: str | os.PathLike[str] | None = None,
         sysfs_root: str | os.PathLike[str] = "/sys") -> Topology:
    """The topology file at ``path`` (or ``$TE_TOPOLOGY_FILE``) if given, else discovery."""
    path = path or os.environ.get(TOPOLOGY_ENV) or None
    return load_topology_file(path) if path else discover(sysfs_root)


# --- topology files -------------------------------------------------------------------

def load_topology_file(path: str | os.PathLike[str]) -> Topology:
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise TopologyFileError(f"cannot read topology file {path}: {exc}") from exc
    return parse_topology(data, source=str(path))


def _names(value: Any, where: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise TopologyFileError(f"{where}: expected a list of NIC names, got {value!r}")
    return tuple(value)


def _preferences(data: Any, where: str) -> dict[str, tuple[tuple[str, ...], tuple[str, ...]]]:
    if not isinstance(data, dict):
        raise TopologyFileError(f"{where}: expected a map of location -> "
                                "[[preferred], [others]]")
    out = {}
    for loc, value in data.items():
        if not isinstance(value, list) or len(value) not in (1, 2):
            raise TopologyFileError(f"{where}: {loc!r} must be [[preferred NICs], "
                                    f"[other NICs]], got {value!r}")
        preferred = _names(value[0], f"{where}: {loc}")
        others = _names(value[1], f"{where}: {loc}") if len(value) == 2 else ()
        out[str(loc)] = (preferred, others)
    return out


def parse_topology(data: Any, source: str = "topology") -> Topology:
    """Reads our format (has a ``"nics"`` list) or Mooncake's priority matrix."""
    if isinstance(data, dict) and "nics" in data:
        try:
            nics = tuple(Nic(**{**n, "link_rate_gbps": float(n.get("link_rate_gbps", 0))})
                         for n in data["nics"])
            gpus = tuple(Gpu(**g) for g in data.get("gpus", []))
        except (TypeError, AttributeError, ValueError) as exc:
            raise TopologyFileError(f"{source}: bad nic/gpu entry: {exc}") from exc
        prefs = _preferences(data.get("preferences", {}), source)
        return Topology(nics, gpus, prefs)
    prefs = _preferences(data, source)
    names: dict[str, None] = {}
    for preferred, others in prefs.values():
        names.update(dict.fromkeys(preferred + others))
    # Mooncake lists only names; a listed NIC is one the operator wants used.
    return Topology(tuple(Nic(name, port_state="ACTIVE") for name in names), (), prefs)


# --- choice ---------------------------------------------------------------------------

def _common_depth(a: str, b: str) -> int:
    """PCI bridges two devices share (path components in common, minus the devices)."""
    if not a or not b:
        return 0
    pa, pb = a.split("/")[:-1], b.split("/")[:-1]
    depth = 0
    for x, y in zip(pa, pb, strict=False):
        if x != y:
            break
        depth += 1
    return depth


def _location(topology: Topology, location: str) -> tuple[int, str]:
    """(NUMA node, PCI path) of ``cpu``, ``cpu:N`` (NUMA node N) or ``cuda:N``."""
    kind, _, idx = location.partition(":")
    if kind == "cpu":
        return (int(idx) if idx else -1), ""
    if kind == "cuda":
        gpu = next((g for g in topology.gpus if g.index == int(idx or 0)), None)
        return (gpu.numa_node, gpu.pci_path) if gpu else (-1, "")
    raise ValueError(f"location must be 'cpu', 'cpu:N' or 'cuda:N', got {location!r}")


def _ranker(topology: Topology, location: str) -> Callable[[Nic], tuple[int, int, float, str]]:
    """Orders NICs for memory at ``location``: tier (0 same PCIe switch or root port as
    the GPU, 1 same NUMA node, 2 the rest), then more shared bridges, faster links,
    name."""
    numa, path = _location(topology, location)

    def rank(nic: Nic) -> tuple[int, int, float, str]:
        depth = _common_depth(path, nic.pci_path)
        if depth >= 2:  # below the host bridge: a root port or a switch in common
            tier = 0
        elif numa >= 0 and nic.numa_node == numa:
            tier = 1
        else:
            tier = 2
        return tier, -depth, -nic.link_rate_gbps, nic.name
    return rank


def preferred_nics(topology: Topology, location: str, *,
                   only_active: bool = True) -> list[str]:
    """NIC names for memory at ``location``, best first.

    Tiers: same PCIe switch or root port as the GPU (they share a bridge below the host
    bridge), then same NUMA node, then the rest; within a tier, more shared bridges,
    then faster links, then name. A file's preference list for the location wins;
    NICs it does not name follow in inferred order.
    """
    nics = topology.active_nics() if only_active else list(topology.nics)
    inferred = [n.name for n in sorted(nics, key=_ranker(topology, location))]
    if location not in topology.preferences:
        return inferred
    preferred, others = topology.preferences[location]
    allowed = set(inferred)
    head = [n for n in preferred + others if n in allowed]
    return list(dict.fromkeys(head + inferred))


def nearest_nics(topology: Topology, location: str, names: Sequence[str]) -> list[str]:
    """Those of ``names`` that memory at ``location`` should use: a file's preferred
    list for the location where it names any of them, else the best tier the topology
    knows of them (same PCIe switch, else same NUMA node); all of ``names`` when the
    topology places none of them nearer than the others. Order: ``names``'."""
    wanted = list(dict.fromkeys(names))
    if location in topology.preferences:
        chosen = set(topology.preferences[location][0]) & set(wanted)
        if chosen:
            return [n for n in wanted if n in chosen]
    rank = _ranker(topology, location)
    tiers = {nic.name: rank(nic)[0] for nic in topology.nics if nic.name in wanted}
    best = min(tiers.values(), default=2)
    if best == 2:
        return wanted
    return [n for n in wanted if tiers.get(n) == best]


def stripe_weights(nics: Sequence[Nic]) -> list[float]:
    """Share of bytes per NIC, proportional to link rate (sums to 1).

    A NIC of unknown rate counts as the mean of the known ones (as 1 if none is known),
    so weights are always positive, as the planner requires. Pass active NICs only.
    """
    if not nics:
        return []
    known = [n.link_rate_gbps for n in nics if n.link_rate_gbps > 0]
    fill = sum(known) / len(known) if known else 1.0
    rates = [n.link_rate_gbps if n.link_rate_gbps > 0 else fill for n in nics]
    total = sum(rates)
    return [r / total for r in rates]
