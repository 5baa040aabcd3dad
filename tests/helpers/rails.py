"""The rail opening spoken by hand: what an attack test (or a legitimate hand-written
peer) needs to obtain a ticket over the control plane and open a tcp or shm rail."""

from __future__ import annotations

import os
import socket
import struct
from collections.abc import Callable
from typing import Any

import msgpack
import numpy as np
import zmq

from transfer_engine import Engine
from transfer_engine.control.auth import AuthConfig, open_reply, seal
from transfer_engine.control.messages import Hello, Welcome
from transfer_engine.control.tickets import CHALLENGE_BYTES, Credential
from transfer_engine.transport.stream import (
    ANSWER,
    FLAG_UNIFORM,
    HEADER,
    KIND_ANSWER,
    KIND_HELLO,
    WIRE_VERSION,
    encode_announce,
    pack_uniform,
)


def handshake(engine: Engine, name: str = "raw", secret: str | None = None,
              pid: int | None = None) -> tuple[Welcome, Credential]:
    """A control-plane Hello to ``engine`` as peer ``name``; its Welcome and the rail
    credential it carries."""
    signer = AuthConfig(secret=secret).signer() if secret else None
    with zmq.Context() as ctx, ctx.socket(zmq.DEALER) as sock:
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(engine.endpoint)
        sock.send(seal(Hello({"name": name, "pid": os.getpid() if pid is None else pid}),
                       signer))
        assert sock.poll(5000), "no welcome"
        reply = open_reply(sock.recv(), signer)
    assert isinstance(reply, Welcome)
    key = secret.encode() if secret else None
    return reply, Credential.from_welcome(reply.ticket, key, engine.name, name)


def recv_all(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionResetError("target closed the rail")
        data += chunk
    return data


def hello_frame(credential: Credential | None, transport: str, challenge: bytes,
                **overrides: Any) -> bytes:
    """The HELLO answering ``challenge`` (a forged one where ``credential`` is None)."""
    if credential is not None:
        nonce, proof = credential.opening(transport, challenge)
        body = {"version": WIRE_VERSION, "ticket": credential.ticket, "nonce": nonce,
                "proof": proof, "pid": os.getpid()}
    else:
        body = {"version": WIRE_VERSION, "ticket": os.urandom(16), "nonce": os.urandom(32),
                "proof": os.urandom(32), "pid": os.getpid()}
    body.update(overrides)
    data = msgpack.packb(body)
    return HEADER.pack(KIND_HELLO, 0, 0, 0, 0, len(data), 0, 0, 0) + data


def connect_raw(engine: Engine, transport: str = "tcp") -> socket.socket:
    info = engine.metadata()["transports"][transport]
    if transport == "tcp":
        return socket.create_connection((info["host"], info["port"]), timeout=5)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(5)
    sock.connect(info["path"])
    return sock


class RawRail:
    """A hand-driven rail: the initiator side of the protocol without the engine.

    ``credential`` None opens nothing (the raw socket speaks to the challenge as a
    stranger would); otherwise the rail is opened and ``status`` is the hello's answer.
    """

    def __init__(self, engine: Engine, credential: Credential | None,
                 transport: str = "tcp", ranges: np.ndarray | None = None) -> None:
        self.sock = connect_raw(engine, transport)
        self.transport = transport
        self.challenge = recv_all(self.sock, CHALLENGE_BYTES)
        self.wr_id = 0
        self.status: int | None = None
        if credential is not None:
            self.sock.sendall(hello_frame(credential, transport, self.challenge))
            self.status, _ = self.answer()
            if ranges is not None:
                self.sock.sendall(encode_announce(ranges))

    def request(self, kind: int, entries: list[tuple[int, int, int]], payload: bytes = b"",
                local: bytes = b"", n_local: int = 0) -> tuple[int, bytes]:
        self.wr_id += 1
        head = HEADER.pack(kind, 0, len(entries), n_local, 0, 0, self.wr_id, 0, 0)
        words = struct.pack("<" + "QQQ" * len(entries), *(w for e in entries for w in e))
        self.sock.sendall(head + words + local + payload)
        return self.answer()

    def request_uniform(self, kind: int, segment: int, length: int, offsets: list[int],
                        payload: bytes = b"") -> tuple[int, bytes]:
        """A request whose entries share one segment and length: offsets alone."""
        self.wr_id += 1
        head = HEADER.pack(kind, FLAG_UNIFORM, len(offsets), 0, 0, 0, self.wr_id, 0, 0)
        entries = pack_uniform(segment, length, np.array(offsets, dtype=np.uint64))
        self.sock.sendall(head + entries + payload)
        return self.answer()

    def answer(self) -> tuple[int, bytes]:
        kind, status, _, body_len, _ = ANSWER.unpack(self.recv(ANSWER.size))
        assert kind == KIND_ANSWER
        return status, self.recv(body_len)

    def recv(self, n: int) -> bytes:
        return recv_all(self.sock, n)

    def closed_by_target(self, timeout: float = 5.0) -> bool:
        """Whether the target closes the connection (reads until EOF, bounded)."""
        self.sock.settimeout(timeout)
        try:
            for _ in range(1000):
                if not self.sock.recv(65536):
                    return True
        except (ConnectionResetError, BrokenPipeError):
            return True
        except TimeoutError:
            return False
        return False

    def close(self) -> None:
        self.sock.close()


SIZE = 1 << 20


def tight_tcp(make_engine: Callable[..., Engine], stall: float
              ) -> tuple[Engine, np.ndarray, int]:
    """An engine serving tcp with a stall timeout of ``stall`` seconds and a random
    1 MiB segment, ``kv``."""
    from tests.helpers.transport_contract import random_bytes  # noqa: PLC0415
    from transfer_engine.transport.tcp import TcpTransport  # noqa: PLC0415

    b = make_engine("victim", transports=[TcpTransport(stall_timeout=stall)])
    mem = random_bytes(SIZE, 12)
    return b, mem, b.register(mem, name="kv").id
