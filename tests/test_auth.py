"""HMAC authentication of control messages: signer unit tests, and wrong or missing
secrets refused with a clear error on the client side (registry and handshake)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from tests.helpers.clock import FakeClock
from transfer_engine import Engine
from transfer_engine.control.auth import (
    OVERHEAD,
    AuthConfig,
    Signer,
    open_reply,
    open_request,
    seal,
)
from transfer_engine.control.client import RegistryClient
from transfer_engine.control.messages import MAX_MESSAGE_BYTES, Heartbeat
from transfer_engine.control.metastore import MemberRecord
from transfer_engine.control.registry import Registry
from transfer_engine.errors import AuthenticationError

SECRET = "s3cret-s3cret-s3cret"
OTHER = "another-secret-entirely"



def test_sign_verify_roundtrip_and_tamper() -> None:
    s = Signer(AuthConfig(SECRET))
    frame = s.sign(b"hello")
    assert Signer(AuthConfig(SECRET)).verify(frame) == b"hello"
    with pytest.raises(AuthenticationError, match="wrong secret"):
        Signer(AuthConfig(OTHER)).verify(frame)
    tampered = frame[:-1] + b"X"
    with pytest.raises(AuthenticationError, match="bad signature"):
        Signer(AuthConfig(SECRET)).verify(tampered)
    with pytest.raises(AuthenticationError, match="not signed"):
        s.verify(b"plain")


def test_replay_and_stale_messages_refused() -> None:
    clock = FakeClock(1_700_000_000.0)
    s = Signer(AuthConfig(SECRET, window=10), clock)
    frame = s.sign(b"x")
    assert s.verify(frame) == b"x"
    with pytest.raises(AuthenticationError, match="replayed"):
        s.verify(frame)
    old = s.sign(b"y")
    clock.now += 11
    with pytest.raises(AuthenticationError, match="stale"):
        s.verify(old)
    future = Signer(AuthConfig(SECRET), lambda: clock.now + 60).sign(b"z")
    with pytest.raises(AuthenticationError, match="future"):
        s.verify(future)
    # the nonce cache forgets entries older than the window
    for _ in range(5):
        s.verify(s.sign(b"n"))
    clock.now += 11
    s.verify(s.sign(b"n"))
    assert s.nonces_held == 1


def test_oversized_frames_and_clock_skew() -> None:
    """A frame larger than any message is refused before its MAC is computed; a nonce
    from a sender whose clock runs ahead is remembered for as long as its timestamp is
    valid, so the frame cannot be replayed near the end of that time."""
    clock = FakeClock(1_700_000_000.0)
    s = Signer(AuthConfig(SECRET, window=10), clock)
    with pytest.raises(AuthenticationError, match="exceeds the limit"):
        s.verify(b"TEA1" + bytes(OVERHEAD + MAX_MESSAGE_BYTES))
    ahead = Signer(AuthConfig(SECRET, window=10), lambda: clock.now + 8).sign(b"skewed")
    assert s.verify(ahead) == b"skewed"
    clock.now += 11  # past now + window, still within its timestamp + window
    with pytest.raises(AuthenticationError, match="replayed"):
        s.verify(ahead)


def test_config_validation_and_env(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError):
        AuthConfig("short")
    assert AuthConfig().signer() is None
    monkeypatch.setenv("TE_CONTROL_SECRET", SECRET)
    assert AuthConfig.from_env().key == SECRET.encode()


def test_open_request_and_reply_errors() -> None:
    signer = AuthConfig(SECRET).signer()
    assert signer is not None
    with pytest.raises(AuthenticationError, match="no control secret"):
        open_request(seal(Heartbeat("a", "b"), signer), None)
    with pytest.raises(AuthenticationError, match="runs without a control secret"):
        open_reply(seal(Heartbeat("a", "b"), None), signer)


@pytest.fixture
def secure_registry() -> Iterator[Registry]:
    with Registry(auth=AuthConfig(SECRET), interval=0.1) as reg:
        yield reg


@pytest.mark.parametrize("secret", [OTHER, None])
def test_registry_refuses_wrong_or_missing_secret(secure_registry: Registry,
                                                  secret: str | None) -> None:
    assert secure_registry.endpoint is not None
    auth = AuthConfig(secret) if secret else None
    with RegistryClient(secure_registry.endpoint, auth=auth, name="bad") as client:
        with pytest.raises(AuthenticationError, match="refused by the peer") as info:
            client.register(MemberRecord("intruder", "i"))
        assert info.value.peer == "registry"
    assert secure_registry.members == []
    assert secure_registry.stats["denied"] == 1
    with RegistryClient(secure_registry.endpoint, auth=AuthConfig(SECRET)) as good:
        good.register(MemberRecord("ok", "i"))
        assert [r.name for r in good.list()] == ["ok"]
        good.leave()


def test_engine_with_wrong_secret_cannot_join(secure_registry: Registry) -> None:
    with pytest.raises(AuthenticationError, match="refused by the peer"):
        Engine("e", transports=["tcp"], registry=secure_registry.endpoint, auth=OTHER,
               timeout=2)
    with Engine("e", transports=["tcp"], registry=secure_registry.endpoint, auth=SECRET,
                timeout=2) as e:
        assert [r.name for r in e.members()] == ["e"]


def test_handshake_signed_when_engines_share_a_secret(
        make_engine: Callable[..., Engine]) -> None:
    b = make_engine("b", transports=["tcp"], auth=SECRET)
    good = make_engine("good", transports=["tcp"], auth=SECRET)
    assert good.connect(b.endpoint).name == "b"
    wrong = make_engine("wrong", transports=["tcp"], auth=OTHER)
    with pytest.raises(AuthenticationError, match="refused by the peer"):
        wrong.connect(b.endpoint)
    plain = make_engine("plain", transports=["tcp"])
    with pytest.raises(AuthenticationError, match="refused by the peer"):
        plain.connect(b.endpoint)
    assert b.stats["control_denied"] == 2
