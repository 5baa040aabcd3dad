"""The one signed request/reply loop every control-plane client uses, against a real
ZeroMQ service on loopback: answers pair with their requests even after a timeout,
refusals and secret mismatches raise precise errors, a closed client refuses."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
import zmq

from transfer_engine.control.auth import AuthConfig, Signer
from transfer_engine.control.messages import Ack, ErrorReply, Message, SegmentsRequest
from transfer_engine.control.request import SignedClient
from transfer_engine.control.service import Service
from transfer_engine.errors import (
    AuthenticationError,
    ClosedError,
    RemoteError,
    TransferTimeout,
)

SECRET = b"s" * 32


class _Server:
    """Answers ``segments?`` named ``slow:N`` after N ms, ``ok`` with an ack and
    anything else with a refusal that names it."""

    def __init__(self, zctx: zmq.Context[object], signer: Signer | None) -> None:
        self.seen: list[str] = []
        self.service = Service(zctx, "127.0.0.1", 0, self._handle, "test-svc", signer)

    def _handle(self, msg: Message) -> Message:
        assert isinstance(msg, SegmentsRequest)
        self.seen.append(msg.name)
        if msg.name.startswith("slow:"):
            time.sleep(int(msg.name[5:]) / 1000)
        if msg.name == "ok":
            return Ack()
        return ErrorReply(f"answer to {msg.name}")


@pytest.fixture
def zctx() -> Iterator[zmq.Context[object]]:
    ctx: zmq.Context[object] = zmq.Context()
    yield ctx
    ctx.term()


def test_a_late_answer_never_pairs_with_the_next_request(
        zctx: zmq.Context[object]) -> None:
    server = _Server(zctx, None)
    client = SignedClient(zctx, server.service.endpoint, None, peer="svc")
    try:
        with pytest.raises(TransferTimeout, match="no answer") as info:
            client.request(SegmentsRequest("slow:400"), 0.1)
        assert info.value.peer == "svc" and info.value.op == "segments?"
        # the slow answer arrives after the timeout: the next request gets its own
        with pytest.raises(RemoteError, match="answer to second"):
            client.request(SegmentsRequest("second"), 5.0)
        assert isinstance(client.request(SegmentsRequest("ok"), 5.0), Ack)
        assert client.rtt is not None and client.rtt < 5.0
        assert server.seen == ["slow:400", "second", "ok"]
    finally:
        client.close()
        server.service.close()


def test_pipelined_requests_are_answered_in_order(zctx: zmq.Context[object]) -> None:
    server = _Server(zctx, None)
    client = SignedClient(zctx, server.service.endpoint, None, peer="svc")
    try:
        for i in range(5):
            client.send(SegmentsRequest(f"r{i}"))
        for i in range(5):
            with pytest.raises(RemoteError, match=f"answer to r{i} "):
                client.receive("segments?", 5.0)
    finally:
        client.close()
        server.service.close()


def test_the_caller_chooses_its_errors(zctx: zmq.Context[object]) -> None:
    server = _Server(zctx, None)
    client = SignedClient(
        zctx, server.service.endpoint, None, peer="svc",
        timeout_error=lambda op, t: LookupError(f"{op} late by {t}"),
        refused_error=lambda op, why: KeyError(f"{op}: {why}"))
    try:
        with pytest.raises(KeyError, match="answer to x"):
            client.request(SegmentsRequest("x"), 5.0)
        with pytest.raises(LookupError, match="late by 0.05"):
            client.request(SegmentsRequest("slow:300"), 0.05)
    finally:
        client.close()
        server.service.close()


def test_secret_mismatches_and_a_closed_client_fail_precisely(
        zctx: zmq.Context[object]) -> None:
    server = _Server(zctx, Signer(AuthConfig(SECRET)))
    signed = SignedClient(zctx, server.service.endpoint, Signer(AuthConfig(SECRET)),
                          peer="svc")
    unsigned = SignedClient(zctx, server.service.endpoint, None, peer="svc")
    wrong = SignedClient(zctx, server.service.endpoint, Signer(AuthConfig(b"w" * 32)),
                         peer="svc")
    try:
        assert isinstance(signed.request(SegmentsRequest("ok"), 5.0), Ack)
        for client in (unsigned, wrong):
            with pytest.raises(AuthenticationError):
                client.request(SegmentsRequest("ok"), 5.0)
        assert server.seen == ["ok"]  # nothing unauthenticated reached the handler
        signed.close()
        signed.close()  # idempotent
        with pytest.raises(ClosedError, match="closed"):
            signed.request(SegmentsRequest("ok"), 5.0)
    finally:
        for client in (signed, unsigned, wrong):
            client.close()
        server.service.close()


def test_one_client_serves_threads_one_request_at_a_time(
        zctx: zmq.Context[object]) -> None:
    server = _Server(zctx, None)
    client = SignedClient(zctx, server.service.endpoint, None, peer="svc")
    errors: list[str] = []

    def ask(i: int) -> None:
        for j in range(20):
            try:
                client.request(SegmentsRequest(f"t{i}.{j}"), 5.0)
            except RemoteError as exc:
                if f"answer to t{i}.{j}" not in exc.message:
                    errors.append(exc.message)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(4)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert not errors and len(server.seen) == 80
    finally:
        client.close()
        server.service.close()
