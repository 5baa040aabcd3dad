"""Fuzz: thousands of random, truncated, oversized, wrong-version and badly typed
messages against the registry and an engine's handshake socket. Afterwards a valid
client still works and nothing crashed."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import msgpack
import numpy as np
import pytest
import zmq

from transfer_engine import Engine
from transfer_engine.control.auth import AuthConfig, Signer
from transfer_engine.control.client import RegistryClient
from transfer_engine.control.messages import (
    PROTOCOL_VERSION,
    Heartbeat,
    Hello,
    ListMembers,
    Lookup,
    Register,
    Watch,
    encode,
)
from transfer_engine.control.metastore import MemberRecord
from transfer_engine.control.registry import Registry

SECRET = "fuzz-secret-fuzz-secret"


def fuzz_messages(n: int, seed: int, signer: Signer | None = None) -> list[list[bytes]]:
    """``n`` hostile messages (each a list of frames) of many kinds."""
    rng = np.random.default_rng(seed)
    valid = [encode(m) for m in (
        Register("n", "i", "decode", transports={"tcp": {"port": 1}}), Heartbeat("n", "i"),
        Lookup("n"), ListMembers("decode"), Watch("", -1, 0.0), Hello({"name": "x"}))]
    out: list[list[bytes]] = []
    for i in range(n):
        choice = i % 10
        base = valid[int(rng.integers(len(valid)))]
        if choice == 0:  # random bytes
            data = rng.integers(0, 256, int(rng.integers(0, 600)), dtype=np.uint8).tobytes()
        elif choice == 1:  # truncated valid message
            data = base[:int(rng.integers(0, len(base)))]
        elif choice == 2:  # wrong version
            raw = msgpack.unpackb(base)
            raw["v"] = int(rng.choice([0, PROTOCOL_VERSION + 1, -1, 1 << 40]))
            data = msgpack.packb(raw)
        elif choice == 3:  # oversized for its kind (heartbeat/lookup limit is 4 KiB)
            data = msgpack.packb({"v": PROTOCOL_VERSION, "kind": "heartbeat",
                                  "body": {"name": "x" * 70_000, "incarnation": "i"}})
        elif choice == 4:  # unknown kind / missing body / not a map
            shapes: list[object] = [{"v": PROTOCOL_VERSION, "kind": "nuke"},
                                    {"v": PROTOCOL_VERSION, "kind": "lookup"},
                                    [1, 2, 3], "str", None]
            data = msgpack.packb(shapes[int(rng.integers(len(shapes)))])
        elif choice == 5:  # badly typed fields
            raw = msgpack.unpackb(base)
            bad: list[object] = [None, 1.5, [1], {"a": 1}, True, "sss"]
            for key in raw["body"]:
                raw["body"][key] = bad[int(rng.integers(len(bad)))]
            data = msgpack.packb(raw)
        elif choice == 6:  # valid envelope, hostile member record contents
            data = encode(Register("", "", "emperor", transports={"x": 1}))
        elif choice == 7:  # bit flips in a valid message
            arr = bytearray(base)
            for _ in range(int(rng.integers(1, 4))):
                arr[int(rng.integers(len(arr)))] ^= 1 << int(rng.integers(8))
            data = bytes(arr)
        elif choice == 8:  # a forged signature, or an honest one around garbage
            data = b"TEA1" + rng.integers(0, 256, 60, dtype=np.uint8).tobytes() + base
            if signer is not None and rng.integers(2):
                data = signer.sign(rng.integers(0, 256, 40, dtype=np.uint8).tobytes())
        else:  # several frames
            out.append([base, base])
            continue
        out.append([data])
    return out


def blast(endpoint: str, messages: list[list[bytes]]) -> int:
    """Sends everything over one DEALER (pipelined), returns the number of replies
    received (each rejected message is answered unless libzmq dropped it)."""
    ctx = zmq.Context()
    try:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(endpoint)
        answered = 0
        for i, frames in enumerate(messages):
            sock.send_multipart(frames)
            if i % 200 == 199:  # keep the pipeline bounded
                while sock.poll(0):
                    sock.recv_multipart()
                    answered += 1
        while sock.poll(1000):
            sock.recv_multipart()
            answered += 1
        sock.close()
        return answered
    finally:
        ctx.term()


@pytest.fixture(params=[None, SECRET], ids=["open", "hmac"])
def fuzzed_registry(request: pytest.FixtureRequest) -> Iterator[Registry]:
    with Registry(auth=AuthConfig(request.param) if request.param else None,
                  interval=0.5) as reg:
        yield reg


def test_registry_survives_fuzz(fuzzed_registry: Registry) -> None:
    reg = fuzzed_registry
    assert reg.endpoint is not None
    secret = SECRET if reg.signed else None
    messages = fuzz_messages(3000, 1, AuthConfig(secret).signer() if secret else None)
    answered = blast(reg.endpoint, messages)
    assert answered >= 2900  # a few multi-frame / oversize ones may only be dropped
    assert reg.serving
    # open registry: a bit flip may leave a well-formed registration (it is then valid);
    # with a secret nothing unsigned gets in
    assert all(r.role in ("decode", "prefill", "store", "any") for r in reg.members)
    if secret:
        assert reg.members == []
    assert reg.stats["rejected"] >= 2900 if secret else reg.stats["rejected"] >= 2500
    auth = AuthConfig(secret) if secret else None
    with RegistryClient(reg.endpoint, auth=auth, name="after") as client:
        client.register(MemberRecord("survivor", "i", "store"))
        assert [r.name for r in client.list("store")] == ["survivor"]
        client.leave()


def test_engine_handshake_survives_fuzz(make_engine: Callable[..., Engine]) -> None:
    b = make_engine("b", transports=["tcp"])
    answered = blast(b.endpoint, fuzz_messages(2000, 2))
    assert answered >= 1900
    assert b.stats["control_rejected"] >= 1500
    a = make_engine("a", transports=["tcp"])
    assert a.connect(b.endpoint).name == "b"


def test_oversized_frames_are_dropped_not_fatal() -> None:
    with Registry() as reg:
        assert reg.endpoint is not None
        blast(reg.endpoint, [[b"\x00" * (3 << 20)], [b"\x01" * (1 << 20) + b"x"]])
        with RegistryClient(reg.endpoint) as client:
            assert client.list() == []
