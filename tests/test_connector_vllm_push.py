"""Layer-wise push through the vLLM connector's workers: prefill WRITEs each layer into a
room in its lane of decode's staging memory, decode copies the room into its blocks
with no READ; a room that is not whole, not this request's, reused, forged or expired
is never copied, and decode reads the blocks instead. Workers in this process, real
engines on loopback, KV caches as CPU torch tensors (vLLM's CPU layout, and its GPU
one in host memory)."""

from __future__ import annotations

import os
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tests.helpers.clock import FakeClock
from tests.helpers.vllm_required import vllm_torch

with warnings.catch_warnings():  # vLLM and torch warn at import; not our concern here
    warnings.simplefilter("ignore")
    torch = vllm_torch()

    import numpy as np

    from tests.helpers.vllm_workers import (
        COMPAT,
        NUM_BLOCKS,
        block_of,
        cpu_caches,
        gpu_caches,
        wait_results,
        worker_pair,
    )
    from transfer_engine.connectors.vllm import RecvSpec, TEConnectorConfig, TEConnectorWorker
    from transfer_engine.connectors.vllm.metadata import PushSpec
    from transfer_engine.connectors.vllm.push import PUSH_SEGMENT, push_note
    from transfer_engine.descriptor import Descriptor
    from transfer_engine.engine import Engine

pytestmark = pytest.mark.filterwarnings(
    "ignore::DeprecationWarning", "ignore::FutureWarning")

HASH = "ab" * 16
TOKENS = 40  # three blocks of 16


def _until(what: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not what():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


@pytest.fixture(params=["cpu"])
def pair(request: pytest.FixtureRequest) -> Iterator[
        tuple[TEConnectorWorker, TEConnectorWorker, dict[str, Any], dict[str, Any]]]:
    """Prefill and decode workers; KV in vLLM's CPU layout (``gpu``: its GPU layout,
    K and V planes apart, in host memory)."""
    with worker_pair(FakeClock(), gpu_caches if request.param == "gpu" else cpu_caches,
                     push_mib=8) as pair:
        yield pair


@pytest.fixture
def second_prefill() -> Iterator[tuple[TEConnectorWorker, dict[str, Any]]]:
    """Another prefill worker (taking no pushes itself) and its KV caches."""
    cfg = TEConnectorConfig(transports=("tcp",), timeout_s=2.0)
    second = TEConnectorWorker("push-p2", cfg, COMPAT, FakeClock(), takes_push=False)
    sk = cpu_caches(5)
    try:
        second.register_kv_caches(sk, NUM_BLOCKS)
        yield second, sk
    finally:
        second.close()


def _room(n: int = 0) -> str:
    return f"room-{n:04d}-{os.urandom(8).hex()}"


def _push(prefill: TEConnectorWorker, decode: TEConnectorWorker, room: str,
          rid: str = "p1", blocks: tuple[int, ...] = (3, 4, 5), layers: int | None = None,
          lease_s: float = 30.0) -> PushSpec:
    """Prefill's side of a step that prefills ``rid`` whole: the ask, the forward's
    layers (all, or the first ``layers``), its end (only when all were computed)."""
    assert decode.engine is not None
    spec = PushSpec(rid, room, (decode.engine.endpoint,), list(blocks), TOKENS, HASH,
                    lease_s)
    prefill.start_push([spec])
    names = sorted(prefill.layouts)
    for name in names[:layers]:
        prefill.layer_saved(name)
    if layers is None:
        prefill.finish_layered()
    return spec


def _load(prefill: TEConnectorWorker, room: str, local: list[int], remote: list[int],
          first: int = 0, digest: str = HASH, rid: str = "p1") -> RecvSpec:
    assert prefill.engine is not None
    return RecvSpec("d-" + rid, local, remote, prefill.engine.endpoint, "prefill-engine",
                    rid, time.time() + 30, sync=True, room=room, prompt_hash=digest,
                    num_tokens=TOKENS, room_blocks=3, first_block=first)


def _same(pk: dict[str, Any], dk: dict[str, Any], local: list[int],
          remote: list[int]) -> bool:
    return all(torch.equal(block_of(dk[n], a), block_of(pk[n], b)) for n in pk
               for a, b in zip(local, remote, strict=True))


@pytest.mark.parametrize("pair", ["cpu", "gpu"], indirect=True)
def test_pushed_layers_are_copied_into_decode_blocks_without_a_read(pair: Any) -> None:
    """The whole flow: a lane asked for and granted, one WRITE per layer as the
    forward computes it, then decode's load copies the room into its blocks byte for
    byte, reads nothing from prefill, and tells prefill it may free the blocks; prefill
    may write the room's range again."""
    prefill, decode, pk, dk = pair
    room = _room()
    prefill.hold({"p1": 30.0})
    _push(prefill, decode, room)
    assert decode.staging is not None
    _until(lambda: decode.staging.whole(room))
    assert prefill.stats["push_bytes"] == 3 * 3 * block_of(dk["layers.0.attn"], 0).nbytes
    assert not _same(pk, dk, [10, 11, 12], [3, 4, 5])
    decode.load_now([_load(prefill, room, [10, 11, 12], [3, 4, 5])])
    assert decode.take_failed_blocks() == set()
    assert _same(pk, dk, [10, 11, 12], [3, 4, 5])
    assert decode.stats["recv_pushed"] == 1
    assert decode.engine is not None and decode.engine.stats.get("read_bytes", 0) < 4096
    wait_results(prefill, "finished_sending", "p1")
    assert len(decode.staging) == 0
    assert prefill._push is not None and prefill._push.pusher is not None
    _until(lambda: len(prefill._push.pusher) == 0)  # the range is free again
    room2 = _room(2)  # a second push goes straight into the lane
    _push(prefill, decode, room2, rid="p2")
    _until(lambda: decode.staging.whole(room2))


def test_a_load_past_cached_blocks_copies_from_its_place_in_the_room(pair: Any) -> None:
    """Decode had the first block cached: it copies the room's blocks 1 and 2 only."""
    prefill, decode, pk, dk = pair
    room = _room()
    _push(prefill, decode, room)
    _until(lambda: decode.staging.whole(room))
    before = block_of(dk["layers.0.attn"], 20).clone()
    decode.load_now([_load(prefill, room, [21, 22], [4, 5], first=1)])
    assert _same(pk, dk, [21, 22], [4, 5]) and decode.stats["recv_pushed"] == 1
    assert torch.equal(block_of(dk["layers.0.attn"], 20), before)


@pytest.mark.parametrize("case", ["other prompt", "unknown room", "other endpoint"])
def test_a_room_that_is_not_this_requests_is_not_copied(pair: Any, case: str) -> None:
    """A load naming a room that holds another prompt, no room at all, or a room of
    another prefill: decode reads the blocks from prefill instead, byte-exact."""
    prefill, decode, pk, dk = pair
    room = _room()
    _push(prefill, decode, room)
    _until(lambda: decode.staging.whole(room))
    spec = _load(prefill, room, [30, 31, 32], [3, 4, 5],
                 digest="cd" * 16 if case == "other prompt" else HASH)
    if case == "unknown room":
        spec.room = _room(1)
    if case == "other endpoint":  # nothing listens there: the load fails, recomputed
        spec.remote_endpoint = spec.remote_endpoint.replace("127.0.0.1", "127.0.0.2")
        decode.load_now([spec])
        assert decode.take_failed_blocks() == {30, 31, 32}
        assert decode.stats["recv_pushed"] == 0 and decode.staging.whole(room)
        return
    decode.load_now([spec])
    assert decode.take_failed_blocks() == set()
    assert _same(pk, dk, [30, 31, 32], [3, 4, 5]) and decode.stats["recv_pushed"] == 0
    assert decode.staging.whole(room)  # still there for its own request


def test_a_room_is_copied_once(pair: Any) -> None:
    """A second request naming the same room (a replay, or another client that learnt
    the id) finds it gone and reads from prefill."""
    prefill, decode, pk, dk = pair
    room = _room()
    _push(prefill, decode, room)
    _until(lambda: decode.staging.whole(room))
    decode.load_now([_load(prefill, room, [10, 11, 12], [3, 4, 5])])
    dk["layers.0.attn"][40:43] = 0
    decode.load_now([_load(prefill, room, [40, 41, 42], [3, 4, 5])])
    assert decode.stats["recv_pushed"] == 1
    assert _same(pk, dk, [40, 41, 42], [3, 4, 5])


def test_a_room_not_whole_is_abandoned_and_freed_when_its_push_lands(pair: Any) -> None:
    """The load comes while the push is still landing (one layer of three in): decode
    waits a little, then reads from prefill; the room is never copied, and prefill
    writes its range again only once the rest of its push has ended."""
    prefill, decode, pk, dk = pair
    room = _room()
    _push(prefill, decode, room, layers=0)
    assert prefill._push is not None and prefill._push.pusher is not None
    _until(lambda: prefill._push.pusher._pushes["p1"].offset is not None)
    prefill.layer_saved(sorted(prefill.layouts)[0])
    _until(lambda: room in decode.staging._rooms
           and len(decode.staging._rooms[room].landed) == 1)
    decode.load_now([_load(prefill, room, [10, 11, 12], [3, 4, 5])])
    assert _same(pk, dk, [10, 11, 12], [3, 4, 5]) and decode.stats["recv_pushed"] == 0
    assert len(decode.staging) == 1  # abandoned, its push still landing
    prefill._push.read("p1")  # decode's word, before the push has ended
    assert len(prefill._push.pusher) == 1
    for name in sorted(prefill.layouts)[1:]:
        prefill.layer_saved(name)
    prefill.finish_layered()
    _until(lambda: len(decode.staging) == 0)
    _until(lambda: prefill._push.pusher.reap() or len(prefill._push.pusher) == 0)


def test_no_write_after_the_lease_runs_out(pair: Any) -> None:
    """A lease too short to push in: prefill starts no WRITE, the room never becomes
    whole, and decode reads from prefill."""
    prefill, decode, pk, dk = pair
    room = _room()
    _push(prefill, decode, room, lease_s=0.001)
    _until(lambda: prefill.stats["push_failed"] == 1)
    assert prefill.stats["push_bytes"] == 0 and not decode.staging.whole(room)
    decode.load_now([_load(prefill, room, [10, 11, 12], [3, 4, 5])])
    assert _same(pk, dk, [10, 11, 12], [3, 4, 5]) and decode.stats["recv_pushed"] == 0


def test_decode_without_staging_takes_no_push(pair: Any) -> None:
    """A decode worker with ``push_mib: 0`` publishes no room segment: prefill gives
    the push up at once and decode reads."""
    prefill, _, pk, _ = pair
    cfg = TEConnectorConfig(transports=("tcp",), timeout_s=2.0, push_mib=0)
    decode = TEConnectorWorker("push-d0", cfg, COMPAT, FakeClock())
    dk = cpu_caches(3)
    try:
        decode.register_kv_caches(dk, NUM_BLOCKS)
        assert decode.staging is None
        _push(prefill, decode, _room())
        _until(lambda: prefill.stats["push_failed"] == 1)
        assert prefill.stats["push_bytes"] == 0
    finally:
        decode.close()


def test_a_decode_worker_out_of_lanes_refuses_and_is_read(
        pair: Any, second_prefill: tuple[TEConnectorWorker, dict[str, Any]]) -> None:
    """Decode's staging holds one lane (8 MiB here), taken by the first prefill worker:
    a second one is refused its lane, its pushes end at once, and decode reads its
    blocks byte-exact; the first keeps pushing."""
    prefill, decode, pk, dk = pair
    second, sk = second_prefill
    room = _room()
    _push(prefill, decode, room)
    _until(lambda: decode.staging.whole(room))
    other = _room(1)
    _push(second, decode, other, rid="s1")
    _until(lambda: second.stats["push_failed"] == 1)
    assert decode.stats["push_refused"] == 1 and second.stats["push_bytes"] == 0
    decode.load_now([_load(second, other, [50, 51, 52], [3, 4, 5], rid="s1")])
    assert _same(sk, dk, [50, 51, 52], [3, 4, 5]) and decode.stats["recv_pushed"] == 0
    decode.load_now([_load(prefill, room, [10, 11, 12], [3, 4, 5])])
    assert _same(pk, dk, [10, 11, 12], [3, 4, 5]) and decode.stats["recv_pushed"] == 1


def test_an_idle_lane_is_taken_back_and_its_old_owner_asks_afresh(
        pair: Any, second_prefill: tuple[TEConnectorWorker, dict[str, Any]],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """One lane, two prefill workers. Once the first worker's lane is idle (here: at
    once) and holds no room, the second is granted it as a new segment: the first
    worker's next WRITE into its old lane fails at decode (the segment is closed) and
    lands nothing, decode reads that request byte-exact, and the first worker asks
    again at its next push, taking the lane back the same way. Every room copied is
    the right one."""
    from transfer_engine.connectors.vllm import push as push_module
    monkeypatch.setattr(push_module, "LANE_RETRY_S", 0.0)
    prefill, decode, pk, dk = pair
    assert decode.staging is not None and decode.engine is not None
    decode.staging.lane_idle_s = 0.0
    second, sk = second_prefill
    first = _room()
    _push(prefill, decode, first)
    _until(lambda: decode.staging.whole(first))
    old = decode.staging.lanes()[prefill.engine.name][0]
    other = _room(1)  # the first's room is held: the lane is not idle yet
    _push(second, decode, other, rid="s1")
    _until(lambda: second.stats["push_failed"] == 1)
    decode.load_now([_load(prefill, first, [10, 11, 12], [3, 4, 5])])
    assert _same(pk, dk, [10, 11, 12], [3, 4, 5]) and decode.stats["recv_pushed"] == 1

    taken = _room(2)  # now idle: the second worker takes the lane
    _push(second, decode, taken, rid="s2")
    _until(lambda: decode.staging.whole(taken))
    lanes = decode.staging.lanes()
    assert list(lanes) == [second.engine.name] and lanes[second.engine.name][0] != old
    assert old not in decode.engine.segments and decode.staging.revoked == 1

    stale = _room(3)  # the first worker still writes into its old lane: refused
    _push(prefill, decode, stale, rid="p2")
    pusher = prefill._push.pusher
    _until(lambda: pusher.reap() or decode.engine.endpoint not in pusher._lanes)
    assert not decode.staging.whole(stale)
    assert decode.staging.whole(taken)  # the second's room is untouched
    decode.load_now([_load(second, taken, [50, 51, 52], [3, 4, 5], rid="s2")])
    assert _same(sk, dk, [50, 51, 52], [3, 4, 5]) and decode.stats["recv_pushed"] == 2
    decode.load_now([_load(prefill, stale, [20, 21, 22], [3, 4, 5], rid="p2")])
    assert _same(pk, dk, [20, 21, 22], [3, 4, 5]) and decode.stats["recv_pushed"] == 2

    again = _room(4)  # the first asks afresh and takes the idle lane back
    _push(prefill, decode, again, rid="p3", blocks=(6, 7, 8))
    _until(lambda: decode.staging.whole(again))
    assert list(decode.staging.lanes()) == [prefill.engine.name]
    decode.load_now([_load(prefill, again, [30, 31, 32], [6, 7, 8], rid="p3")])
    assert _same(pk, dk, [30, 31, 32], [6, 7, 8]) and decode.stats["recv_pushed"] == 3


def test_a_second_ask_revokes_the_askers_old_lane(pair: Any) -> None:
    """A worker asks only after dropping its lane: decode grants a fresh segment and
    closes the old one, with the rooms in it."""
    prefill, decode, _, _ = pair
    assert decode.staging is not None and prefill.engine is not None
    room = _room()
    _push(prefill, decode, room)
    _until(lambda: decode.staging.whole(room))
    name, length = decode.staging.lanes()[prefill.engine.name]
    fresh, fresh_length = decode.staging.lane(prefill.engine.name)
    assert fresh != name and fresh_length == length
    assert name not in decode.engine.segments and fresh in decode.engine.segments
    assert not decode.staging.whole(room) and len(decode.staging) == 0


def _stranger(decode: TEConnectorWorker) -> tuple[Engine, Any, Any]:
    """An engine of the cluster (it holds the secret) that is no prefill worker."""
    assert decode.engine is not None
    eng = Engine("stranger", transports=("tcp",))
    peer = eng.connect(decode.engine.endpoint, timeout=2.0)
    scratch = eng.register(np.zeros(8, dtype=np.uint8), name="s")
    return eng, peer, scratch


def _note(eng: Engine, peer: Any, scratch: Any, payload: bytes) -> None:
    eng.read(peer, [(Descriptor(scratch, 0, 1), Descriptor(peer.segment(PUSH_SEGMENT), 0,
                                                           1))], notify=payload).wait(2.0)


def test_forged_asks_and_notes_are_refused(pair: Any) -> None:
    """Another engine of the cluster sends malformed notes, asks for a lane naming
    prefill's endpoint as its own, and writes a 'layers' note for the real room with no
    lane of its own; prefill itself reuses a room id for another prompt: each is
    refused or ignored, and the real push still lands and is copied once."""
    prefill, decode, pk, dk = pair
    room = _room()
    eng, peer, scratch = _stranger(decode)
    try:
        assert prefill.engine is not None and decode.staging is not None
        for payload in (b"te-vllm/push:\xc1", push_note("ask-lane"),
                        push_note("ask-lane", endpoint=7), push_note("nonsense")):
            _note(eng, peer, scratch, payload)
        # an impostor's lane ask naming prefill's endpoint: the engine there is not it
        _note(eng, peer, scratch, push_note("ask-lane", endpoint=prefill.engine.endpoint))
        _until(lambda: decode.stats["push_refused"] == 1)
        _push(prefill, decode, room)
        _until(lambda: decode.staging.whole(room))
        fields = dict(room=room, offset=0, blocks=3, tokens=TOKENS, prompt_hash=HASH,
                      lease_s=30, layers=[0, 1, 2])
        _note(eng, peer, scratch, push_note("layers", **fields))
        _until(lambda: decode.staging.refused == 1)  # no lane of its own
        # prefill's own note for that room id with another prompt: refused
        pnote = decode.staging._rooms[room]
        with pytest.raises(ValueError, match="another room"):  # offset: in its lane
            decode.staging.landed(pnote.peer, dict(fields, prompt_hash="cd" * 16))
        decode.load_now([_load(prefill, room, [10, 11, 12], [3, 4, 5])])
        assert _same(pk, dk, [10, 11, 12], [3, 4, 5]) and decode.stats["recv_pushed"] == 1
    finally:
        eng.close()


def test_ranges_are_first_fit_and_merge_when_given_back() -> None:
    from transfer_engine.connectors.vllm.rooms import ALIGN, Ranges

    r = Ranges(0, 4 * ALIGN)
    a, b = r.take(ALIGN), r.take(2 * ALIGN - 1)  # rounded up to whole pages
    assert (a, b) == (0, ALIGN) and r.take(2 * ALIGN) is None
    r.give(a, ALIGN)
    r.give(b, 2 * ALIGN)
    assert r.take(4 * ALIGN) == 0


@pytest.mark.parametrize("push", [
    "x", {"room": "short", "to": ["tcp://127.0.0.1:1"]},
    {"room": "r" * 20, "to": []}, {"room": "r" * 20, "to": ["http://a:1"]},
    {"room": "r" * 20, "to": ["tcp://a:1"] * 65}, {"room": 5, "to": ["tcp://a:1"]}])
def test_push_params_from_a_client_are_checked(push: Any) -> None:
    """A client names the room and decode's workers: anything malformed is refused
    (prefill then pushes nothing), as is a malformed room id in decode's params."""
    from transfer_engine.connectors.vllm.config import PROTOCOL_VERSION
    from transfer_engine.connectors.vllm.metadata import (
        parse_push_params,
        parse_remote_params,
        prompt_hash,
    )

    with pytest.raises(ValueError):
        parse_push_params({"push": push})
    assert parse_push_params({"push": {"room": "r" * 20, "to": ["tcp://a:1"]}}) == (
        "r" * 20, ("tcp://a:1",))
    prompt = list(range(40))
    good = {"protocol_version": PROTOCOL_VERSION, "remote_endpoint": "tcp://a:1",
            "remote_request_id": "x", "remote_block_ids": [1, 2, 3],
            "remote_num_tokens": 40, "lease_expiry": time.time() + 10,
            "prompt_hash": prompt_hash(prompt, 40)}
    assert parse_remote_params(dict(good, push_room="r" * 20), prompt, 16,
                               time.time()).room == "r" * 20
    for bad in ("short", 7, "r" * 200):
        with pytest.raises(ValueError, match="push_room"):
            parse_remote_params(dict(good, push_room=bad), prompt, 16, time.time())
