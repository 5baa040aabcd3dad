"""A peer's handshake metadata is checked once, field by field: a control endpoint
written by hand that answers Hello with metadata of the wrong shape gets a precise
``ProtocolError`` (or the refusal of its rail), never a crash, a hang or a peer."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
import zmq

from transfer_engine import Engine
from transfer_engine.control.auth import seal
from transfer_engine.control.messages import Welcome
from transfer_engine.errors import ProtocolError
from transfer_engine.peer import PeerInfo


@pytest.fixture
def answering() -> Iterator[Any]:
    """Starts a ROUTER on loopback that answers every request with Welcome(meta)."""
    stops: list[tuple[threading.Event, threading.Thread]] = []
    ctx: zmq.Context[Any] = zmq.Context()

    def start(meta: Any) -> str:
        sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        port = sock.bind_to_random_port("tcp://127.0.0.1")
        stop = threading.Event()

        def serve() -> None:
            try:
                for _ in range(1000):  # bounded: at most 100 s
                    if stop.is_set():
                        return
                    if sock.poll(100):
                        ident, _ = sock.recv_multipart()[-2:]
                        sock.send_multipart([ident, seal(Welcome(meta, {}), None)])
            finally:
                sock.close(0)

        thread = threading.Thread(target=serve, daemon=True)
        thread.start()
        stops.append((stop, thread))
        return f"tcp://127.0.0.1:{port}"

    yield start
    for stop, thread in stops:
        stop.set()
        thread.join(5)
    ctx.term()


@pytest.mark.parametrize(("meta", "says"), [
    ({"name": 5}, "'name' is of type int, not a string"),
    ({"name": ""}, "without a name"),
    ({"name": "n" * 1025}, "without a name of 1 to 1024 characters"),
    ({"name": "x", "transports": "tcp"}, "'transports' is of type str, not a map"),
    ({"name": "x", "transports": {"tcp": 3}}, "transport 'tcp' is not a name with a map"),
    ({"name": "x", "segments": "s"}, "'segments' is of type str, not a list"),
    ({"name": "x", "pid": True}, "'pid' is of type bool, not an integer"),
    ({"name": "x", "host_id": 7}, "'host_id' is of type int, not a string"),
])
def test_malformed_metadata_is_a_precise_protocol_error(answering: Any, meta: Any,
                                                        says: str) -> None:
    with Engine("victim") as engine:
        with pytest.raises(ProtocolError, match=says):
            engine.connect(answering(meta), timeout=5)
        assert not engine.peers


def test_peer_info_reads_an_engines_own_metadata() -> None:
    with Engine("honest") as engine:
        info = PeerInfo.from_wire(engine.metadata())
    assert info.name == "honest" and info.incarnation and info.transports
    assert isinstance(info.pid, int) and info.segments == []
    with pytest.raises(ProtocolError, match="not a map"):
        PeerInfo.from_wire(["name", "x"])


@pytest.mark.parametrize("bad", [
    {"id": 1 << 64, "name": "s", "length": 8}, {"id": -1, "name": "s", "length": 8},
    {"id": 1, "name": "s", "length": -8}, {"id": 1, "name": "s", "length": "8"},
    {"id": True, "name": "s", "length": 8}, {"id": 1, "name": 5, "length": 8},
    {"id": 1, "name": "", "length": 8}, {"id": 1, "name": "s" * 5000, "length": 8},
])
def test_a_segment_no_engine_sends_is_refused(bad: dict[str, Any]) -> None:
    """Ids and lengths past int64 would overflow the planner's columns at the first
    transfer to them (an OverflowError out of ``write``): refused at the handshake."""
    from transfer_engine.segment import RemoteSegment
    with pytest.raises(ValueError, match="segment"):
        RemoteSegment.from_wire("x", bad)
    ok = RemoteSegment.from_wire("x", {"id": 3, "name": "s", "length": (1 << 63) - 1})
    assert (ok.id, ok.length) == (3, (1 << 63) - 1)
