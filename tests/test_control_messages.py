"""Control messages: round trips, and rejection of anything malformed with ProtocolError."""

from __future__ import annotations

import dataclasses
import random
import re
from typing import Any

import msgpack
import pytest

from transfer_engine.control import messages
from transfer_engine.control.messages import (
    MAX_MESSAGE_BYTES,
    PROTOCOL_VERSION,
    Ack,
    Denied,
    ErrorReply,
    Events,
    Heartbeat,
    HeartbeatAck,
    Hello,
    Leave,
    ListMembers,
    Lookup,
    Members,
    Message,
    Register,
    Registered,
    SegmentsReply,
    SegmentsRequest,
    Watch,
    Welcome,
    decode,
    encode,
)
from transfer_engine.errors import ProtocolError

PEER = "tcp://10.0.0.7:5555"
SEGMENT = {"id": 3, "name": "kv-0", "length": 1 << 30, "device": "cuda:1",
           "writable": True, "keys": {"rdma": {"mlx5_0": 77}, "shm": "/te-kv-0"}}
MEMBER = {"name": "decode-1", "role": "decode", "host": "h1", "segments": [SEGMENT]}

SAMPLES: list[Message] = [
    Hello(meta={"name": "prefill-0", "transports": ["tcp", "shm"], "raw": b"\x00\xff",
                "nested": {"a": [1, 2.5, None, True]}}),
    Welcome(meta={"name": "decode-1", "segments": [SEGMENT]}),
    SegmentsRequest(name="kv-0"),
    SegmentsReply(segments=[SEGMENT, {**SEGMENT, "id": 4}]),
    ErrorReply(message="segment kv-9 is deregistered"),
    Denied(reason="bad signature"),
    Register(name="prefill-0", incarnation="9f2c", role="prefill", host="h0", pod="p1",
             zone="az1", control="tcp://h0:4000", transports={"tcp": {"port": 4001}},
             nics=["mlx5_0", {"name": "mlx5_1", "numa": 1}], segments=[SEGMENT]),
    Registered(epoch="e1", interval=0.5, max_missed=4),
    Heartbeat(name="prefill-0", incarnation="9f2c"),
    HeartbeatAck(known=False, epoch="e1"),
    Leave(name="prefill-0", incarnation="9f2c"),
    Lookup(name="decode-1"),
    ListMembers(role="decode"),
    Members(members=[MEMBER]),
    Watch(epoch="e1", since=41, wait=2.0),
    Events(epoch="e1", seq=42, events=[{"seq": 42, "type": "join", "name": "decode-1",
                                        "member": MEMBER, "reason": ""}],
           snapshot=True, members=[MEMBER], complete=False),
    Ack(),
]

KINDS = {cls.kind: cls for cls in Message.__subclasses__()
         if cls.__module__ == messages.__name__}


FIELD_TYPES: dict[str, type | tuple[type, ...]] = {
    "str": str, "int": int, "float": (int, float), "bool": bool,
    "dict[str, Any]": dict, "list[dict[str, Any]]": list, "list[Any]": list,
}


def raw_of(msg: Message) -> dict[str, Any]:
    out: dict[str, Any] = msgpack.unpackb(encode(msg), raw=False)
    return out


def pack(obj: Any) -> bytes:
    data: bytes = msgpack.packb(obj)
    return data


def rejected(data: bytes, match: str = "") -> ProtocolError:
    with pytest.raises(ProtocolError, match=match) as info:
        decode(data, peer=PEER)
    assert info.value.peer == PEER
    return info.value


# --- round trips ---------------------------------------------------------------------


def test_every_kind_has_a_sample() -> None:
    assert {type(m) for m in SAMPLES} == set(KINDS.values())
    assert len(KINDS) == len(SAMPLES)


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda m: m.kind)
def test_round_trip(msg: Message) -> None:
    data = encode(msg)
    assert len(data) <= msg.max_bytes
    back = decode(data, peer=PEER)
    assert type(back) is type(msg) and back == msg
    raw = msgpack.unpackb(data, raw=False)
    assert raw["v"] == PROTOCOL_VERSION and raw["kind"] == msg.kind


@pytest.mark.parametrize("cls", list(KINDS.values()), ids=list(KINDS))
def test_defaults_round_trip(cls: type[Message]) -> None:
    assert decode(encode(cls())) == cls()


def test_float_fields_take_ints() -> None:
    raw = raw_of(Registered())
    raw["body"]["interval"] = 2
    assert decode(pack(raw)) == Registered(interval=2.0)


# --- rejections ----------------------------------------------------------------------


def test_peer_defaults_to_none() -> None:
    with pytest.raises(ProtocolError) as info:
        decode(b"\xc1")
    assert info.value.peer is None


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda m: m.kind)
def test_truncated_and_padded_messages_are_rejected(msg: Message) -> None:
    data = encode(msg)
    step = max(1, len(data) // 200)  # every prefix of short messages, a sample of long
    for cut in range(0, len(data), step):
        rejected(data[:cut], "undecodable|not a map")
    rejected(data + b"\x00", "undecodable")


@pytest.mark.parametrize("version", [None, 0, PROTOCOL_VERSION - 1, PROTOCOL_VERSION + 1,
                                     str(PROTOCOL_VERSION), [PROTOCOL_VERSION],
                                     float(PROTOCOL_VERSION), True, "missing"])
def test_wrong_version_is_rejected(version: Any) -> None:
    raw = raw_of(Lookup(name="x"))
    if version == "missing":
        del raw["v"]
    else:
        raw["v"] = version
    rejected(pack(raw), "protocol version .* not supported")


@pytest.mark.parametrize("kind", ["nope", "", "HELLO", 5, None, 1.5, b"hello", ["lookup"],
                                  {"lookup": 1}, "missing"])
def test_unknown_kind_is_rejected(kind: Any) -> None:
    raw = raw_of(Lookup(name="x"))
    if kind == "missing":
        del raw["kind"]
    else:
        raw["kind"] = kind
    rejected(pack(raw), "unknown message kind")


@pytest.mark.parametrize("top", [[], 5, "hello", None, b"x", [2, "lookup", {}]])
def test_non_map_messages_are_rejected(top: Any) -> None:
    rejected(pack(top), "not a map")


@pytest.mark.parametrize("body", [None, [], "x", 3, "missing"])
def test_body_that_is_not_a_map_is_rejected(body: Any) -> None:
    raw = raw_of(Lookup(name="x"))
    if body == "missing":
        del raw["body"]
    else:
        raw["body"] = body
    rejected(pack(raw), "body is not a map")


def wrong_values(annotation: str) -> list[Any]:
    """Values of the wrong type for a field annotated ``annotation``."""
    return {
        "str": [5, None, b"x", ["x"]],
        "int": ["1", 1.5, True, None],
        "float": ["1", None, [1.0], True, float("nan"), float("inf")],
        "bool": [1, "true", None],
        "dict[str, Any]": [[], "x", None],
        "list[dict[str, Any]]": [{}, "x", None, [1, 2], [{}, "x"]],
        "list[Any]": [{}, "x", 3],
    }[annotation]


def test_missing_and_wrongly_typed_fields_are_rejected() -> None:
    checked = 0
    for msg in SAMPLES:
        raw = raw_of(msg)
        for f in dataclasses.fields(msg):
            missing = {**raw, "body": {k: v for k, v in raw["body"].items() if k != f.name}}
            rejected(pack(missing), re.escape(f"{msg.kind}: missing field '{f.name}'"))
            for value in wrong_values(str(f.type)):
                bad = {**raw, "body": {**raw["body"], f.name: value}}
                rejected(pack(bad), re.escape(f"{msg.kind}: field '{f.name}' has type"))
                checked += 1
    assert checked > 50


def test_extra_fields_are_ignored() -> None:
    raw = raw_of(Lookup(name="x"))
    raw["body"]["future"] = 1
    raw["extra"] = True
    assert decode(pack(raw)) == Lookup(name="x")


def test_oversize_messages_are_rejected() -> None:
    rejected(b"\x00" * (MAX_MESSAGE_BYTES + 1), "exceeds the limit")
    big = pack({"v": PROTOCOL_VERSION, "kind": "hello",
                "body": {"meta": {"x": "y" * MAX_MESSAGE_BYTES}}})
    rejected(big, "exceeds the limit")
    with pytest.raises(ProtocolError, match="exceeds its limit"):
        encode(Hello(meta={"x": "y" * MAX_MESSAGE_BYTES}))
    # fixed-size kinds have a smaller limit, both ways
    assert Heartbeat.max_bytes < MAX_MESSAGE_BYTES
    name = "n" * Heartbeat.max_bytes
    with pytest.raises(ProtocolError, match="heartbeat message of .* exceeds its limit"):
        encode(Heartbeat(name=name))
    rejected(pack({"v": PROTOCOL_VERSION, "kind": "heartbeat",
                   "body": {"name": name, "incarnation": ""}}), "exceeds its limit")


def test_deeply_nested_message_is_rejected() -> None:
    rejected(b"\x91" * 100_000 + b"\xc0", "undecodable")


# --- fuzz ----------------------------------------------------------------------------


def decodes_or_protocol_error(data: bytes) -> Message | None:
    try:
        msg = decode(data, peer=PEER)
    except ProtocolError as exc:
        assert exc.peer == PEER
        return None
    assert isinstance(msg, Message) and type(msg) in KINDS.values()
    return msg


def test_random_bytes_never_raise_anything_but_protocol_error() -> None:
    rng = random.Random(12)
    for _ in range(3000):
        decodes_or_protocol_error(rng.randbytes(rng.randint(0, 80)))


def test_mutated_messages_never_raise_anything_but_protocol_error() -> None:
    rng = random.Random(13)
    encoded = [encode(m) for m in SAMPLES]
    for _ in range(3000):
        data = bytearray(rng.choice(encoded))
        for _ in range(rng.randint(1, 4)):
            op = rng.randrange(3)
            pos = rng.randrange(len(data))
            if op == 0:
                data[pos] = rng.randrange(256)
            elif op == 1:
                del data[pos:pos + rng.randint(1, 8)]
            else:
                data[pos:pos] = rng.randbytes(rng.randint(1, 8))
            if not data:
                data = bytearray(b"\x80")
        decodes_or_protocol_error(bytes(data))


def random_value(rng: random.Random, depth: int = 0) -> Any:
    choice = rng.randrange(10 if depth < 3 else 7)
    if choice == 0:
        return None
    if choice == 1:
        return rng.random() < 0.5
    if choice == 2:
        return rng.randint(-(2**40), 2**40)
    if choice == 3:
        return rng.uniform(-1e6, 1e6)
    if choice == 4:
        return "".join(rng.choice("abc?! ") for _ in range(rng.randint(0, 6)))
    if choice == 5:
        return rng.randbytes(rng.randint(0, 6))
    if choice == 6:
        return rng.choice(list(KINDS))
    if choice in (7, 8):
        return [random_value(rng, depth + 1) for _ in range(rng.randint(0, 4))]
    return {rng.choice(["v", "kind", "body", "name", "meta", "x"]): random_value(rng, depth + 1)
            for _ in range(rng.randint(0, 4))}


def test_structured_fuzz_of_maps_with_almost_right_fields() -> None:
    rng = random.Random(14)
    decoded = 0
    for _ in range(3000):
        cls = rng.choice(list(KINDS.values()))
        body = {}
        for f in dataclasses.fields(cls):
            if rng.random() < 0.9:
                body[f.name] = (getattr(SAMPLES[list(KINDS.values()).index(cls)], f.name)
                                if rng.random() < 0.7 else random_value(rng))
        kind = cls.kind if rng.random() < 0.8 else random_value(rng)
        raw = {"v": PROTOCOL_VERSION if rng.random() < 0.9 else random_value(rng),
               "kind": kind, "body": body if rng.random() < 0.95 else random_value(rng)}
        msg = decodes_or_protocol_error(pack(raw))
        if msg is not None:
            decoded += 1
            for f in dataclasses.fields(msg):
                value = getattr(msg, f.name)
                assert isinstance(value, FIELD_TYPES[str(f.type)])
    assert decoded > 100
