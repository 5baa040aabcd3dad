"""The RDMA transport on the emulated provider: what only RDMA has, end to end.

Engines here use ``RdmaTransport(provider="emulated")``: real queue pairs, keys and
completions of the emulated verbs provider, bytes moving by cross-memory attach, so
the transport's failure paths (a QP error mid-transfer, a lost NIC, a full completion
queue) run without a NIC.
"""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Callable
from typing import Any, cast

import numpy as np
import pytest

from tests.helpers.faults import issue_ticket
from tests.helpers.transport_contract import MiB, random_bytes
from transfer_engine import Blocks, Descriptor, Engine, TransferState
from transfer_engine.control.tickets import Credential
from transfer_engine.errors import ConnectError, InvalidDescriptorError
from transfer_engine.transport.rdma import RdmaRail, RdmaTransport


def _rdma(**kwargs: Any) -> RdmaTransport:
    return RdmaTransport(provider="emulated", **kwargs)


def _pair(make_engine: Callable[..., Engine], size: int = 16 * MiB, *,
          a_transports: list[Any] | None = None, b_transports: list[Any] | None = None,
          ) -> tuple[Engine, Engine, Any, Any, Any, np.ndarray, np.ndarray]:
    a = make_engine("a", transports=a_transports or [_rdma()])
    b = make_engine("b", transports=b_transports or [_rdma()])
    src, dst = random_bytes(size, 1), random_bytes(size, 2)
    seg = a.register(src, name="src")
    b.register(dst, name="dst")
    peer = a.connect(b.endpoint)
    return a, b, peer, seg, peer.segment("dst"), src, dst


def _notes(engine: Engine, n: int) -> list[Any]:
    out: list[Any] = []
    for _ in range(50):
        out += engine.notifications(timeout=0.1)
        if len(out) >= n:
            break
    return out


def test_many_blocks_many_work_requests_one_notification(
        make_engine: Callable[..., Engine]) -> None:
    """4096 scattered 4 KiB blocks: multi-SGE requests on every rail, immediates
    counted across all of them, one notification after the last byte."""
    a, b, peer, seg, remote, src, dst = _pair(make_engine)
    rng = np.random.default_rng(5)
    loffs = rng.permutation(4096) * 4096
    roffs = rng.permutation(4096) * 4096
    h = a.write(peer, Blocks(seg, remote, loffs, roffs, 4096), notify=b"blocks")
    h.wait(30)
    assert h.transport == "rdma"
    assert np.array_equal(dst.reshape(-1, 4096)[roffs // 4096],
                          src.reshape(-1, 4096)[loffs // 4096])
    assert [n.payload for n in _notes(b, 1)] == [b"blocks"]
    rails = peer.rails["rdma"]
    assert sum(isinstance(r, RdmaRail) and r.inflight == 0 for r in rails) == len(rails)
    # the same blocks read back, with a notification to the target
    back = np.zeros_like(src)
    back_seg = a.register(back, name="back")
    a.read(peer, Blocks(back_seg, remote, loffs, roffs, 4096), notify=b"read").wait(30)
    assert np.array_equal(back.reshape(-1, 4096)[loffs // 4096],
                          dst.reshape(-1, 4096)[roffs // 4096])
    assert [n.payload for n in _notes(b, 1)] == [b"read"]


def test_lost_nic_moves_work_to_the_other_nic(make_engine: Callable[..., Engine]) -> None:
    a, b, peer, seg, remote, src, dst = _pair(make_engine, 32 * MiB)
    transport = cast(RdmaTransport, a.transports["rdma"])
    handles = [a.write(peer, [(Descriptor(seg, k * 4 * MiB, 4 * MiB),
                               Descriptor(remote, k * 4 * MiB, 4 * MiB))], notify=b"%d" % k)
               for k in range(8)]
    transport.emulated_nics()[0].fail()  # emu0 gone mid-transfer
    for h in handles:
        h.wait(30)
        assert h.state is TransferState.DONE and h.transport == "rdma"
    assert np.array_equal(src, dst)
    assert sorted(n.payload for n in _notes(b, 8)) == [b"%d" % k for k in range(8)]
    after = a.write(peer, [(Descriptor(seg, 0, MiB), Descriptor(remote, MiB, MiB))])
    after.wait(10)  # later transfers keep to the NIC that is left
    assert after.transport == "rdma" and np.array_equal(dst[MiB:2 * MiB], src[:MiB])
    assert all(r.closed for r in peer.rails["rdma"] if r.device.name == "emu0")


def test_qp_error_mid_transfer_falls_back_to_tcp(make_engine: Callable[..., Engine]) -> None:
    a, b, peer, seg, remote, src, dst = _pair(
        make_engine, a_transports=[_rdma(), "tcp"], b_transports=[_rdma(), "tcp"])
    assert peer.transport == "rdma"
    for nic in cast(RdmaTransport, b.transports["rdma"]).emulated_nics():
        nic.fail()  # every NIC of the target lost
    h = a.write(peer, [(Descriptor(seg, 0, 16 * MiB), Descriptor(remote, 0, 16 * MiB))],
                notify=b"fell back")
    h.wait(30)
    assert h.transport == "tcp" and np.array_equal(src, dst)
    assert [n.payload for n in _notes(b, 1)] == [b"fell back"]
    assert a.stats["fallback_rdma"] >= 1


def test_a_rail_that_would_overrun_the_completion_queue_is_refused(
        make_engine: Callable[..., Engine]) -> None:
    """One NIC whose CQ holds two rails' queues: asking for a third is refused before
    its QP exists, instead of overrunning the queue under load later."""
    small = _rdma(devices="emu0", sq_depth=64, cq_depth=160, rails_per_nic=2)
    a = make_engine("a", transports=[small])
    b = make_engine("b", transports=[_rdma(devices="emu0")])
    src, dst = random_bytes(8 * MiB, 1), random_bytes(8 * MiB, 2)
    seg = a.register(src)
    b.register(dst, name="dst")
    peer = a.connect(b.endpoint)
    info = b.metadata()["transports"]["rdma"]
    credential = Credential.from_welcome(issue_ticket(b, "a"), None, "b", "a")
    with pytest.raises(ConnectError, match="completion queue of emu0 is full"):
        small.connect("b", info, lambda c: None, 5, credential)  # a third rail
    remote = peer.segment("dst")
    # two rails of 64 entries keep the CQ busy: every work still completes
    offs = np.arange(0, 8 * MiB, 4096)
    handles = [a.write(peer, Blocks(seg, remote, offs[i::8], offs[i::8], 4096),
                       notify=b"%d" % i) for i in range(8)]
    for h in handles:
        h.wait(30)
    assert np.array_equal(src, dst)
    assert len(_notes(b, 8)) == 8


def test_remote_access_error_fails_that_transfer_only(
        make_engine: Callable[..., Engine]) -> None:
    """A segment the target deregistered: the responder refuses its key
    (REM_ACCESS_ERR), that transfer fails precisely, the next one goes on."""
    a, b, peer, seg, remote, src, dst = _pair(make_engine)
    gone = b.register(np.zeros(MiB, dtype=np.uint8), name="gone")
    target = peer.segment("gone")
    a.write(peer, [(Descriptor(seg, 0, 4096), Descriptor(target, 0, 4096))]).wait(10)
    gone.close()
    with pytest.raises(InvalidDescriptorError, match="REM_ACCESS_ERR") as info:
        a.write(peer, [(Descriptor(seg, 0, 4096), Descriptor(target, 0, 4096))]).wait(10)
    assert info.value.peer == "b" and info.value.transport == "rdma"
    h = a.write(peer, [(Descriptor(seg, 0, MiB), Descriptor(remote, 0, MiB))])
    h.wait(10)
    assert h.transport == "rdma" and np.array_equal(src[:MiB], dst[:MiB])


def test_rails_a_refused_key_left_in_error_are_opened_again(
        make_engine: Callable[..., Engine]) -> None:
    """Each refused key leaves the queue pair it used in error, as on hardware: more
    refusals than the peer has rails must not cost the peer its RDMA path. Failed rails
    open again on their NIC pairs in the background, and later transfers are exact."""
    a, b, peer, seg, remote, src, dst = _pair(make_engine)
    gone = b.register(np.zeros(MiB, dtype=np.uint8), name="gone")
    target = peer.segment("gone")
    a.write(peer, [(Descriptor(seg, 0, 4096), Descriptor(target, 0, 4096))]).wait(10)
    gone.close()
    rails = list(peer.rails["rdma"])
    for _ in range(len(rails) + 2):  # rails that knew its key refuse, later ones know
        with pytest.raises(InvalidDescriptorError, match="REM_ACCESS_ERR|not registered"):
            a.write(peer, [(Descriptor(seg, 0, 4096), Descriptor(target, 0, 4096))]
                    ).wait(10)
        time.sleep(0.3)  # a reopen's turn
    deadline = time.monotonic() + 20
    moved = 0
    while time.monotonic() < deadline and moved < 8:
        off = moved * MiB
        h = a.write(peer, [(Descriptor(seg, off, MiB), Descriptor(remote, off, MiB))])
        h.wait(10)
        assert h.transport == "rdma"
        moved += 1
    assert np.array_equal(src[:8 * MiB], dst[:8 * MiB])
    live = [r for r in peer.rails["rdma"] if not r.closed]
    assert len(live) == len(rails)
    assert cast(Any, a.transports["rdma"])._reopener.reopened >= 2
    assert {(r.device.name, r.remote_device) for r in live} == {
        (r.device.name, r.remote_device) for r in rails}


def test_two_processes(make_engine: Callable[..., Engine], monkeypatch: pytest.MonkeyPatch,
                       spawn_peer: Callable[..., tuple[subprocess.Popen[str], str]]  # noqa: F811
                       ) -> None:
    monkeypatch.setenv("TE_RDMA_PROVIDER", "emulated")
    size = 16 * MiB
    _, endpoint = spawn_peer("remote", size, 7, "rdma")
    a = make_engine("a", transports=["rdma"])
    src = random_bytes(size, 8)
    seg = a.register(src)
    back = np.zeros(size, dtype=np.uint8)
    back_seg = a.register(back)
    peer = a.connect(endpoint)
    assert peer.transport == "rdma"
    remote = peer.segment("dst")
    a.read(peer, [(Descriptor(back_seg, 0, size), Descriptor(remote, 0, size))]).wait(30)
    assert np.array_equal(back, random_bytes(size, 7))  # the child's bytes, read
    a.write(peer, [(Descriptor(seg, 0, size), Descriptor(remote, 0, size))]).wait(30)
    back[:] = 0
    a.read(peer, [(Descriptor(back_seg, 0, size), Descriptor(remote, 0, size))]).wait(30)
    assert np.array_equal(back, src)  # ours, written there and read back


def test_an_emulated_peer_never_pairs_with_a_real_nic() -> None:
    t = _rdma()
    try:
        meta = {"transports": {"rdma": {"devices": ["mlx5_0"], "endpoint": "tcp://h:1"}}}
        assert not t.reachable(meta)
    finally:
        t.close()


def test_bench_emulated_reports_host_cost(tmp_path: Any,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    from bench.transfer_engine_bench import main

    out = tmp_path / "bench.json"
    rc = main(["--local", "--protocol", "rdma", "--emulated", "--duration", "0.5",
               "--block_size", "65536", "--batch_size", "64", "--operation", "write",
               "--buffer_size", str(64 * MiB), "--json", str(out)])
    assert rc == 0, capsys.readouterr()
    res = json.loads(out.read_text())
    assert res["verified"] is True and res["transport"] == "rdma" and res["emulated"]
    assert res["host_us_per_wr"] > 0 and res["host_cpu_s_per_gb"] > 0
    assert res["runs"][0]["work_requests"] > 0
    assert res["runs"][0]["host_cpu_sides"] == "initiator+target"
