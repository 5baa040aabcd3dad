"""The SGLang backend against hostile or broken peers: room requests, room statuses and
bootstrap registrations sent by hand over real ZeroMQ sockets to real managers and a
real bootstrap server, and a decode endpoint that accepts TCP but never answers (a bare
listening socket). Each case checks the refusal is a precise error of the project's
tree, answered at the door, and that nothing else on the rank is held up.

Skipped, like :mod:`tests.test_connector_sglang`, when the sglang wheel is missing.
"""

from __future__ import annotations

import dataclasses
import socket
import time
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

import numpy as np
import pytest
import zmq

from bench.fleet import free_port
from tests.helpers import sglang_worker as sw
from tests.helpers.sglang_fixtures import failure, poll_until, sglang_mark
from transfer_engine.control.auth import AuthConfig
from transfer_engine.control.messages import Ack, Message
from transfer_engine.errors import (
    ConnectError,
    ProtocolError,
    RemoteError,
    TransferTimeout,
)
from transfer_engine.peer import ControlClient

pytestmark = sglang_mark()

# prefill's connect to a silent decode endpoint takes timeout_s / 2: long enough that
# every check made while it is under way finishes first, even on a loaded machine
SLOW_CONNECT = {"timeout_s": 8.0}


@pytest.fixture
def send() -> Iterator[Callable[[str, Message], Message]]:
    """Sends one message by hand to a side channel or bootstrap server, as a peer that
    holds the secret (if any) would; returns the answer or raises its refusal."""
    zctx: zmq.Context[Any] = zmq.Context()
    signer = AuthConfig.from_env().signer()

    def request(endpoint: str, msg: Message) -> Message:
        client = ControlClient(zctx, endpoint, peer=endpoint, auth=signer)
        try:
            return client.request(msg, 10.0)
        finally:
            client.close()

    yield request
    zctx.term()


@pytest.fixture
def tarpit() -> Iterator[str]:
    """An endpoint that accepts TCP connections and never says a word."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    yield f"tcp://127.0.0.1:{sock.getsockname()[1]}"
    sock.close()


def wait_for(check: Callable[[], Any], timeout: float = 15.0) -> Any:
    deadline = time.monotonic() + timeout
    while not (value := check()) and time.monotonic() < deadline:
        time.sleep(0.01)
    return value


def hostile_request(decode: Any, srv: Any, room: int, **fields: Any) -> tuple[Any, Any]:
    """A room request of ``decode`` for ``room``, with ``fields`` replaced; and the
    prefill entry it goes to."""
    entry = decode.prefill_info(f"127.0.0.1:{srv.port}")
    recv = decode.open_recv_room(room, entry)
    msg = decode.room_request(recv, np.array([1, 2], dtype=np.int32), 3, 0)
    return dataclasses.replace(msg, **fields), entry


# --- room requests: every field checked at the door -----------------------------------


def test_room_request_fields_are_checked_at_the_door(
        sg: sw.SGLang, te: Any, ranks: Callable[..., Any]) -> None:
    """Values that would be packed (the nonce, as u32 in every chunk notification),
    used as an index or handed to SGLang are refused with the field named; the room
    stays unclaimed and its prefill sender never sees a bare ``struct.error``."""
    srv = ranks.server()  # type: ignore[attr-defined]
    prefill = ranks("prefill", srv.port)
    decode = ranks("decode")
    cases = [("nonce", 2 ** 32, "nonce must be an integer in [0, 4294967295]"),
             ("nonce", -1, "nonce must be an integer in [0, 4294967295]"),
             ("aux_index", -2, "aux_index must be an integer in [-1, 2147483647]"),
             ("aux_index", 2 ** 31, "aux_index must be an integer in [-1, 2147483647]"),
             ("decode_prefix_len", -1, "decode_prefix_len must be an integer in [0, "),
             ("decode_prefix_len", 2 ** 31, "decode_prefix_len must be an integer in [0, "),
             ("decode_endpoint", "", "decode_endpoint must be a tcp://... endpoint"),
             ("decode_endpoint", "tcp://" + "x" * 600, "of 1 to 512 characters"),
             ("decode_channel", "ipc:///tmp/chan", "decode_channel must be a tcp://"),
             ("decode_name", "", "decode_name must be a name"),
             ("kv_pages", b"\x01\x00\x00", "kv_pages must be little-endian int32")]
    for room, (field, value, text) in enumerate(cases, start=100):
        msg, entry = hostile_request(decode, srv, room, **{field: value})
        with pytest.raises(RemoteError, match=text.replace("[", r"\[").replace(".", r"\.")):
            decode.request_room(entry, msg)
        assert prefill.send_room(room) is None, field
        decode.forget_recv_room(room)
    sender = te.TransferEngineKVSender(prefill, f"127.0.0.1:{srv.port}", 100)
    assert sender.poll() == sg.base.KVPoll.Bootstrapping  # unclaimed, not broken
    sender.clear()


def test_the_largest_nonce_moves_a_room_end_to_end(
        sg: sw.SGLang, te: Any, ranks: Callable[..., Any]) -> None:
    from transfer_engine.connectors.sglang.rooms import MAX_NONCE, note_payload

    KVPoll = sg.base.KVPoll
    srv = ranks.server()  # type: ignore[attr-defined]
    prefill = ranks("prefill", srv.port)
    decode = ranks("decode")
    addr = f"127.0.0.1:{srv.port}"
    sender = te.TransferEngineKVSender(prefill, addr, 8)
    entry = decode.prefill_info(addr)
    recv = decode.open_recv_room(8, entry)
    recv.nonce = MAX_NONCE
    decode.request_room(entry, decode.room_request(recv, np.array([4, 5], dtype=np.int32),
                                                   -1, 0))
    assert poll_until(sender, {KVPoll.WaitingForInput}) == KVPoll.WaitingForInput
    sender.init(2, None)
    sender.send(np.array([1, 2], dtype=np.int32))
    assert poll_until(sender, {KVPoll.Success, KVPoll.Failed}) == KVPoll.Success
    assert wait_for(lambda: recv.complete, 10.0)
    sender.clear()
    with pytest.raises(ProtocolError, match="does not fit"):
        note_payload(8, MAX_NONCE + 1, 0, 1)


# --- room requests: connecting to decode off the side channel's thread ----------------


def test_a_silent_decode_endpoint_holds_up_neither_pings_nor_other_rooms(
        sg: sw.SGLang, te: Any, ranks: Callable[..., Any], tarpit: str,
        send: Callable[[str, Message], Message]) -> None:
    from transfer_engine.connectors.sglang.messages import Ping

    KVPoll = sg.base.KVPoll
    srv = ranks.server()  # type: ignore[attr-defined]
    prefill = ranks("prefill", srv.port, **SLOW_CONNECT)
    decode = ranks("decode")
    hostile = ranks("decode")
    addr = f"127.0.0.1:{srv.port}"
    msg, entry = hostile_request(hostile, srv, 1000, decode_endpoint=tarpit)
    hostile.request_room(entry, msg)  # acknowledged: the connect runs in the background
    assert isinstance(send(prefill._channel.endpoint, Ping()), Ack)
    stuck = prefill.send_room(1000)
    assert stuck.peer is None and stuck.error is None  # still connecting, after the ping
    sender = te.TransferEngineKVSender(prefill, addr, 7)
    receiver = te.TransferEngineKVReceiver(decode, addr, 7)
    receiver.init(0)
    receiver.send_metadata(np.array([3], dtype=np.int32))
    assert poll_until(sender, {KVPoll.WaitingForInput}) == KVPoll.WaitingForInput
    assert stuck.peer is None and stuck.error is None  # the healthy room did not wait
    assert receiver.poll() == KVPoll.WaitingForInput  # pings answered all along
    sender.init(1, None)
    sender.send(np.array([9], dtype=np.int32))
    assert poll_until(sender, {KVPoll.Success, KVPoll.Failed}) == KVPoll.Success
    assert poll_until(receiver, {KVPoll.Success, KVPoll.Failed}) == KVPoll.Success
    # the silent endpoint fails its own room only, precisely, on both sides
    victim = te.TransferEngineKVSender(prefill, addr, 1000)
    assert poll_until(victim, {KVPoll.Failed}, timeout=20) == KVPoll.Failed
    err = failure(victim)
    assert isinstance(err, TransferTimeout), err
    assert "bootstrap room 1000" in str(err) and tarpit in str(err)
    told = wait_for(lambda: hostile.recv_room(1000).error)
    assert isinstance(told, RemoteError) and "prefill failed the room" in str(told)
    for conn in (sender, receiver):
        conn.clear()


def test_connects_under_way_are_bounded_per_decode_and_in_all(
        te: Any, ranks: Callable[..., Any], tarpit: str,
        send: Callable[[str, Message], Message], monkeypatch: pytest.MonkeyPatch) -> None:
    from transfer_engine.connectors.sglang import room_claims
    from transfer_engine.connectors.sglang.messages import Ping, RoomRequest

    monkeypatch.setattr(room_claims, "MAX_CONNECTS", 3)
    monkeypatch.setattr(room_claims, "MAX_CONNECTS_PER_PEER", 2)
    srv = ranks.server()  # type: ignore[attr-defined]
    prefill = ranks("prefill", srv.port, **SLOW_CONNECT)
    chan = prefill._channel.endpoint

    def request(room: int, name: str, epoch: int) -> Message:
        return send(chan, RoomRequest(room, 0, name, tarpit, "tcp://127.0.0.1:9", epoch,
                                      b"\x01\x00\x00\x00", -1, 0, room,
                                      compat_hash=prefill.compat_hash))

    assert isinstance(request(1, "a", 1), Ack)
    assert isinstance(request(2, "a", 2), Ack)
    assert isinstance(request(3, "a", 1), Ack)  # shares the connect of room 1
    with pytest.raises(RemoteError, match="2 connects to decode 'a' are under way"):
        request(4, "a", 3)
    assert isinstance(request(5, "b", 1), Ack)
    with pytest.raises(RemoteError, match="3 decode engines are being connected already"):
        request(6, "c", 1)
    assert isinstance(send(chan, Ping()), Ack)
    assert prefill.send_room(4) is None and prefill.send_room(6) is None
    for room in (1, 2, 3, 5):
        claim = prefill.send_room(room)
        assert wait_for(partial(getattr, claim, "error"), 20.0), room
    assert isinstance(request(6, "c", 1), Ack)  # the slots are free again


def test_a_failed_connect_fails_only_its_room(
        sg: sw.SGLang, te: Any, ranks: Callable[..., Any]) -> None:
    KVPoll = sg.base.KVPoll
    srv = ranks.server()  # type: ignore[attr-defined]
    prefill = ranks("prefill", srv.port)
    decode = ranks("decode")
    hostile = ranks("decode")
    addr = f"127.0.0.1:{srv.port}"
    nowhere = f"tcp://127.0.0.1:{free_port()}"  # nobody listens
    msg, entry = hostile_request(hostile, srv, 21, decode_endpoint=nowhere)
    hostile.request_room(entry, msg)
    msg, entry = hostile_request(hostile, srv, 22, decode_name="impostor",
                                 decode_endpoint=decode.engine.endpoint)
    hostile.request_room(entry, msg)
    good = te.TransferEngineKVSender(prefill, addr, 23)
    receiver = te.TransferEngineKVReceiver(decode, addr, 23)
    receiver.init(0)
    receiver.send_metadata(np.array([2, 3], dtype=np.int32), 1)
    expected = [(21, ConnectError, f"cannot reach {nowhere}"),
                (22, ProtocolError, "the request named 'impostor'")]
    for room, kind, text in expected:
        sender = te.TransferEngineKVSender(prefill, addr, room)
        assert poll_until(sender, {KVPoll.Failed}) == KVPoll.Failed
        err = failure(sender)
        assert isinstance(err, kind) and text in str(err), err
        recv = hostile.recv_room(room)
        told = wait_for(partial(getattr, recv, "error"))
        assert text in str(told)
    assert poll_until(good, {KVPoll.WaitingForInput}) == KVPoll.WaitingForInput
    good.init(2, 0)
    good.send(np.array([5, 6], dtype=np.int32))
    assert poll_until(good, {KVPoll.Success, KVPoll.Failed}) == KVPoll.Success
    assert poll_until(receiver, {KVPoll.Success, KVPoll.Failed}) == KVPoll.Success
    for conn in (good, receiver):
        conn.clear()


def test_pages_outside_decode_buffers_are_refused_connected_or_not(
        sg: sw.SGLang, te: Any, ranks: Callable[..., Any]) -> None:
    """First contact is checked once decode's engine is connected (decode is told);
    later rooms of the connected decode are refused with the request itself."""
    KVPoll = sg.base.KVPoll
    srv = ranks.server()  # type: ignore[attr-defined]
    ranks("prefill", srv.port)
    decode = ranks("decode")
    addr = f"127.0.0.1:{srv.port}"
    cases = ((41, [1, 99], None, "prefill failed the room: room 41: kv index 99"),
             (42, [1], 50, "refused sglang/room: room 42: aux index 50"),
             (43, [2 ** 31 - 1], None, "refused sglang/room: room 43: kv index 2147483647"))
    for room, pages, aux, text in cases:
        receiver = te.TransferEngineKVReceiver(decode, addr, room)
        receiver.init(0)
        receiver.send_metadata(np.array(pages, dtype=np.int64), aux)
        assert poll_until(receiver, {KVPoll.Failed}) == KVPoll.Failed
        err = failure(receiver)
        assert isinstance(err, RemoteError) and text in str(err), err
        assert "is out of range [0, " in str(err)


# --- decode_prefix_len ----------------------------------------------------------------


def test_decode_prefix_len_reaches_sglang_only_when_it_fits(
        sg: sw.SGLang, te: Any, ranks: Callable[..., Any]) -> None:
    KVPoll = sg.base.KVPoll
    srv = ranks.server()  # type: ignore[attr-defined]
    prefill = ranks("prefill", srv.port)
    decode = ranks("decode")
    addr = f"127.0.0.1:{srv.port}"
    sender = te.TransferEngineKVSender(prefill, addr, 51)
    receiver = te.TransferEngineKVReceiver(decode, addr, 51)
    receiver.init(0)
    receiver.send_metadata(np.array([4, 5], dtype=np.int32), decode_prefix_len=32)
    assert poll_until(sender, {KVPoll.WaitingForInput}) == KVPoll.WaitingForInput
    assert sender.pop_decode_prefix_len() == 32
    assert sender.pop_decode_prefix_len() == 0  # once
    # SGLang computes the pages to send from the prompt past that prefix: a count that
    # is not decode's means the prefix does not fit the prompt
    sender.init(5, None)
    assert sender.poll() == KVPoll.Failed
    err = failure(sender)
    assert isinstance(err, ProtocolError)
    assert "decode allocated 2 pages past the 32 tokens it holds" in str(err)
    assert poll_until(receiver, {KVPoll.Failed}) == KVPoll.Failed
    assert "prefill announced 5" in str(failure(receiver))


# --- room statuses --------------------------------------------------------------------


def test_room_status_with_a_bad_chunk_count_is_refused(
        te: Any, ranks: Callable[..., Any], send: Callable[[str, Message], Message]) -> None:
    from transfer_engine.connectors.sglang.messages import RoomStatus

    srv = ranks.server()  # type: ignore[attr-defined]
    ranks("prefill", srv.port)
    decode = ranks("decode")
    entry = decode.prefill_info(f"127.0.0.1:{srv.port}")
    recv = decode.open_recv_room(61, entry)
    for chunks in (-1, 2 ** 32):
        with pytest.raises(RemoteError, match=r"chunks must lie in \[0, 2\*\*32\)"):
            send(decode._channel.endpoint, RoomStatus(61, recv.nonce, True, "", chunks))
    assert recv.total is None and not recv.complete


# --- bootstrap server -----------------------------------------------------------------


def test_bootstrap_server_keeps_only_bounded_registrations(
        te: Any, send: Callable[[str, Message], Message]) -> None:
    from transfer_engine.connectors.sglang import bootstrap
    from transfer_engine.connectors.sglang.messages import (
        PrefillInfo,
        PrefillLookup,
        PrefillRegister,
    )

    ep = "tcp://127.0.0.1:1"
    compat = {"page_size": 16, "kv_item_lens": [4096] * 64, "nested": {"a": [1, "b"]}}
    with te.TransferEngineKVBootstrapServer("127.0.0.1", 0) as srv:
        at = f"tcp://127.0.0.1:{srv.port}"

        def register(rank: int, **fields: Any) -> Message:
            return send(at, PrefillRegister(**{"rank": rank, "engine_name": f"e{rank}",
                                               "engine_endpoint": ep, "channel": ep,
                                               "compat": compat, **fields}))

        refused: list[tuple[dict[str, Any], str]] = [
            ({"rank": bootstrap.MAX_RANKS}, "registration needs a rank in [0, 4096), got"),
            ({"rank": 2 ** 40}, "registration needs a rank in [0, 4096), got"),
            ({"rank": -1}, "registration needs a rank in [0, 4096), got -1"),
            ({"compat": {"k": "x" * (8 << 10)}}, "compat factors of 8"),
            ({"engine_name": ""}, "engine_name must have 1 to 256 characters, not 0"),
            ({"channel": "tcp://" + "x" * 300}, "channel must have 1 to 256 characters"),
            ({"engine_endpoint": ""}, "engine_endpoint must have 1 to 256"),
            ({"version": 99}, "speaks backend version 99"),
        ]
        for fields, text in refused:
            rank = fields.pop("rank", 0)
            with pytest.raises(RemoteError) as refusal:
                register(rank, **fields)
            assert text in str(refusal.value), (fields, refusal.value)
        assert srv.ranks == []
        for rank in [*range(20), bootstrap.MAX_RANKS - 1]:
            assert isinstance(register(rank), Ack)
        assert isinstance(register(3, engine_name="again"), Ack)  # replaces, not adds
        assert srv.ranks == [*range(20), bootstrap.MAX_RANKS - 1]
        info = send(at, PrefillLookup(3))
        assert isinstance(info, PrefillInfo)
        assert (info.engine_name, info.compat) == ("again", compat)
        with pytest.raises(RemoteError, match=r"registered ranks: \[0, 1, .*15\] and 5 "
                                              "more"):
            send(at, PrefillLookup(77))
