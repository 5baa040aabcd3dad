"""A failed room's pages go back to SGLang only once no write of prefill's can land in
them (transfer_engine/connectors/sglang/fences.py).

Prefill and decode ranks are real managers in this process (SGLang's base classes, real
engines over loopback tcp, real ZeroMQ side channels), as in
``tests/test_connector_sglang.py``. Both ways a decode rank gives pages back are
covered: SGLang's deferred release (``is_abort_release_safe``, on by default in the
pinned SGLang) and, with it off, ``poll`` that stays ``Transferring`` until the fence
stands. A prefill that never says its writes ended is played by a prefill rank whose
background thread (the one that sends that word) was stopped.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.helpers import sglang_worker as sw
from tests.helpers.sglang_fixtures import failure, poll_until, sglang_mark
from transfer_engine.errors import ClosedError, ProtocolError, TransferEngineError
from transfer_engine.handle import TransferState

pytestmark = sglang_mark()

POOL = sw.PoolSpec(layers=4, heads=8, head_dim=128, pages=64)  # 256 KiB per page


def _pair(ranks: Callable[..., Any], **decode_config: Any) -> tuple[Any, Any, str]:
    srv = ranks.server()  # type: ignore[attr-defined]
    prefill = ranks("prefill", srv.port, seed=5, spec=POOL, transports=("tcp",))
    decode = ranks("decode", spec=POOL, transports=("tcp",), **decode_config)
    return prefill, decode, f"127.0.0.1:{srv.port}"


def _until(check: Callable[[], bool], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not check() and time.monotonic() < deadline:
        time.sleep(0.002)
    return check()


def _started(sg: sw.SGLang, te: Any, prefill: Any, decode: Any, addr: str, room: int,
             pages: list[int], sent: int = 0) -> tuple[Any, Any]:
    """A room whose request prefill claimed, its first ``sent`` pages written in one
    chunk (more are announced: the room cannot complete)."""
    KVPoll = sg.base.KVPoll
    sender = te.TransferEngineKVSender(prefill, addr, room)
    receiver = te.TransferEngineKVReceiver(decode, addr, room)
    receiver.init(0)
    receiver.send_metadata(np.array(pages, dtype=np.int32))
    assert poll_until(sender, {KVPoll.WaitingForInput}) == KVPoll.WaitingForInput
    sender.init(len(pages), None)
    if sent:
        sender.send(np.array(pages[:sent], dtype=np.int32))
    return sender, receiver


def _raw(bufs: list[Any]) -> list[bytes]:
    import torch

    return [bytes(buf.view(torch.uint8).numpy().tobytes()) for buf in bufs]


@pytest.mark.parametrize("deferred", [True, False], ids=["sglang-defers", "poll-holds"])
def test_an_abort_gives_pages_back_only_after_prefills_writes_ended(
        sg: sw.SGLang, te: Any, ranks: Callable[..., Any], deferred: bool) -> None:
    KVPoll = sg.base.KVPoll
    prefill, decode, addr = _pair(ranks)
    decode.enable_deferred_decode_kv_release = deferred
    pages = list(range(1, 50))
    sender, receiver = _started(sg, te, prefill, decode, addr, 71, pages, sent=48)
    receiver.abort()  # 12 MiB in flight, most likely

    def released() -> bool:
        if deferred:
            return bool(decode.is_abort_release_safe(71, 1))
        return bool(receiver.poll() == KVPoll.Failed)

    if deferred:
        assert receiver.poll() == KVPoll.Failed  # SGLang holds the pages itself
    assert _until(released)
    # the word came from prefill once its write had ended: nothing of it is in flight
    assert all(h.state is not TransferState.PENDING for h in sender._handles)
    assert isinstance(failure(receiver), ClosedError)
    assert decode.stats["fences_quiet"] == 1 and decode.stats["fence_cuts"] == 0
    decode.clear_deferred_abort_state(71)
    receiver.clear()
    assert poll_until(sender, {KVPoll.Failed}) == KVPoll.Failed
    with pytest.raises(TransferEngineError, match="gave the room up"):  # no more writes
        prefill.post_write(prefill.send_room(71), [], b"")


def test_the_word_that_a_room_is_quiet_goes_out_when_it_is_due_not_on_a_timer(
        sg: sw.SGLang, te: Any, ranks: Callable[..., Any],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The background threads' timed rounds are pushed out to 60 s: decode's abort,
    prefill's stop of the room, the end of its write and its quiet each wake the thread
    that acts on them, so both aborts below (nothing in flight; 12 MiB in flight) are
    fenced by prefill's word long before any round would have come."""
    monkeypatch.setattr(te.TransferEngineKVManager, "ROUND_S", 60.0)
    prefill, decode, addr = _pair(ranks)
    decode.enable_deferred_decode_kv_release = True
    pages = list(range(1, 50))
    for room, sent in ((73, 0), (74, 48)):
        sender, receiver = _started(sg, te, prefill, decode, addr, room, pages, sent=sent)
        receiver.abort()
        assert _until(lambda r=room: bool(decode.is_abort_release_safe(r, 1)), 20.0), room
        assert all(h.state is not TransferState.PENDING for h in sender._handles)
        decode.clear_deferred_abort_state(room)
        receiver.clear()
        sender.clear()
    assert decode.stats["fences_quiet"] == 2 and decode.stats["fence_cuts"] == 0


def test_poll_holds_a_failed_room_while_prefill_may_still_write(
        sg: sw.SGLang, te: Any, ranks: Callable[..., Any]) -> None:
    """Prefill's quiet is held back (its background thread paused): ``poll`` reports
    ``Transferring`` for the failed room, and ``Failed`` the moment the quiet lands."""
    KVPoll = sg.base.KVPoll
    prefill, decode, addr = _pair(ranks, fence_timeout_s=30.0)
    decode.enable_deferred_decode_kv_release = False
    sender, receiver = _started(sg, te, prefill, decode, addr, 72, [3, 4], sent=1)
    assert _until(lambda: all(h.state is TransferState.DONE for h in sender._handles))
    with prefill._lock:  # prefill can neither stop the room nor say so meanwhile
        receiver.abort()
        for _ in range(20):
            assert receiver.poll() == KVPoll.Transferring
            time.sleep(0.01)
    assert _until(lambda: receiver.poll() == KVPoll.Failed)
    assert decode.stats["fences_quiet"] == 1 and decode.stats["fence_cuts"] == 0
    receiver.clear()
    sender.clear()


def test_a_silent_prefill_is_cut_off_before_its_rooms_pages_go_back(
        sg: sw.SGLang, te: Any, ranks: Callable[..., Any]) -> None:
    KVPoll = sg.base.KVPoll
    prefill, decode, addr = _pair(ranks, fence_timeout_s=0.4)
    decode.enable_deferred_decode_kv_release = False
    dst = [10, 11]
    sender, receiver = _started(sg, te, prefill, decode, addr, 73, dst)
    prefill._bg_stop.set()  # prefill never says its writes ended
    prefill._bg.join(5)
    started = time.monotonic()
    receiver.abort()
    assert receiver.poll() == KVPoll.Transferring
    assert _until(lambda: receiver.poll() == KVPoll.Failed)
    assert time.monotonic() - started >= 0.4
    assert decode.stats["fence_cuts"] == 1 and decode.stats["fences_quiet"] == 0
    receiver.clear()

    _, dkv, _ = decode.test_pool
    for buf in dkv:  # the pages now hold another request's KV
        buf[10 * POOL.page_size:12 * POOL.page_size] = 7
    before = _raw(dkv)
    claim = prefill.send_room(73)
    late = prefill.pairs(claim, [1, 2], dst, None)  # prefill wakes and writes anyway
    with pytest.raises(TransferEngineError):
        prefill.engine.write(claim.peer, late).wait(10)
    time.sleep(0.05)
    assert _raw(dkv) == before, "a write of the cut prefill landed in reused pages"
    sender.clear()


def test_one_cut_fences_every_room_whose_writes_went_on_its_ticket(
        sg: sw.SGLang, te: Any, ranks: Callable[..., Any]) -> None:
    from transfer_engine.connectors.sglang.messages import RoomQuiet

    KVPoll = sg.base.KVPoll
    prefill, decode, addr = _pair(ranks)
    sender, receiver = _started(sg, te, prefill, decode, addr, 74, [5], sent=1)
    assert poll_until(receiver, {KVPoll.Success}) == KVPoll.Success
    ticket = prefill.send_room(74).peer.ticket
    assert len(ticket) == 16
    name = prefill.engine.name
    fences = decode.fences
    for room in (81, 82, 83):
        fences.start(room, room, name)
    # two rooms' writes failed on one ticket: one cut fences both
    decode._on_request(RoomQuiet(81, 81, False, ticket))
    decode._on_request(RoomQuiet(82, 82, False, ticket))
    assert _until(lambda: fences.safe(81) and fences.safe(82))
    assert decode.stats["fence_cuts"] == 1
    # prefill connected afresh (a new ticket) and more of its rooms failed: those on the
    # old ticket cost no cut; one on the new ticket does
    claim = prefill.send_room(74)
    with pytest.raises(TransferEngineError):  # prefill learns it was cut
        prefill.engine.write(claim.peer, prefill.pairs(claim, [1], [5], None)).wait(10)
    peer = prefill.engine.connect(decode.engine.endpoint)
    assert peer.ticket and peer.ticket != ticket
    fences.start(84, 84, name)
    decode._on_request(RoomQuiet(84, 84, False, ticket))
    assert _until(lambda: fences.safe(84))
    assert decode.stats["fence_cuts"] == 1 and decode.stats["fences_covered"] >= 1
    decode._on_request(RoomQuiet(83, 83, False, peer.ticket))
    assert _until(lambda: fences.safe(83))
    assert decode.stats["fence_cuts"] == 2
    for room in (81, 82, 83, 84):
        decode.clear_deferred_abort_state(room)
    receiver.clear()
    sender.clear()


def test_a_late_abort_of_a_room_prefill_let_go_is_answered_at_once(
        sg: sw.SGLang, te: Any, ranks: Callable[..., Any]) -> None:
    """Decode failed the room (timeout) just as its last write completed, and SGLang on
    prefill had already let the room go: prefill still answers, clean, without a cut."""
    from transfer_engine.connectors.sglang.messages import RoomStatus

    KVPoll = sg.base.KVPoll
    prefill, decode, addr = _pair(ranks)
    sender, receiver = _started(sg, te, prefill, decode, addr, 75, [6, 7], sent=2)
    assert poll_until(sender, {KVPoll.Success}) == KVPoll.Success
    nonce = prefill.send_room(75).nonce
    sender.clear()
    fence = decode.fences.start(75, nonce, prefill.engine.name)
    decode.post(decode.recv_room(75).prefill.channel, RoomStatus(75, nonce, False, "late"))
    assert _until(lambda: fence.fenced)
    assert decode.stats["fences_quiet"] == 1 and decode.stats["fence_cuts"] == 0
    decode.clear_deferred_abort_state(75)
    receiver.clear()


def test_room_quiet_messages_are_checked(sg: sw.SGLang, te: Any,
                                         ranks: Callable[..., Any]) -> None:
    from transfer_engine.connectors.sglang.messages import RoomQuiet

    prefill, decode, _ = _pair(ranks)
    fence = decode.fences.start(90, 9, prefill.engine.name)
    for bad in (RoomQuiet(90, -1, True, b""), RoomQuiet(90, 2 ** 32, True, b""),
                RoomQuiet(90, 9, True, b"x" * 65), RoomQuiet(-5, 9, True, b"")):
        with pytest.raises(ProtocolError):
            decode._on_request(bad)
    decode._on_request(RoomQuiet(90, 8, True, b""))  # another use of the room: ignored
    decode._on_request(RoomQuiet(91, 9, True, b""))  # a room not fenced here: ignored
    assert not fence.fenced and not decode.is_abort_release_safe(90, 1)
    assert decode.is_abort_release_safe(91, 1)
    with pytest.raises(ProtocolError, match="unexpected"):
        prefill._on_request(RoomQuiet(90, 9, True, b""))
    decode._on_request(RoomQuiet(90, 9, True, b""))
    assert fence.fenced and decode.is_abort_release_safe(90, 1)
    decode._on_request(RoomQuiet(90, 9, False, b""))  # a second word changes nothing
    assert decode.is_abort_release_safe(90, 1)
    decode.clear_deferred_abort_state(90)


@pytest.mark.parametrize("bad", [0.0, -1.0, float("inf"), float("nan")])
def test_fence_timeout_is_checked(te: Any, bad: float) -> None:
    with pytest.raises(ValueError, match="fence_timeout_s"):
        te.SGLangBackendConfig(fence_timeout_s=bad)


def test_fence_timeout_comes_from_the_environment(te: Any) -> None:
    cfg = te.SGLangBackendConfig.from_env(environ={"TE_SGLANG_FENCE_TIMEOUT": "2.5"})
    assert cfg.fence_timeout_s == 2.5
    assert te.SGLangBackendConfig.from_env(environ={}).fence_timeout_s == 5.0


def test_prefill_says_a_stopped_rooms_writes_ended_only_once_they_have(
        sg: sw.SGLang, te: Any, ranks: Callable[..., Any], tmp_path: Path) -> None:
    """Decode is a process of its own, stopped (SIGSTOP) while prefill's write to it is
    under way, so the write cannot end; the abort is handed to prefill's side channel
    directly. Prefill keeps quiet until the write ended, then says so."""
    from tests.test_connector_sglang import Worker
    from transfer_engine.connectors.sglang.messages import RoomStatus

    KVPoll = sg.base.KVPoll
    pool = {"layers": 4, "heads": 8, "head_dim": 128, "pages": 64}
    srv = ranks.server()  # type: ignore[attr-defined]
    prefill = ranks("prefill", srv.port, seed=5, spec=POOL, transports=("tcp",))
    decode = Worker("decode", 0, None, tmp_path / "decode.log", pool=pool)
    addr = f"127.0.0.1:{srv.port}"
    try:
        pages = list(range(1, 50))
        sender = te.TransferEngineKVSender(prefill, addr, 76)
        decode("receiver", room=76, addr=addr)
        decode("init", room=76)
        decode("send_metadata", room=76, pages=pages)
        assert poll_until(sender, {KVPoll.WaitingForInput}) == KVPoll.WaitingForInput
        sender.init(len(pages), None)
        os.kill(decode.proc.pid, signal.SIGSTOP)
        try:
            sender.send(np.array(pages[:48], dtype=np.int32))  # 12 MiB: cannot end now
            claim = prefill.send_room(76)
            prefill._on_request(RoomStatus(76, claim.nonce, False, "decode aborted"))
            time.sleep(0.3)
            assert sender._handles[0].state is TransferState.PENDING
            assert prefill.stats["rooms_quieted"] == 0
        finally:
            os.kill(decode.proc.pid, signal.SIGCONT)
        assert _until(lambda: prefill.stats["rooms_quieted"] == 1)
        assert sender._handles[0].state is not TransferState.PENDING
        assert poll_until(sender, {KVPoll.Failed}) == KVPoll.Failed
        sender.clear()
    finally:
        decode.close()
