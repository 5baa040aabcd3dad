"""A fleet on one machine: hosts are network namespaces, NICs are rate-limited veths.

Layout of a lab named ``TAG`` with H hosts of N NICs each::

    te-TAG-h0 .. te-TAG-h{H-1}   one namespace per host; NIC j is ``ethj`` with address
                                 198.18.j.(i+1)/24 (host i), a loopback, and no other
                                 route: nothing in a host reaches outside the lab
    te-TAG-sw                    the "switch": bridge ``brj`` joins NIC j of every host

Each NIC's egress is shaped by ``tbf`` at the asked rate, and so is the switch port
toward it (a NIC's receive side is as limited as its send side). ``delay_ms`` adds
``netem`` delay to every packet a host sends; with ``zones`` > 1, hosts are spread over
zones round-robin (labels: ``zone``, ``pod``) and packets to a host in another zone
get ``cross_zone_delay_ms`` on
top (then ``htb`` shapes in place of ``tbf``: one class at the rate over a same-zone
and a cross-zone leaf, each with its ``netem``, ``u32`` filters on destination address;
this kernel offers no ``prio``).

On a kernel without ``netem`` the same delays come from a userspace delay line in the
switch (:mod:`transfer_engine.lab.wire`): each host port is wired to its bridge through
it, and ``tbf`` alone shapes the NICs.

Every host gets a topology file (:mod:`transfer_engine.topology`'s format) that an
engine started in it reads through ``$TE_TOPOLOGY_FILE``: NIC j sits on NUMA node
``j % numa_nodes`` behind PCIe switch j, next to GPU j. Deleting a namespace deletes
its veths and qdiscs, so taking a lab down is ending the processes inside its
namespaces (the delay line among them), then deleting the namespaces and state folder.
"""

from __future__ import annotations

import ctypes
import functools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from transfer_engine.lab.netns import LabError, check_address, namespaces, run
from transfer_engine.lab.wire import WirePort, set_loss
from transfer_engine.topology import TOPOLOGY_ENV

__all__ = ["Lab", "LabConfig", "LabHost", "LabNic", "STATE_ROOT", "down"]

STATE_ROOT = Path(os.environ.get("TE_LAB_STATE", "/run/te-lab"))
MAX_HOSTS = 250
MAX_NICS = 16
_TAG = re.compile(r"^[a-z0-9]{1,8}$")
_PROC_STOP = 5.0
_WIRE_START = 10.0


@dataclass(frozen=True)
class LabConfig:
    """What a lab looks like. Rates in Mbit/s, delays in milliseconds."""

    hosts: int = 2
    nics: int = 1
    rate_mbit: float = 1000.0  # every NIC's nominal rate (the topology's link rate)
    # what NIC j is actually shaped to, where it differs (a degraded or busy link)
    nic_rates_mbit: tuple[float, ...] = ()
    delay_ms: float = 0.0
    zones: int = 1
    cross_zone_delay_ms: float = 0.0
    hosts_per_pod: int = 2
    numa_nodes: int = 2
    tag: str = "lab"
    # wire host ports through the userspace delay line even where netem could do the
    # delays (or none are asked): what Lab.set_loss needs
    delay_line: bool = False

    def __post_init__(self) -> None:
        if not 1 <= self.hosts <= MAX_HOSTS:
            raise ValueError(f"hosts must be 1..{MAX_HOSTS}, got {self.hosts}")
        if not 1 <= self.nics <= MAX_NICS:
            raise ValueError(f"nics must be 1..{MAX_NICS}, got {self.nics}")
        if not self.rate_mbit > 0 or not all(r > 0 for r in self.nic_rates_mbit):
            raise ValueError("rates must be positive")
        if len(self.nic_rates_mbit) > self.nics:
            raise ValueError(f"{len(self.nic_rates_mbit)} NIC rates for {self.nics} NICs")
        if self.delay_ms < 0 or self.cross_zone_delay_ms < 0:
            raise ValueError("delays cannot be negative")
        if not 1 <= self.zones <= self.hosts:
            raise ValueError(f"zones must be 1..hosts ({self.hosts}), got {self.zones}")
        if self.hosts_per_pod < 1 or self.numa_nodes < 1:
            raise ValueError("hosts_per_pod and numa_nodes must be at least 1")
        if not _TAG.match(self.tag):
            raise ValueError(f"tag must be 1-8 of [a-z0-9], got {self.tag!r}")


@dataclass(frozen=True)
class LabNic:
    name: str  # interface name inside the host's namespace
    address: str  # 198.18.x.y
    prefix: int = 24


@dataclass(frozen=True)
class LabHost:
    index: int
    netns: str
    zone: str
    pod: str
    nics: tuple[LabNic, ...]
    topology_file: str

    @property
    def address(self) -> str:
        """The host's first NIC address (where its control endpoint listens)."""
        return self.nics[0].address

    def to_json(self) -> dict[str, Any]:
        return {"index": self.index, "netns": self.netns, "zone": self.zone,
                "pod": self.pod, "topology_file": self.topology_file,
                "nics": [{"name": n.name, "address": n.address, "prefix": n.prefix}
                         for n in self.nics]}


def _burst_bytes(rate_mbit: float) -> int:
    # at least a GSO packet's worth (64 KiB) twice, and 4 ms of traffic at the rate
    return max(128 << 10, int(rate_mbit * 1e6 / 8 / 250))


def _shape(netns: str, dev: str, rate_mbit: float) -> None:
    run(["tc", "qdisc", "add", "dev", dev, "root", "handle", "1:", "tbf",
         "rate", f"{rate_mbit}mbit", "burst", str(_burst_bytes(rate_mbit)),
         "latency", "100ms"], netns)


def has_netem(netns: str) -> bool:
    """Whether this kernel has the ``netem`` qdisc (CONFIG_NET_SCH_NETEM); without it
    a lab's delays come from :mod:`transfer_engine.lab.wire`."""
    try:
        run(["tc", "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms"], netns)
    except LabError:
        return False
    run(["tc", "qdisc", "del", "dev", "lo", "root"], netns, check=False)
    return True


def _netem(netns: str, dev: str, parent: str, handle: str, delay_ms: float) -> None:
    # limit: packets queued in the delay line; 1 Gbit/s x 100 ms is ~8500 full frames
    run(["tc", "qdisc", "add", "dev", dev, "parent", parent, "handle", handle, "netem",
         "delay", f"{delay_ms}ms", "limit", "100000"], netns)


class Lab:
    """A lab's namespaces, links and processes; ``close()`` removes all of them.

    :param config: the lab's shape (see :class:`LabConfig`).
    :param state_root: folder for topology files and the state ``down`` reads.

    Raises :class:`LabError` if a step fails, after removing what it had made. A lab of
    the same tag left by a crashed run is removed first.
    """

    def __init__(self, config: LabConfig, state_root: Path | None = None) -> None:
        self.config = config
        self.state_dir = (state_root or STATE_ROOT) / config.tag
        self.hosts: list[LabHost] = []
        self.wired = False  # delays from the userspace delay line, not netem
        self._wire: subprocess.Popen[bytes] | None = None
        self._procs: list[subprocess.Popen[Any]] = []
        self._closed = False
        down(config.tag, self.state_dir.parent)
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    # --- naming -------------------------------------------------------------------

    @property
    def switch(self) -> str:
        return f"te-{self.config.tag}-sw"

    def _host_ns(self, i: int) -> str:
        return f"te-{self.config.tag}-h{i}"

    def zone_of(self, i: int) -> str:
        return f"z{i % self.config.zones}"

    def pod_of(self, i: int) -> str:
        return f"{self.zone_of(i)}-p{(i // self.config.zones) // self.config.hosts_per_pod}"

    @staticmethod
    def address_of(host: int, nic: int) -> str:
        return str(check_address(f"198.18.{nic}.{host + 1}"))

    def rate_of(self, nic: int) -> float:
        """What NIC ``nic`` is shaped to, in Mbit/s."""
        rates = self.config.nic_rates_mbit
        return rates[nic] if nic < len(rates) else self.config.rate_mbit

    # --- building -----------------------------------------------------------------

    def _build(self) -> None:
        cfg = self.config
        self.state_dir.mkdir(parents=True, exist_ok=True)
        run(["ip", "netns", "add", self.switch])
        run(["ip", "link", "set", "lo", "up"], self.switch)
        self.wired = cfg.delay_line
        if not self.wired and (cfg.delay_ms > 0 or (cfg.zones > 1
                                                    and cfg.cross_zone_delay_ms > 0)):
            self.wired = not has_netem(self.switch)
        for j in range(cfg.nics):
            run(["ip", "link", "add", f"br{j}", "type", "bridge"], self.switch)
            run(["ip", "link", "set", f"br{j}", "up"], self.switch)
        for i in range(cfg.hosts):
            self.hosts.append(self._add_host(i))
        for host in self.hosts:
            for j in range(cfg.nics):
                self._shape_host_nic(host, j)
        self._save()
        if self.wired:
            self._start_wire()

    def _add_host(self, i: int) -> LabHost:
        cfg = self.config
        ns = self._host_ns(i)
        run(["ip", "netns", "add", ns])
        run(["ip", "link", "set", "lo", "up"], ns)
        nics = []
        for j in range(cfg.nics):
            port = f"h{i}n{j}"
            # both ends are born in their namespaces: the root namespace gains nothing
            run(["ip", "link", "add", f"eth{j}", "netns", ns, "type", "veth",
                 "peer", "name", port, "netns", self.switch])
            addr = self.address_of(i, j)
            run(["ip", "addr", "add", f"{addr}/24", "dev", f"eth{j}"], ns)
            run(["ip", "link", "set", f"eth{j}", "up"], ns)
            if self.wired:  # port <-> delay line <-> y <-> x -- bridge
                run(["ip", "link", "add", f"x{i}n{j}", "type", "veth", "peer", "name",
                     f"y{i}n{j}"], self.switch)
                run(["ip", "link", "set", f"x{i}n{j}", "master", f"br{j}"], self.switch)
                for end in (f"x{i}n{j}", f"y{i}n{j}"):
                    run(["ip", "link", "set", end, "up"], self.switch)
            else:
                run(["ip", "link", "set", port, "master", f"br{j}"], self.switch)
            _shape(self.switch, port, self.rate_of(j))
            run(["ip", "link", "set", port, "up"], self.switch)
            nics.append(LabNic(f"eth{j}", addr))
        topo = self.state_dir / f"{ns}.topology.json"
        topo.write_text(json.dumps(self.topology(i), indent=1))
        return LabHost(i, ns, self.zone_of(i), self.pod_of(i), tuple(nics), str(topo))

    def _shape_host_nic(self, host: LabHost, j: int) -> None:
        cfg = self.config
        dev = f"eth{j}"
        others = [h for h in self.hosts if h.zone != host.zone]
        if self.wired:
            _shape(host.netns, dev, self.rate_of(j))  # the delay line adds the delays
            return
        if cfg.zones > 1 and others and cfg.cross_zone_delay_ms > 0:
            # htb: one class at the NIC's rate shared by a same-zone leaf (the default)
            # and a cross-zone leaf chosen by destination; each leaf has its delay line
            rate, burst = f"{self.rate_of(j)}mbit", str(_burst_bytes(self.rate_of(j)))
            run(["tc", "qdisc", "add", "dev", dev, "root", "handle", "1:", "htb",
                 "default", "10"], host.netns)
            run(["tc", "class", "add", "dev", dev, "parent", "1:", "classid", "1:1", "htb",
                 "rate", rate, "burst", burst], host.netns)
            for leaf, delay in (("10", cfg.delay_ms),
                                ("20", cfg.delay_ms + cfg.cross_zone_delay_ms)):
                run(["tc", "class", "add", "dev", dev, "parent", "1:1", "classid",
                     f"1:{leaf}", "htb", "rate", f"{self.rate_of(j) / 2}mbit", "ceil", rate,
                     "burst", burst, "quantum", "65536"], host.netns)
                if delay > 0:
                    _netem(host.netns, dev, f"1:{leaf}", f"{leaf}:", delay)
            for other in others:
                run(["tc", "filter", "add", "dev", dev, "parent", "1:", "protocol", "ip",
                     "prio", "1", "u32", "match", "ip", "dst",
                     f"{other.nics[j].address}/32", "flowid", "1:20"], host.netns)
            return
        _shape(host.netns, dev, self.rate_of(j))
        if cfg.delay_ms > 0:
            _netem(host.netns, dev, "1:1", "10:", cfg.delay_ms)

    def wire_ports(self) -> list[WirePort]:
        """What the delay line does at each host port: the delays netem would add on
        the host's egress (``delay_ms``, plus ``cross_zone_delay_ms`` to other zones)."""
        cfg = self.config
        cross = (cfg.delay_ms + cfg.cross_zone_delay_ms) / 1e3
        return [WirePort(f"h{h.index}n{j}", f"y{h.index}n{j}", cfg.delay_ms / 1e3,
                         {o.nics[j].address: cross for o in self.hosts
                          if cfg.zones > 1 and o.zone != h.zone})
                for h in self.hosts for j in range(cfg.nics)]

    @property
    def _wire_control(self) -> Path:
        return self.state_dir / "wire.ctl"

    def set_loss(self, host: int, nic: int, loss: float) -> None:
        """Drops ``loss`` (0..1) of the frames ``host``'s NIC ``nic`` carries, both ways,
        with its link up (1.0: a black hole the link state does not show). Needs the
        delay line (``LabConfig(delay_line=True)``, or a delay on a kernel without
        netem)."""
        if not self.wired:
            raise LabError("set_loss needs the lab's delay line: build the lab with "
                           "LabConfig(delay_line=True)")
        if not 0.0 <= loss <= 1.0:
            raise ValueError(f"loss must be in 0..1, got {loss}")
        if self._wire is not None and self._wire.poll() is not None:
            raise LabError(f"the lab's delay line exited ({self._wire.returncode}): "
                           f"{(self.state_dir / 'wire.log').read_text(errors='replace')[-400:]}")
        try:
            set_loss(str(self._wire_control), f"h{host}n{nic}", loss)
        except (OSError, ValueError) as exc:
            raise LabError(f"the delay line did not take loss {loss} on host {host} "
                           f"NIC {nic}: {exc}") from exc

    def _start_wire(self) -> None:
        conf, log = self.state_dir / "wire.json", self.state_dir / "wire.log"
        conf.write_text(json.dumps({"ports": [p.to_json() for p in self.wire_ports()],
                                    "control": str(self._wire_control)}))
        with open(log, "wb") as out:  # its own session: it outlives an `up` command
            proc = subprocess.Popen(["ip", "netns", "exec", self.switch, sys.executable,
                                     "-m", "transfer_engine.lab.wire", str(conf)],
                                    env=self.env(self.hosts[0]), stdin=subprocess.DEVNULL,
                                    stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        self._procs.append(proc)
        self._wire = proc
        deadline = time.monotonic() + _WIRE_START
        while b"ready" not in log.read_bytes():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise LabError(f"the lab's delay line did not start: "
                               f"{log.read_text(errors='replace')[-600:]}")
            time.sleep(0.02)

    def topology(self, i: int) -> dict[str, Any]:
        """Host ``i``'s topology file: NIC j and GPU j share PCIe switch j."""
        cfg = self.config
        nics, gpus = [], []
        for j in range(cfg.nics):
            numa = j % cfg.numa_nodes
            root = f"pci0000:{numa * 0x80:02x}"
            bus = numa * 0x80 + 0x10 + j * 4
            switch = f"{root}/0000:{numa * 0x80:02x}:{j + 1:02x}.0/0000:{bus:02x}:00.0"
            nics.append({"name": f"eth{j}", "numa_node": numa,
                         "pci_path": f"{switch}/0000:{bus + 1:02x}:00.0/"
                                     f"0000:{bus + 2:02x}:00.0",
                         "port_state": "ACTIVE", "link_rate_gbps": cfg.rate_mbit / 1000,
                         "link_layer": "Ethernet", "address": self.address_of(i, j)})
            gpus.append({"index": j, "pci_bus_id": f"0000:{bus + 3:02x}:00.0",
                         "numa_node": numa,
                         "pci_path": f"{switch}/0000:{bus + 1:02x}:01.0/"
                                     f"0000:{bus + 3:02x}:00.0"})
        return {"nics": nics, "gpus": gpus}

    def _save(self) -> None:
        state = {"config": {**self.config.__dict__,
                            "nic_rates_mbit": list(self.config.nic_rates_mbit)},
                 "switch": self.switch,
                 "hosts": [h.to_json() for h in self.hosts]}
        (self.state_dir / "lab.json").write_text(json.dumps(state, indent=1))

    # --- using --------------------------------------------------------------------

    def set_link(self, host: int, nic: int, up: bool) -> None:
        """Pulls (or plugs back) the cable of ``host``'s NIC ``nic``: its switch port
        goes down, so the host's interface loses carrier with its address kept."""
        run(["ip", "link", "set", f"h{host}n{nic}", "up" if up else "down"], self.switch)

    def env(self, host: LabHost, base: Mapping[str, str] | None = None) -> dict[str, str]:
        """Environment for a process on ``host``: its topology file, this package."""
        env = dict(os.environ if base is None else base)
        env[TOPOLOGY_ENV] = host.topology_file
        root = str(Path(__file__).resolve().parents[2])
        path = env.get("PYTHONPATH")
        env["PYTHONPATH"] = root + (os.pathsep + path if path else "")
        return env

    def spawn(self, host: LabHost, argv: Sequence[str], env: Mapping[str, str] | None = None,
              **popen: Any) -> subprocess.Popen[Any]:
        """Starts ``argv`` inside ``host``, with the host's name as its hostname (its own
        UTS namespace: engines on different lab hosts must not take each other for the
        same host, or they would pick the same-host transport and path); the lab stops
        it on ``close()``."""
        if self._closed:
            raise LabError("the lab is closed")
        proc = subprocess.Popen(["ip", "netns", "exec", host.netns, *argv],
                                env=self.env(host, env),
                                preexec_fn=functools.partial(_own_hostname, host.netns),
                                **popen)
        self._procs.append(proc)
        return proc

    def close(self) -> None:
        """Stops the lab's processes, then deletes its namespaces and files. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for proc in self._procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + _PROC_STOP
        for proc in self._procs:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(_PROC_STOP)
            for stream in (proc.stdin, proc.stdout, proc.stderr):
                if stream is not None:
                    stream.close()
        self._procs.clear()
        down(self.config.tag, self.state_dir.parent)

    def __enter__(self) -> Lab:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        c = self.config
        return (f"<Lab {c.tag!r} hosts={len(self.hosts)} nics={c.nics} "
                f"rate={c.rate_mbit}mbit delay={c.delay_ms}ms zones={c.zones}"
                f"{' CLOSED' if self._closed else ''}>")


_CLONE_NEWUTS = 0x04000000
_LIBC = ctypes.CDLL(None, use_errno=True)


def _own_hostname(name: str) -> None:
    """In a child before exec: a UTS namespace of its own, named ``name``."""
    raw = name.encode()
    if _LIBC.unshare(_CLONE_NEWUTS) != 0 or _LIBC.sethostname(raw, len(raw)) != 0:
        raise OSError(ctypes.get_errno(), f"cannot give the process hostname {name!r}")


def _alive(pid: int) -> bool:
    """Whether ``pid`` still runs (a zombie has ended)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _end_pids(pids: list[int]) -> None:
    """SIGTERM, then SIGKILL for those still there after a few seconds."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + _PROC_STOP
        while pids and time.monotonic() < deadline:
            pids = [p for p in pids if _alive(p)]
            time.sleep(0.05)
        if not pids:
            return


def down(tag: str, state_root: Path | None = None) -> list[str]:
    """Deletes lab ``tag``'s namespaces (with their links and qdiscs) and state folder;
    returns the namespaces deleted. Touches only names that begin ``te-TAG-``."""
    if not _TAG.match(tag):
        raise ValueError(f"tag must be 1-8 of [a-z0-9], got {tag!r}")
    prefix = f"te-{tag}-"
    gone = [ns for ns in namespaces() if ns.startswith(prefix)]
    # a process still inside would keep its namespace (and links) alive, nameless
    _end_pids([int(p) for ns in gone
               for p in run(["ip", "netns", "pids", ns], check=False).split()])
    for ns in gone:
        run(["ip", "netns", "delete", ns], check=False)
    shutil.rmtree((state_root or STATE_ROOT) / tag, ignore_errors=True)
    return gone
