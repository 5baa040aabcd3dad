"""The SGLang disaggregation backend against SGLang's own base classes.

What ran: SGLang's disaggregation base module (``BaseKVManager``, ``BaseKVSender``,
``BaseKVReceiver``, ``BaseKVBootstrapServer``, ``KVArgs``, ``KVPoll``,
``KVTransferMetric``) and its plugin hook registry and CLI choice list, imported from the
pinned sglang wheel as :mod:`tests.helpers.sglang_worker` describes (one annotation-only import
dropped; four definitions of ``disaggregation/utils.py`` taken from its syntax tree);
our manager, sender, receiver and bootstrap server subclassing them; real engines, real
ZeroMQ, real loopback sockets; prefill and decode ranks in two separate processes moving
pages of real torch CPU tensors laid out like SGLang's ``MHATokenToKVPool`` (per-layer K
and V buffers, page-indexed) and metadata rows, compared byte for byte; a killed prefill
process.

What did not run here: an SGLang server (``tests/test_connector_sglang_server.py`` runs
one where SGLang serves); ``ServerArgs`` is a namespace of the three fields the backend
reads; ``plugin.mount()`` runs with SGLang's real enum, ``get_kv_class``, hook registry
and choice list, ``plugin.register()`` (three imports inside SGLang) does not.

Skipped, with the reason, when the wheel is not installed (``scripts/setup_sglang.sh``);
with ``TE_SGLANG_REQUIRED=1`` its absence is an error instead.
"""

from __future__ import annotations

import inspect
import json
import os
import select
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.helpers import sglang_worker as sw
from tests.helpers.faults import forget_sglang_mounts, sglang_given_up, sglang_hooks
from tests.helpers.sglang_fixtures import FAST, failure, poll_until, sglang_mark
from transfer_engine.errors import (
    ClosedError,
    ConnectError,
    NotSupportedError,
    PeerLostError,
    ProtocolError,
    RemoteError,
    TransferTimeout,
)

pytestmark = sglang_mark()

ROOT = Path(__file__).resolve().parent.parent


# --- classes --------------------------------------------------------------------------


def test_classes_implement_sglang_base_classes(sg: sw.SGLang, te: Any) -> None:
    pairs = [(te.TransferEngineKVManager, sg.base.BaseKVManager),
             (te.TransferEngineKVSender, sg.base.BaseKVSender),
             (te.TransferEngineKVReceiver, sg.base.BaseKVReceiver),
             (te.TransferEngineKVBootstrapServer, sg.base.BaseKVBootstrapServer)]
    for cls, base in pairs:
        assert issubclass(cls, base)
        assert not cls.__abstractmethods__, cls
        for name in base.__abstractmethods__:
            assert name in cls.__dict__, f"{cls.__name__} does not define {name}"
            ours = inspect.signature(getattr(cls, name)).parameters
            theirs = inspect.signature(getattr(base, name)).parameters
            assert list(ours)[:len(theirs)] == list(theirs), (cls, name)


def test_every_class_instantiates_and_closes(sg: sw.SGLang, te: Any,
                                             ranks: Callable[..., Any]) -> None:
    srv = ranks.server()  # type: ignore[attr-defined]
    prefill = ranks("prefill", srv.port, seed=1)
    decode = ranks("decode")
    assert srv.ranks == [0]
    addr = f"127.0.0.1:{srv.port}"
    sender = te.TransferEngineKVSender(prefill, addr, 11)
    receiver = te.TransferEngineKVReceiver(decode, addr, 11)
    assert sender.poll() == receiver.poll() == sg.base.KVPoll.Bootstrapping
    assert isinstance(sender.get_transfer_metric(), sg.base.KVTransferMetric)
    assert "prefill" in repr(prefill) and "room=11" in repr(receiver)
    sender.clear()
    receiver.clear()
    prefill.close()
    prefill.close()  # idempotent
    assert "CLOSED" in repr(prefill)


# --- moving pages ---------------------------------------------------------------------


def page_bytes(t: Any, spec: sw.PoolSpec, page: int) -> bytes:
    import torch

    return bytes(t[page * spec.page_size:(page + 1) * spec.page_size]
                 .contiguous().view(torch.uint8).numpy().tobytes())


def test_pages_move_in_process_over_tcp_in_chunks(sg: sw.SGLang, te: Any,
                                                  ranks: Callable[..., Any]) -> None:
    KVPoll = sg.base.KVPoll
    srv = ranks.server()  # type: ignore[attr-defined]
    prefill = ranks("prefill", srv.port, seed=7, transports=("tcp",))
    decode = ranks("decode", transports=("tcp",))
    addr = f"127.0.0.1:{srv.port}"
    src, dst = [3, 4, 5, 9, 1], [10, 11, 12, 2, 15]
    sender = te.TransferEngineKVSender(prefill, addr, 2 ** 63 + 5)
    receiver = te.TransferEngineKVReceiver(decode, addr, 2 ** 63 + 5)
    receiver.init(0)
    receiver.send_metadata(np.array(dst, dtype=np.int32), 6)
    assert poll_until(sender, {KVPoll.WaitingForInput}) == KVPoll.WaitingForInput
    sender.init(len(src), 3)
    sender.send(np.array(src[:3], dtype=np.int32))
    assert sender.poll() == KVPoll.Transferring
    sender.send(np.array(src[3:], dtype=np.int32))
    assert poll_until(sender, {KVPoll.Success, KVPoll.Failed}) == KVPoll.Success
    assert poll_until(receiver, {KVPoll.Success, KVPoll.Failed}) == KVPoll.Success
    spec, pkv, paux = prefill.test_pool
    _, dkv, daux = decode.test_pool
    for p_buf, d_buf in zip(pkv, dkv, strict=True):
        for s, d in zip(src, dst, strict=True):
            assert page_bytes(d_buf, spec, d) == page_bytes(p_buf, spec, s)
        for d in set(range(spec.pages + 1)) - set(dst):
            assert not any(page_bytes(d_buf, spec, d))
    for p_buf, d_buf in zip(paux, daux, strict=True):
        assert d_buf[6].numpy().tobytes() == p_buf[3].numpy().tobytes()
    metric = sender.get_transfer_metric()
    item = sum(t[0].nbytes * spec.page_size for t in pkv)
    assert metric.transfer_total_bytes == len(src) * item + sum(t[0].nbytes for t in paux)
    assert decode.stats["chunks_received"] == 2
    sender.clear()
    receiver.clear()


def test_last_chunk_without_bytes_completes_through_the_side_channel(
        sg: sw.SGLang, te: Any, ranks: Callable[..., Any]) -> None:
    KVPoll = sg.base.KVPoll
    srv = ranks.server()  # type: ignore[attr-defined]
    prefill = ranks("prefill", srv.port, seed=3)
    decode = ranks("decode")
    addr = f"127.0.0.1:{srv.port}"
    sender = te.TransferEngineKVSender(prefill, addr, 5)
    receiver = te.TransferEngineKVReceiver(decode, addr, 5)
    receiver.init(0)
    receiver.send_metadata(np.array([7, 8], dtype=np.int32))  # no metadata row
    poll_until(sender, {KVPoll.WaitingForInput})
    sender.init(2, None)
    sender.send(np.array([1, 2], dtype=np.int32))
    sender.send(np.array([3], dtype=np.int32))  # past the last chunk: ignored
    assert poll_until(sender, {KVPoll.Success, KVPoll.Failed}) == KVPoll.Success
    assert poll_until(receiver, {KVPoll.Success, KVPoll.Failed}) == KVPoll.Success
    empty = te.TransferEngineKVSender(prefill, addr, 6)
    late = te.TransferEngineKVReceiver(decode, addr, 6)
    late.init(0)
    late.send_metadata(np.array([], dtype=np.int32))
    poll_until(empty, {KVPoll.WaitingForInput})
    empty.init(0, None)
    empty.send(np.array([], dtype=np.int32))  # the only chunk carries no bytes
    assert poll_until(empty, {KVPoll.Success, KVPoll.Failed}) == KVPoll.Success
    assert poll_until(late, {KVPoll.Success, KVPoll.Failed}) == KVPoll.Success
    for conn in (sender, receiver, empty, late):
        conn.clear()


class Worker:
    """A rank in its own process (:mod:`tests.helpers.sglang_worker`), one JSON command at a
    time, each answer awaited with a bound."""

    def __init__(self, role: str, port: int, seed: int | None, log: Path,
                 **extra: Any) -> None:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            [str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
        self._log = open(log, "wb")  # noqa: SIM115 (closed in close())
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.helpers.sglang_worker", role, str(port),
             "-" if seed is None else str(seed), json.dumps({"config": FAST, **extra})],
            cwd=ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=self._log)
        self.logfile = log
        self._buf = b""
        try:
            self.name = self._read(60.0)["ready"]
        except BaseException:
            self.close()
            raise

    def _read(self, timeout: float) -> dict[str, Any]:
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise TimeoutError(f"worker silent for {timeout}s; log:\n"
                                   + self.logfile.read_text()[-3000:])
            chunk = os.read(fd, 65536)
            if not chunk:
                raise EOFError("worker exited; log:\n" + self.logfile.read_text()[-3000:])
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return dict(json.loads(line))

    def __call__(self, op: str, timeout: float = 20.0, **args: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": op, **args}).encode() + b"\n")
        self.proc.stdin.flush()
        return self._read(timeout)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(10)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self("exit", timeout=10)
                self.proc.wait(10)
            except (OSError, TimeoutError, EOFError, subprocess.TimeoutExpired):
                self.kill()
        for stream in (self.proc.stdin, self.proc.stdout):
            if stream is not None:
                stream.close()
        self._log.close()


@pytest.fixture
def workers(tmp_path: Path) -> Iterator[Callable[..., Worker]]:
    started: list[Worker] = []

    def start(role: str, port: int, seed: int | None = None, **extra: Any) -> Worker:
        w = Worker(role, port, seed, tmp_path / f"{role}-{len(started)}.log", **extra)
        started.append(w)
        return w

    yield start
    for w in reversed(started):
        w.close()


def test_pages_move_byte_exact_between_processes(te: Any, tmp_path: Path,
                                                 workers: Callable[..., Worker]) -> None:
    pool = {"layers": 3, "heads": 2, "head_dim": 64, "page_size": 16, "pages": 40}
    spec = sw.PoolSpec(**pool)
    with te.TransferEngineKVBootstrapServer("127.0.0.1", 0) as srv:
        prefill = workers("prefill", srv.port, seed=1234, pool=pool)
        decode = workers("decode", 0, seed=None, pool=pool)
        addr = f"127.0.0.1:{srv.port}"
        room = 987654321
        rng = np.random.default_rng(99)
        free = [p for p in range(1, spec.pages) if p not in range(20, 24)]
        src = [20, 21, 22, 23] + rng.choice(free, 20, replace=False).tolist()
        free = [p for p in range(1, spec.pages + 1) if p not in range(5, 9)]
        dst = [5, 6, 7, 8] + rng.choice(free, 20, replace=False).tolist()  # runs coalesce
        assert prefill("sender", room=room, addr=addr)["state"] == "Bootstrapping"
        assert decode("receiver", room=room, addr=addr)["state"] == "Bootstrapping"
        assert decode("init", room=room)["state"] == "WaitingForInput"
        assert decode("send_metadata", room=room, pages=dst, aux=5)["state"] \
            == "WaitingForInput"
        assert prefill("wait", room=room, until=["WaitingForInput"])["state"] \
            == "WaitingForInput"
        prefill("init", room=room, pages=len(src), aux=2)
        assert prefill("send", room=room, pages=src[:10])["state"] == "Transferring"
        assert decode("wait", room=room, until=["Transferring", "Failed"])["state"] \
            == "Transferring"
        prefill("send", room=room, pages=src[10:])
        sent = prefill("wait", room=room, until=["Success", "Failed"])
        got = decode("wait", room=room, until=["Success", "Failed"])
        states = ["Bootstrapping", "WaitingForInput", "Transferring", "Success"]
        assert sent["seen"] == states, sent
        assert got["seen"] == states, got
        assert prefill("stats")["stats"]["transfers_done"] == 2
        prefill("dump", path=str(tmp_path / "p.npz"))
        decode("dump", path=str(tmp_path / "d.npz"))
    with np.load(tmp_path / "p.npz") as p, np.load(tmp_path / "d.npz") as d:
        page = spec.page_size * spec.heads * spec.head_dim * 2
        for i in range(2 * spec.layers):
            pk, dk = p[f"kv{i}"].reshape(-1, page), d[f"kv{i}"].reshape(-1, page)
            np.testing.assert_array_equal(dk[dst], pk[src])
            rest = np.setdiff1d(np.arange(len(dk)), dst)
            assert not dk[rest].any()
            assert pk[src].any()
        for i in range(2):
            pa, da = p[f"aux{i}"].reshape(spec.aux_rows, -1), d[f"aux{i}"].reshape(
                spec.aux_rows, -1)
            np.testing.assert_array_equal(da[5], pa[2])
            assert not np.delete(da, 5, axis=0).any()


# --- failures -------------------------------------------------------------------------


def test_killed_prefill_fails_the_receiver(te: Any, workers: Callable[..., Worker]) -> None:
    with te.TransferEngineKVBootstrapServer("127.0.0.1", 0) as srv:
        prefill = workers("prefill", srv.port, seed=5)
        decode = workers("decode", 0)
        addr = f"127.0.0.1:{srv.port}"
        prefill("sender", room=42, addr=addr)
        decode("receiver", room=42, addr=addr)
        decode("init", room=42)
        decode("send_metadata", room=42, pages=[1, 2, 3, 4], aux=0)
        prefill("wait", room=42, until=["WaitingForInput"])
        prefill("init", room=42, pages=4, aux=0)
        prefill("send", room=42, pages=[5, 6])
        assert decode("wait", room=42, until=["Transferring"])["state"] == "Transferring"
        prefill.kill()
        started = time.monotonic()
        got = decode("wait", room=42, until=["Failed", "Success"], timeout=10)
        assert got["state"] == "Failed"
        assert got["seen"] == ["Bootstrapping", "WaitingForInput", "Transferring", "Failed"]
        assert time.monotonic() - started < 5
        kind, text = decode("failure", room=42)["error"]
        assert kind == PeerLostError.__name__
        assert "bootstrap room 42" in text and "stopped answering" in text


@pytest.mark.parametrize("room", [-1, 2 ** 64, "7", None, 3.0, True])
def test_bad_bootstrap_room_fails_at_once(sg: sw.SGLang, te: Any, ranks: Callable[..., Any],
                                          room: Any) -> None:
    srv = ranks.server()  # type: ignore[attr-defined]
    prefill = ranks("prefill", srv.port)
    decode = ranks("decode")
    addr = f"127.0.0.1:{srv.port}"
    for conn in (te.TransferEngineKVSender(prefill, addr, room),
                 te.TransferEngineKVReceiver(decode, addr, room)):
        assert conn.poll() == sg.base.KVPoll.Failed
        err = failure(conn)
        assert isinstance(err, ProtocolError)
        assert "bootstrap room must be an integer in [0, 2**64)" in str(err)


def test_room_claimed_twice_is_refused(sg: sw.SGLang, te: Any,
                                       ranks: Callable[..., Any]) -> None:
    KVPoll = sg.base.KVPoll
    srv = ranks.server()  # type: ignore[attr-defined]
    prefill = ranks("prefill", srv.port)
    first, second = ranks("decode"), ranks("decode")
    addr = f"127.0.0.1:{srv.port}"
    a = te.TransferEngineKVReceiver(first, addr, 9)
    b = te.TransferEngineKVReceiver(second, addr, 9)
    for r in (a, b):
        r.init(0)
        r.send_metadata(np.array([1], dtype=np.int32))
    assert a.poll() == KVPoll.WaitingForInput
    assert b.poll() == KVPoll.Failed
    text = str(failure(b))
    assert "bootstrap room 9" in text and "already claimed by decode" in text
    dup = te.TransferEngineKVSender(prefill, addr, 9)
    other = te.TransferEngineKVSender(prefill, addr, 9)
    assert other.poll() == KVPoll.Failed
    assert "already has a sender" in str(failure(other))
    for conn in (a, dup):
        conn.clear()


def test_room_without_prefill_request_fails_both_sides_in_time(
        sg: sw.SGLang, te: Any, ranks: Callable[..., Any]) -> None:
    KVPoll = sg.base.KVPoll
    srv = ranks.server()  # type: ignore[attr-defined]
    prefill = ranks("prefill", srv.port, bootstrap_timeout_s=0.3)
    decode = ranks("decode", waiting_timeout_s=20.0)
    addr = f"127.0.0.1:{srv.port}"
    orphan = te.TransferEngineKVReceiver(decode, addr, 77)  # prefill never hears of 77
    orphan.init(0)
    orphan.send_metadata(np.array([1, 2], dtype=np.int32))
    assert poll_until(orphan, {KVPoll.Failed}, timeout=5) == KVPoll.Failed
    err = failure(orphan)
    assert isinstance(err, RemoteError)
    assert "no prefill request for bootstrap room 77" in str(err)
    lonely = te.TransferEngineKVSender(prefill, addr, 78)  # decode never claims 78
    assert poll_until(lonely, {KVPoll.Failed}, timeout=5) == KVPoll.Failed
    err = failure(lonely)
    assert isinstance(err, TransferTimeout)
    assert "no decode rank claimed the room within 0.3s" in str(err)


def test_decode_waiting_timeout_and_abort_reach_the_prefill(
        sg: sw.SGLang, te: Any, ranks: Callable[..., Any]) -> None:
    KVPoll = sg.base.KVPoll
    srv = ranks.server()  # type: ignore[attr-defined]
    prefill = ranks("prefill", srv.port)
    decode = ranks("decode", waiting_timeout_s=0.3)
    addr = f"127.0.0.1:{srv.port}"
    sender = te.TransferEngineKVSender(prefill, addr, 31)
    receiver = te.TransferEngineKVReceiver(decode, addr, 31)
    receiver.init(0)
    receiver.send_metadata(np.array([1], dtype=np.int32))
    poll_until(sender, {KVPoll.WaitingForInput})
    assert poll_until(receiver, {KVPoll.Failed}, timeout=5) == KVPoll.Failed
    err = failure(receiver)
    assert isinstance(err, TransferTimeout) and "did not arrive within 0.3s" in str(err)
    assert poll_until(sender, {KVPoll.Failed}, timeout=5) == KVPoll.Failed
    err = failure(sender)
    assert isinstance(err, RemoteError) and "decode gave the room up" in str(err)
    aborting = te.TransferEngineKVSender(prefill, addr, 32)
    aborted = te.TransferEngineKVReceiver(decode, addr, 32)
    aborted.init(0)
    aborted.send_metadata(np.array([2], dtype=np.int32))
    poll_until(aborting, {KVPoll.WaitingForInput})
    aborted.abort()
    assert aborted.poll() == KVPoll.Failed and aborted.abort_notified
    assert isinstance(failure(aborted), ClosedError)
    assert poll_until(aborting, {KVPoll.Failed}, timeout=5) == KVPoll.Failed
    assert "aborted by SGLang" in str(failure(aborting))


def test_abort_that_overtakes_its_request_keeps_the_room_unserved(
        te: Any, ranks: Callable[..., Any]) -> None:
    from transfer_engine.connectors.sglang.messages import RoomStatus

    srv = ranks.server()  # type: ignore[attr-defined]
    prefill = ranks("prefill", srv.port)
    decode = ranks("decode")
    entry = decode.prefill_info(f"127.0.0.1:{srv.port}")
    recv = decode.open_recv_room(55, entry)
    decode.post(entry.channel, RoomStatus(55, recv.nonce, False, "request timed out"))
    deadline = time.monotonic() + 5
    while (55, recv.nonce) not in sglang_given_up(prefill) and time.monotonic() < deadline:
        time.sleep(0.01)
    request = decode.room_request(recv, np.array([1], dtype=np.int32), -1, 0)
    with pytest.raises(RemoteError, match="gave bootstrap room 55 up before its request"):
        decode.request_room(entry, request)
    assert prefill.send_room(55) is None
    decode.forget_recv_room(55)


def test_incompatible_caches_are_refused_naming_the_difference(
        sg: sw.SGLang, te: Any, ranks: Callable[..., Any]) -> None:
    srv = ranks.server()  # type: ignore[attr-defined]
    ranks("prefill", srv.port, spec=sw.PoolSpec(layers=2, pages=8, page_size=16))
    decode = ranks("decode", spec=sw.PoolSpec(layers=2, pages=8, page_size=32))
    receiver = te.TransferEngineKVReceiver(decode, f"127.0.0.1:{srv.port}", 1)
    receiver.init(0)
    assert receiver.poll() == sg.base.KVPoll.Failed
    err = failure(receiver)
    text = str(err)
    assert isinstance(err, ProtocolError) and "incompatible KV caches" in text
    assert "page_size: ours=32 peer=16" in text and "kv_item_lens" in text


def test_unregistered_rank_and_unsupported_requests_fail_clearly(
        sg: sw.SGLang, te: Any, ranks: Callable[..., Any]) -> None:
    KVPoll = sg.base.KVPoll
    srv = ranks.server()  # type: ignore[attr-defined]
    ranks("prefill", srv.port)
    addr = f"127.0.0.1:{srv.port}"
    rank1 = ranks("decode", rank=1)
    lost = te.TransferEngineKVReceiver(rank1, addr, 3)
    lost.init(0)
    assert lost.poll() == KVPoll.Failed
    assert "prefill rank 1 has not registered here (registered ranks: [0])" in str(
        failure(lost))
    decode = ranks("decode")
    dp = te.TransferEngineKVReceiver(decode, addr, 4)
    dp.init(1)
    assert isinstance(failure(dp), NotSupportedError)
    state = te.TransferEngineKVReceiver(decode, addr, 5)
    state.init(0)
    state.send_metadata(np.array([1], dtype=np.int32), None, [np.array([3])])
    assert state.poll() == KVPoll.Failed
    err = failure(state)
    assert isinstance(err, NotSupportedError) and "state buffers" in str(err)
    impatient = ranks("decode", timeout_s=0.3)
    nowhere = te.TransferEngineKVReceiver(impatient, "127.0.0.1:1", 6)
    nowhere.init(0)
    assert nowhere.poll() == KVPoll.Failed
    assert isinstance(failure(nowhere), TransferTimeout)


def test_an_unreachable_prefill_never_holds_the_scheduler(
        sg: sw.SGLang, te: Any, ranks: Callable[..., Any]) -> None:
    """SGLang's decode scheduler asks each cycle whether a request's prefill server is
    known: an address that does not answer costs each cycle at most a tenth of a
    second (the lookup runs in the background, bounded by the timeout), and a live one
    is known at once."""
    decode = ranks("decode", timeout_s=1.0)
    started = time.monotonic()
    slowest = 0.0
    while time.monotonic() - started < 3.0:  # past one whole lookup timeout
        t0 = time.monotonic()
        assert decode.try_ensure_parallel_info("127.0.0.1:1") is False
        slowest = max(slowest, time.monotonic() - t0)
        time.sleep(0.05)
    assert slowest < 0.3, slowest
    srv = ranks.server()  # type: ignore[attr-defined]
    ranks("prefill", srv.port)
    assert decode.try_ensure_parallel_info(f"127.0.0.1:{srv.port}") is True
    assert decode.try_ensure_parallel_info("not an address") is False


def test_prefill_without_bootstrap_server_refuses_to_start(
        sg: sw.SGLang, te: Any, ranks: Callable[..., Any]) -> None:
    with pytest.raises(ConnectError, match="could not register"):
        ranks("prefill", 1, timeout_s=0.2, register_attempts=2)


# --- mounting -------------------------------------------------------------------------


def test_mounts_as_an_sglang_transfer_backend(sg: sw.SGLang, te: Any) -> None:
    from transfer_engine.connectors.sglang import plugin

    utils, hooks, choices = sg.utils, sg.hook_registry, sg.choices
    original = utils.get_kv_class
    before = {m.name: m for m in utils.TransferBackend}
    try:
        member = plugin.mount(utils, hooks, choices.add_disagg_transfer_backend_choices)
        hooks.HookRegistry.apply_hooks()
        assert "transfer_engine" in choices.DISAGG_TRANSFER_BACKEND_CHOICES
        assert utils.TransferBackend("transfer_engine") is member
        assert utils.TransferBackend.TRANSFER_ENGINE is member
        assert utils.TransferBackend["TRANSFER_ENGINE"] is member
        assert {m.name: m for m in utils.TransferBackend if m is not member} == before
        get, kinds = utils.get_kv_class, utils.KVClassType
        assert get(member, kinds.MANAGER) is te.TransferEngineKVManager
        assert get(member, kinds.SENDER) is te.TransferEngineKVSender
        assert get(member, kinds.RECEIVER) is te.TransferEngineKVReceiver
        assert get(member, kinds.BOOTSTRAP_SERVER) is te.TransferEngineKVBootstrapServer
        assert get(member, kinds.KVARGS) is sg.base.KVArgs  # SGLang's own answer
        assert get(utils.TransferBackend.MOONCAKE, kinds.KVARGS) is sg.base.KVArgs
        assert plugin.mount(utils, hooks, choices.add_disagg_transfer_backend_choices) \
            is member
        assert choices.DISAGG_TRANSFER_BACKEND_CHOICES.count("transfer_engine") == 1
        target = f"{utils.__name__}.get_kv_class"
        assert len(sglang_hooks(hooks.HookRegistry, target)) == 1
    finally:
        hooks.HookRegistry.reset()
        forget_sglang_mounts(plugin)
        utils.get_kv_class = original
        while "transfer_engine" in choices.DISAGG_TRANSFER_BACKEND_CHOICES:
            choices.DISAGG_TRANSFER_BACKEND_CHOICES.remove("transfer_engine")
