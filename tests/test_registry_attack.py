"""The registry under attack, over real ZeroMQ sockets speaking the wire by hand: where
it may listen, who may remove or replace a name, join floods from one address, the
member cap, event memory after waves of expiring fakes, hostile frames with a secret
configured, and listing 10,000 large members. Every case ends with the legitimate
members intact."""

from __future__ import annotations

import logging
import os
import secrets
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator

import msgpack
import pytest
import zmq

from tests.helpers.faults import owner_token
from transfer_engine.control.auth import AuthConfig, Signer, seal
from transfer_engine.control.client import RegistryClient
from transfer_engine.control.limits import RegistryLimits
from transfer_engine.control.messages import (
    PROTOCOL_VERSION,
    Denied,
    ErrorReply,
    Events,
    Heartbeat,
    HeartbeatAck,
    Leave,
    ListMembers,
    Lookup,
    Members,
    Message,
    Register,
    Registered,
    Watch,
    decode,
    encode,
    encode_packed,
)
from transfer_engine.control.metastore import MemberEvent, MemberRecord
from transfer_engine.control.registry import Registry

SECRET = "attack-secret-attack-secret"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KiB = 1 << 10


def wait_for(cond: Callable[[], bool], timeout: float = 10.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def big_record(name: str, segments: int = 128, incarnation: str = "") -> MemberRecord:
    """A record the size of a real engine's with 128 segments (~9.7 KB encoded)."""
    segs = [{"id": i, "name": f"kv-{i}", "length": 1 << 30, "device": "cuda:0",
             "writable": True, "keys": {"shm": f"/te-kv-{i:04d}"}} for i in range(segments)]
    return MemberRecord(name, incarnation or secrets.token_hex(8), "decode", "host-1",
                        control="tcp://10.0.0.1:5555",
                        transports={"tcp": {"host": "10.0.0.1", "port": 5556}},
                        segments=segs)


class Wire:
    """A raw DEALER to the registry, optionally from another loopback source address
    (``127.0.0.2``: the registry sees a different peer). Sends requests pipelined and
    reads replies as frames or decoded messages."""

    def __init__(self, endpoint: str, source: str | None = None,
                 signer: Signer | None = None) -> None:
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.RCVHWM, 0)
        address = endpoint.removeprefix("tcp://")
        self.sock.connect(f"tcp://{source}:0;{address}" if source else endpoint)
        self.signer = signer

    def send(self, msg: Message | bytes, *more: bytes) -> None:
        frame = msg if isinstance(msg, bytes) else seal(msg, self.signer)
        self.sock.send_multipart([frame, *more])

    def frame(self, timeout: float = 5.0) -> bytes:
        assert self.sock.poll(int(timeout * 1000)), f"no reply within {timeout}s"
        return self.sock.recv()

    def reply(self, timeout: float = 5.0) -> Message:
        frame = self.frame(timeout)
        if self.signer is not None and frame[:4] == b"TEA1":
            frame = self.signer.verify(frame)
        return decode(frame)

    def ask(self, msg: Message | bytes, timeout: float = 5.0) -> Message:
        self.send(msg)
        return self.reply(timeout)

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()

    def __enter__(self) -> Wire:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def pipelined(wire: Wire, requests: list[bytes], window: int = 256) -> list[Message]:
    """Sends ``requests`` keeping ``window`` in flight; returns every reply in order."""
    replies: list[Message] = []
    sent = 0
    while len(replies) < len(requests):
        while sent < len(requests) and sent - len(replies) < window:
            wire.send(requests[sent])
            sent += 1
        replies.append(wire.reply(10))
    return replies


@pytest.fixture
def registry() -> Iterator[Registry]:
    with Registry(interval=0.1, max_missed=3) as reg:
        yield reg


# --- where it listens -----------------------------------------------------------------


@pytest.mark.parametrize("bind", ["tcp://0.0.0.0:0", "tcp://*:7100", "tcp://[::]:0",
                                  "tcp://10.1.2.3:7100", "tcp://eth0:7100"])
def test_network_bind_without_secret_needs_an_opt_in(
        bind: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.delenv("TE_ALLOW_INSECURE", raising=False)
    with pytest.raises(ValueError, match="TE_CONTROL_SECRET.*TE_ALLOW_INSECURE=1"):
        Registry(bind)
    with caplog.at_level(logging.WARNING, "transfer_engine.control.limits"):
        Registry(bind, allow_insecure=True).close()  # built, never bound
        monkeypatch.setenv("TE_ALLOW_INSECURE", "1")
        Registry(bind).close()
    assert sum("WITHOUT a control secret" in r.message for r in caplog.records) == 2
    monkeypatch.setenv("TE_ALLOW_INSECURE", "1")
    with pytest.raises(ValueError):
        Registry(bind, allow_insecure=False)  # the explicit argument wins
    Registry(bind, auth=AuthConfig(SECRET)).close()  # a secret: any address


@pytest.mark.parametrize("bind", ["tcp://127.0.0.1:0", "tcp://127.0.0.2:7100",
                                  "tcp://[::1]:0", "tcp://localhost:0", "ipc:///tmp/x"])
def test_loopback_bind_needs_nothing(bind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TE_ALLOW_INSECURE", raising=False)
    Registry(bind).close()
    assert Registry().bind == "tcp://127.0.0.1:0"


def test_command_line_refuses_a_network_bind_without_secret() -> None:
    env = {k: v for k, v in os.environ.items()
           if k not in ("TE_CONTROL_SECRET", "TE_CONTROL_SECRET_FILE", "TE_ALLOW_INSECURE")}
    env["PYTHONPATH"] = ROOT
    out = subprocess.run([sys.executable, "-m", "transfer_engine.registry", "--bind",
                          "tcp://0.0.0.0:0"], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=30, stdin=subprocess.DEVNULL)
    assert out.returncode == 2, out
    assert "--insecure" in out.stderr and "TE_CONTROL_SECRET" in out.stderr


# --- who owns a name ------------------------------------------------------------------


def test_hijack_by_lookup_leave_register_fails(registry: Registry) -> None:
    assert registry.endpoint is not None
    with RegistryClient(registry.endpoint, name="legit") as legit, \
            Wire(registry.endpoint, "127.0.0.2") as evil:
        original = big_record("decode-0", 4)
        legit.register(original)
        token = owner_token(legit)
        # what anyone can read never carries the owner token
        for request in (Lookup("decode-0"), ListMembers(), Watch("", -1, 0.0)):
            evil.send(request)
            assert token.encode() not in evil.frame()
        found = evil.ask(Lookup("decode-0"))
        assert isinstance(found, Members) and len(found.members) == 1
        assert "token" not in found.members[0]
        incarnation = found.members[0]["incarnation"]
        for guess in ("", "0" * 32, incarnation, secrets.token_hex(16)):
            reply = evil.ask(Leave("decode-0", incarnation, guess))
            assert isinstance(reply, ErrorReply)
            assert "owner token does not match" in reply.message
        reply = evil.ask(Leave("decode-0", "another-incarnation", secrets.token_hex(16)))
        assert isinstance(reply, ErrorReply)
        assert f"held by incarnation {incarnation}" in reply.message
        forged = big_record("decode-0", 1, incarnation).to_message(secrets.token_hex(16))
        reply = evil.ask(forged)
        assert isinstance(reply, ErrorReply) and "held by a live member" in reply.message
        reply = evil.ask(Register("decode-0", incarnation, "decode"))  # no token at all
        assert isinstance(reply, ErrorReply) and "owner token" in reply.message
        assert registry.members == [original]
        assert registry.stats["refused_owner"] == 6
        legit.leave()  # the owner's leave works
        assert registry.members == []


def test_forged_heartbeats_do_not_keep_a_dead_member_alive(registry: Registry) -> None:
    assert registry.endpoint is not None
    with RegistryClient(registry.endpoint, name="legit") as legit:
        legit.register(MemberRecord("d1", "inc-1"))
        other = RegistryClient(registry.endpoint, name="alive")
        other.register(MemberRecord("d2", "inc-2"))
    # legit's client is closed without leaving: it went silent
    with Wire(registry.endpoint, "127.0.0.2") as evil, other:
        died = time.monotonic()
        while registry.stats["expires"] == 0:
            reply = evil.ask(Heartbeat("d1", "inc-1", secrets.token_hex(16)))
            assert isinstance(reply, HeartbeatAck) and not reply.known
            assert time.monotonic() - died < 3, "forged heartbeats kept d1 alive"
            time.sleep(0.03)
        assert [r.name for r in registry.members] == ["d2"]


# --- floods ---------------------------------------------------------------------------


def fake_registrations(n: int, prefix: str = "fake", segments: int = 0) -> list[bytes]:
    return [seal(big_record(f"{prefix}-{i:05d}", segments).to_message(secrets.token_hex(16)),
                 None) for i in range(n)]


def test_join_flood_from_one_address_is_rate_limited() -> None:
    limits = RegistryLimits(join_burst=50, join_rate=20)
    with Registry(interval=0.2, limits=limits) as reg:
        assert reg.endpoint is not None
        with RegistryClient(reg.endpoint, name="legit") as legit:
            legit.register(big_record("legit", 8))
            wires = [Wire(reg.endpoint, "127.0.0.2") for _ in range(4)]
            try:
                start = time.monotonic()
                requests = fake_registrations(2000)
                replies = [r for i, w in enumerate(wires)  # new connections do not help
                           for r in pipelined(w, requests[i::4])]
                elapsed = time.monotonic() - start
            finally:
                for w in wires:
                    w.close()
            admitted = sum(isinstance(r, Registered) for r in replies)
            refused = [r for r in replies if isinstance(r, ErrorReply)]
            assert admitted + len(refused) == 2000
            assert admitted <= 50 + 20 * elapsed + 1, (admitted, elapsed)
            assert all("too many registrations from 127.0.0.2" in r.message
                       for r in refused)
            # another address is not starved by the flood
            with Wire(reg.endpoint, "127.0.0.3") as neighbour:
                reply = neighbour.ask(MemberRecord("neighbour", "n").to_message("t" * 32))
                assert isinstance(reply, Registered)
            assert "legit" in [r.name for r in legit.list()]
            # the legitimate member was never dropped (admitted fakes stop heartbeating
            # and may expire while a slow machine is still sending the flood)
            assert legit.stats["forgotten"] == 0
            assert reg.stats["expires"] <= admitted


def test_member_cap_holds_and_members_keep_working() -> None:
    limits = RegistryLimits(max_members=100, join_rate=0)
    with Registry(interval=0.5, limits=limits) as reg:  # the fakes expire after 1.5 s
        assert reg.endpoint is not None
        with RegistryClient(reg.endpoint, name="legit") as legit:
            legit.register(MemberRecord("legit", "i1", "prefill"))
            with Wire(reg.endpoint, "127.0.0.2") as evil:
                replies = pipelined(evil, fake_registrations(500))
            assert len(reg.members) == 100
            assert sum(isinstance(r, Registered) for r in replies) == 99
            refused = [r for r in replies if isinstance(r, ErrorReply)]
            assert len(refused) == 401
            assert all("registry full: 100 members" in r.message for r in refused)
            # the existing member still updates and heartbeats at the cap
            legit.register(MemberRecord("legit", "i1", "prefill", pod="pod-b"))
            assert legit.lookup("legit").pod == "pod-b"
            beats = legit.stats["heartbeats"]
            wait_for(lambda: legit.stats["heartbeats"] >= beats + 2, 5, "heartbeats")
            wait_for(lambda: len(reg.members) == 1, 5, "the fakes to expire")
            assert legit.lookup("legit").pod == "pod-b"


def test_heartbeats_keep_working_during_a_flood() -> None:
    """A flood of registrations, lookups, lists and garbage from one address: a member
    heartbeating every 200 ms from another address is never expired (it may miss four
    in a row: the flood runs in this process, on the same two cores)."""
    limits = RegistryLimits(join_burst=20, join_rate=10)
    with Registry(interval=0.2, max_missed=5, limits=limits) as reg:
        assert reg.endpoint is not None
        endpoint = reg.endpoint
        with RegistryClient(endpoint, name="legit") as legit:
            legit.register(big_record("legit", 8))
            stop = threading.Event()
            sent = [0]

            def flood() -> None:
                big = fake_registrations(64, "flood", 128)
                junk = [seal(Lookup("legit"), None), seal(ListMembers(), None),
                        b"\x93garbage", b"x" * 100_000]
                with Wire(endpoint, "127.0.0.2") as evil:
                    while not stop.is_set():
                        for frame in big + junk:
                            evil.send(frame)
                            sent[0] += 1
                        while evil.sock.poll(0):
                            evil.sock.recv()
                        time.sleep(0.001)

            t = threading.Thread(target=flood, name="flood")
            beats = legit.stats["heartbeats"]
            t.start()
            try:
                time.sleep(1.5)
            finally:
                stop.set()
                t.join(10)
            assert sent[0] > 1000
            assert legit.stats["heartbeats"] - beats >= 4  # 7 due in 1.5 s at 200 ms
            assert legit.stats["heartbeat_unanswered"] == 0
            assert legit.stats["registered"] == 0  # never expired, never re-registered
            assert "legit" in [r.name for r in reg.members]
            admitted = reg.stats["joins"] - 1  # the flood's (expiring: they never beat)
            assert admitted <= 20 + 10 * 2, admitted


# --- memory ---------------------------------------------------------------------------


def test_event_memory_stays_bounded_after_waves_of_expiring_fakes() -> None:
    cap = 256 * KiB
    limits = RegistryLimits(log_bytes=cap, join_rate=0)
    # fakes expire after a second; the legitimate member heartbeats five times in that
    # second, so a loaded machine does not expire it too
    with Registry(interval=0.2, max_missed=5, limits=limits) as reg:
        assert reg.endpoint is not None
        seen: list[MemberEvent] = []
        with RegistryClient(reg.endpoint, name="legit") as legit, \
                Wire(reg.endpoint, "127.0.0.2") as evil:
            legit.register(big_record("legit", 8))
            sub = legit.watch(seen.append)
            peak = 0
            for wave in range(3):
                replies = pipelined(evil, fake_registrations(100, f"w{wave}", 128))
                assert all(isinstance(r, Registered) for r in replies)
                peak = max(peak, reg.event_bytes)
                wait_for(lambda: len(reg.members) == 1, 5, "fakes to expire")
                peak = max(peak, reg.event_bytes)
            assert peak <= cap
            assert reg.stats["events_evicted"] > 0  # 300 x 9.7 KB joins passed the cap
            assert reg.stats["expires"] >= 300  # (the legitimate one re-registers if it did)
            wait_for(lambda: [r.name for r in reg.members] == ["legit"], 5, "legit alone")
            assert reg.member_bytes == len(msgpack.packb(reg.members[0].to_wire()))
            # a watcher whose position was evicted gets a snapshot of the live members
            reply = evil.ask(Watch(reg.epoch, 1, 0.0))
            assert isinstance(reply, Events) and reply.snapshot
            assert [m["name"] for m in reply.members] == ["legit"]
            wait_for(lambda: list(legit.view) == ["legit"], 5, "the watcher's view")
            sub.close()


# --- hostile frames with a secret -----------------------------------------------------


def test_hostile_frames_with_a_secret_are_refused_and_the_loop_survives() -> None:
    signer = AuthConfig(SECRET).signer()
    assert signer is not None
    with Registry(auth=AuthConfig(SECRET), interval=0.2) as reg:
        assert reg.endpoint is not None
        auth = AuthConfig(SECRET)
        with RegistryClient(reg.endpoint, auth=auth, name="legit") as legit, \
                Wire(reg.endpoint, "127.0.0.2") as evil:
            legit.register(big_record("legit", 8))
            wrong = AuthConfig("wrong-secret-wrong-secret").signer()
            assert wrong is not None
            signed = signer.sign(msgpack.packb({"v": PROTOCOL_VERSION, "kind": "lookup",
                                                "body": {"name": "legit"}}))
            cases: list[tuple[bytes, type[Message], str]] = [
                (seal(Lookup("legit"), None), Denied, "not signed"),
                (seal(Leave("legit", "i", "t" * 32), None), Denied, "not signed"),
                (seal(Lookup("legit"), wrong), Denied, "bad signature"),
                (signed, Members, ""),
                (signed, Denied, "replayed"),
                (signer.sign(b"\xc1garbage"), ErrorReply, "undecodable"),
                (signer.sign(msgpack.packb({"v": PROTOCOL_VERSION, "kind": "heartbeat",
                                            "body": {"name": "x" * 70_000}})),
                 ErrorReply, "exceeds its limit"),
                (signer.sign(msgpack.packb({"v": 1, "kind": "lookup", "body": {}})),
                 ErrorReply, "protocol version"),
                (seal(Register("legit", "i", "emperor", token="t" * 32), signer),
                 ErrorReply, "role"),
                (b"TEA1" + b"\x00" * 300, Denied, "bad signature"),
            ]
            for frame, kind, text in cases:
                evil.send(frame)
                raw = evil.frame()
                reply = decode(signer.verify(raw) if raw[:4] == b"TEA1" else raw)
                assert isinstance(reply, kind), (text, reply)
                assert text in getattr(reply, "reason", getattr(reply, "message", "")), reply
            evil.send(seal(Lookup("legit"), signer), b"second frame")
            assert isinstance(decode(signer.verify(evil.frame())), ErrorReply)
            evil.send(b"\x00" * (2 << 20))  # over the frame limit: libzmq drops it
            assert reg.serving
            assert [r.name for r in legit.list()] == ["legit"]
            assert reg.stats["denied"] >= 5


# --- paging ---------------------------------------------------------------------------


def test_encode_packed_equals_encode() -> None:
    members = [big_record(f"m{i}", 3).to_wire() for i in range(3)]
    packed = [msgpack.packb(m) for m in members]
    assert (encode_packed(Members(next="m2"), members=packed)
            == encode(Members(members, next="m2")))
    events = [{"seq": 1, "type": "leave", "name": "a", "member": None, "reason": "left"}]
    assert (encode_packed(Events("e", 7, snapshot=True, after="x"), members=packed,
                          events=[msgpack.packb(e) for e in events])
            == encode(Events("e", 7, events, True, members, after="x")))
    with pytest.raises(TypeError, match="no field"):
        encode_packed(Members(), nothing=[])


def test_list_and_watch_follow_pages() -> None:
    """With 16 KiB pages every reply holds one or two records: a list, a watch snapshot
    and a burst of join events all arrive whole, page by page."""
    limits = RegistryLimits(page_bytes=16 * KiB, join_rate=0)
    with Registry(interval=60, limits=limits) as reg:
        assert reg.endpoint is not None
        with RegistryClient(reg.endpoint, name="observer") as client, \
                Wire(reg.endpoint) as wire:
            client.register(big_record("observer"))
            assert all(isinstance(r, Registered)
                       for r in pipelined(wire, fake_registrations(40, "a", 128)))
            before = reg.stats["requests"]
            names = [r.name for r in client.list()]
            assert names == sorted([f"a-{i:05d}" for i in range(40)] + ["observer"])
            assert reg.stats["requests"] - before >= 20
            assert [r.name for r in client.list("decode")] == names
            assert client.list("prefill") == []
            seen: list[str] = []
            sub = client.watch(lambda ev: seen.append(ev.name))
            wait_for(lambda: len(seen) == 41, 10, "the snapshot's joins")
            assert pipelined(wire, fake_registrations(30, "b", 128))
            wait_for(lambda: len(seen) == 71, 10, "the burst of joins")
            assert sorted(seen) == sorted(names + [f"b-{i:05d}" for i in range(30)])
            assert client.stats["snapshots"] == 1 and reg.stats["watches"] >= 40
            sub.close()


def test_snapshot_pages_and_the_events_after_them_add_up() -> None:
    """Members that join or leave while a watcher pages through a snapshot reach it as
    events after the snapshot's seq; a snapshot whose seq is evicted meanwhile starts
    over."""
    limits = RegistryLimits(page_bytes=16 * KiB, join_rate=0, log_bytes=64 * KiB)
    with Registry(interval=60, limits=limits) as reg:
        assert reg.endpoint is not None
        with RegistryClient(reg.endpoint, name="zz") as last, Wire(reg.endpoint) as wire:
            last.register(big_record("zz", 8))
            assert pipelined(wire, fake_registrations(10, "m", 128))
            first = wire.ask(Watch("", -1, 0.0))
            assert isinstance(first, Events) and first.snapshot and first.after == ""
            assert first.next and first.seq == 11
            names = [m["name"] for m in first.members]
            assert isinstance(wire.ask(big_record("a", 8).to_message("a" * 32)),
                              Registered)  # sorts before the cursor
            last.leave()  # sorts after it
            page = first
            while page.next:
                page = wire.ask(Watch(first.epoch, first.seq, 0.0, page.next))
                assert isinstance(page, Events) and page.snapshot and page.seq == 11
                names += [m["name"] for m in page.members]
            assert names == [f"m-{i:05d}" for i in range(10)]
            events = wire.ask(Watch(first.epoch, first.seq, 0.0))
            assert isinstance(events, Events) and not events.snapshot
            assert [(e["type"], e["name"]) for e in events.events] == [("join", "a"),
                                                                       ("leave", "zz")]
            # the snapshot's seq is evicted between two pages: it starts over
            page = wire.ask(Watch("", -1, 0.0))
            assert isinstance(page, Events) and page.next
            assert pipelined(wire, fake_registrations(10, "n", 128))  # 97 KB of events
            again = wire.ask(Watch(page.epoch, page.seq, 0.0, page.next))
            assert isinstance(again, Events) and again.snapshot
            assert again.after == "" and again.seq == 23 > page.seq == 13


# --- scale ----------------------------------------------------------------------------


@pytest.mark.slow
def test_four_thousand_large_members_list_and_watch() -> None:
    """4,000 members of ~9.7 KB each (38 MB of records, 9x the 4 MiB message limit):
    list() and a watch snapshot each deliver every one over the wire, in pages."""
    n = 4_000
    limits = RegistryLimits(join_rate=0, max_members=2 * n)
    with Registry(interval=60, limits=limits) as reg:  # the fakes never heartbeat
        assert reg.endpoint is not None
        template = msgpack.unpackb(seal(big_record("x").to_message("t" * 32), None))
        requests = []
        for i in range(n):
            template["body"]["name"] = f"m-{i:05d}"
            template["body"]["incarnation"] = f"inc-{i}"
            requests.append(msgpack.packb(template))
        t0 = time.monotonic()
        wires = [Wire(reg.endpoint) for _ in range(4)]
        try:
            replies = [r for i, w in enumerate(wires) for r in pipelined(w, requests[i::4])]
        finally:
            for w in wires:
                w.close()
        t_register = time.monotonic() - t0
        assert all(isinstance(r, Registered) for r in replies)
        assert reg.member_bytes > 38_000_000
        with RegistryClient(reg.endpoint, name="observer", timeout=30) as client:
            t0 = time.monotonic()
            records = client.list()
            t_list = time.monotonic() - t0
            assert len(records) == n
            assert records[0] == MemberRecord.from_wire(msgpack.unpackb(requests[0])["body"])
            assert [r.name for r in records] == [f"m-{i:05d}" for i in range(n)]
            del records
            lists = reg.stats["requests"]
            joined = threading.Semaphore(0)
            t0 = time.monotonic()
            sub = client.watch(lambda ev: joined.release())
            for _ in range(n):
                assert joined.acquire(timeout=30)
            t_watch = time.monotonic() - t0
            sub.close()
            assert len(client.view) == n and client.stats["snapshots"] == 1
            assert reg.stats["watches"] >= 32  # ~1 MiB pages
            assert reg.stats["requests"] - lists >= 32
        print(f"\n{n:,} x {len(requests[0])} B: register {t_register:.1f}s, "
              f"list {t_list:.1f}s, watch snapshot {t_watch:.1f}s")


@pytest.mark.parametrize("bad", [{"max_members": 0}, {"log_bytes": -1}, {"join_rate": -1.0},
                                 {"join_rate": float("nan")}, {"page_bytes": 3 << 20},
                                 {"join_burst": True}])
def test_limits_are_validated(bad: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        RegistryLimits(**bad)  # type: ignore[arg-type]
