"""Faults the tests inject, and the internals they reach on purpose: the one module of
the tests that touches the project's private state.

- Faults: transports that inject them (subclasses of the real ones), a peer process
  frozen on demand, a storage node whose tier copies stall, an etcd lease revoked
  behind its holder's back, requests sent past a kvstore client's bookkeeping.
- Internals a test drives or inspects that no public API should offer: a rail's socket
  (to check its kernel state), a transfer handle finished as the engine would, a ticket
  issued without a handshake, an object's lock held across a check, the owner token
  that must never leak.

Each is one named function (or class), so that a change of the internals breaks here,
once, and not in the tests that use it.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

from kvstore.node import StorageNode
from transfer_engine.control.etcd_client import etcd_request, parse_etcd_address
from transfer_engine.control.etcd_store import EtcdStore
from transfer_engine.errors import NotSupportedError, TransferEngineError
from transfer_engine.handle import TransferHandle
from transfer_engine.transport.base import Transport, Work
from transfer_engine.transport.iovec import head_rows, send_iov
from transfer_engine.transport.shm import ShmServer, ShmTransport
from transfer_engine.transport.stream import Connection, Targets
from transfer_engine.transport.stream.io import (
    PeerClosed,
    Steps,
    Wait,
    has_bytes,
    recv_into_views,
    send_bytes,
)
from transfer_engine.transport.tcp import TcpRail, TcpServer, TcpTransport


class RefusingShmServer(ShmServer):
    """Behaves as a kernel that forbids cross-memory attach (EPERM)."""

    def land(self, conn: Connection, views: Targets, local: np.ndarray | None) -> None:
        raise NotSupportedError("cross-memory attach refused: Operation not permitted",
                                peer=conn.peer, op="write", transport="shm")


class RefusingShmTransport(ShmTransport):
    """An shm transport whose target side refuses every copy."""

    def start(self, host: Any) -> dict[str, Any]:
        info = super().start(host)
        server = self._server
        assert server is not None
        server.__class__ = RefusingShmServer
        return info


class AnswerLosingShmServer(ShmServer):
    """Lands a WRITE and counts its immediate, then drops the connection instead of
    answering, once: the initiator cannot tell whether the bytes landed."""

    lost = False
    _counted = False  # the WRITE's immediate was counted (set by the transport below)

    def _answer(self, wr_id: int, exc: Any) -> bytes:
        if exc is None and self._counted and not self.lost:
            self.lost = True
            raise OSError("fault injected: the answer is lost")
        return super()._answer(wr_id, exc)


class AnswerLosingShmTransport(ShmTransport):
    """An shm transport whose target loses the answer of the first WRITE with an
    immediate (see :class:`AnswerLosingShmServer`); served from threads."""

    def __init__(self) -> None:
        super().__init__(serve="thread")

    def start(self, host: Any) -> dict[str, Any]:
        info = super().start(host)
        server = self._server
        assert server is not None
        server.__class__ = AnswerLosingShmServer
        server._counted = False  # type: ignore[attr-defined]
        deliver = server._host.deliver_immediate

        def counted(*args: Any, **kwargs: Any) -> None:
            deliver(*args, **kwargs)
            server._counted = True  # type: ignore[attr-defined]

        server._host = _Relay(server._host, counted)
        return info


class _Relay:
    """``host`` with its ``deliver_immediate`` replaced."""

    def __init__(self, host: Any, deliver_immediate: Callable[..., None]) -> None:
        self._host = host
        self.deliver_immediate = deliver_immediate

    def __getattr__(self, name: str) -> Any:
        return getattr(self._host, name)


class DroppingTcpServer(TcpServer):
    """Resets the connection after ``drop_after`` payload bytes of a WRITE landed."""

    drop_after = 1 << 20

    def stream_rows(self, views: Targets) -> np.ndarray | None:
        return None  # the payload lands through land below

    def land(self, conn: Connection, views: Targets, local: np.ndarray | None) -> None:
        budget = self.drop_after
        partial = []
        for v in views:
            if budget <= 0:
                break
            partial.append(v[:budget])
            budget -= len(v)
        recv_into_views(conn.sock, partial)
        linger_zero = b"\x01\x00\x00\x00\x00\x00\x00\x00"
        conn.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, linger_zero)
        conn.sock.close()  # RST: the initiator sees a reset mid-transfer
        raise ConnectionResetError("fault injected: connection dropped")


class DroppingTcpTransport(TcpTransport):
    def start(self, host: Any) -> dict[str, Any]:
        info = super().start(host)
        assert self._server is not None
        self._server.__class__ = DroppingTcpServer
        return info


class StallingTcpServer(TcpServer):
    """Answers a READ with its head and its first 64 KiB, then sends nothing more,
    its control plane answering on (a target's bug, or a peer that means harm)."""

    sent = 64 << 10

    def serve_steps(self, conn: Connection, wr_id: int, views: Targets,
                    local: np.ndarray | None) -> Steps:
        send_bytes(conn.sock, self._answer(wr_id, None))
        n = min(self.sent, views.nbytes)
        send_iov(conn.sock, head_rows(views.iov, n), n)
        while not has_bytes(conn.sock):  # parked until the initiator gives up
            yield Wait(time.monotonic() + 3600)
        raise PeerClosed("the initiator closed the rail")


class StallingTcpTransport(TcpTransport):
    """A tcp transport whose target stalls every READ's answer (served from threads)."""

    def __init__(self) -> None:
        super().__init__(serve="thread")

    def start(self, host: Any) -> dict[str, Any]:
        info = super().start(host)
        assert self._server is not None
        self._server.__class__ = StallingTcpServer
        return info


class BrokenPostRail(TcpRail):
    """A rail whose ``post`` fails as a bug would: not with a TransferError."""

    def post(self, work: Work) -> None:
        raise RuntimeError("fault injected: post failed")


class BrokenPostTcpTransport(TcpTransport):
    """A tcp transport whose rails cannot post (see :class:`BrokenPostRail`)."""

    def connect(self, *args: Any, **kwargs: Any) -> Any:
        rail = super().connect(*args, **kwargs)
        rail.__class__ = BrokenPostRail
        return rail


@contextmanager
def stopped(proc: subprocess.Popen[str]) -> Iterator[None]:
    """The peer process frozen for the block (its kernel still accepts bytes until its
    socket buffers fill)."""
    os.kill(proc.pid, signal.SIGSTOP)
    try:
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:  # the signal is delivered asynchronously
            with open(f"/proc/{proc.pid}/stat") as f:
                if f.read().rpartition(")")[2].split()[0] in ("T", "t"):
                    break
            time.sleep(0.005)
        yield
    finally:
        os.kill(proc.pid, signal.SIGCONT)


class SlowCopyNode(StorageNode):
    """A node whose tier copies take ``delay`` seconds once ``slow`` is set, so a test
    can overwrite a key while its move is in flight."""

    slow = False
    delay = 0.5

    def _copy(self, entry: tuple[int, int, int, int, int, int, int, float]) -> None:
        if self.slow:
            time.sleep(self.delay)
        super()._copy(entry)


def revoke_etcd_lease(store: EtcdStore, lease: int) -> None:
    """Revokes ``lease`` in etcd behind ``store``'s back, as a restore from a backup
    would forget it."""
    revoke_etcd_lease_at(store.address, lease)


def revoke_etcd_lease_at(address: str, lease: int) -> None:
    """Revokes ``lease`` in the etcd at ``address`` (its first member)."""
    (host, port), *_ = parse_etcd_address(address)[0]
    etcd_request(host, port, "/v3/lease/revoke", {"ID": str(lease)}, 2, "test")


# --- internals a test reaches on purpose ----------------------------------------------


def rail_socket(rail: Any) -> socket.socket:
    """The socket under a stream (tcp/shm) rail: to check its kernel state (its
    congestion control, whether its descriptor was let go)."""
    sock: socket.socket = rail._sock
    return sock


def served_sockets(transport: Transport) -> list[socket.socket]:
    """The accepted ends of the rails a tcp transport's main server holds."""
    server = transport._server  # type: ignore[attr-defined]
    assert server is not None
    return list(server._conns)


def finish_as_engine(handle: TransferHandle, error: TransferEngineError | None = None
                     ) -> bool:
    """Finishes ``handle`` as the engine does when its transfer ends (``error``: how it
    failed); False when it had finished already."""
    return handle._finish(error)


def issue_ticket(engine: Any, peer: str) -> dict[str, bytes]:
    """A rail ticket of ``engine`` for ``peer``, its wire form, without a handshake."""
    ticket: dict[str, bytes] = engine._tickets.issue(peer)
    return ticket


def owner_token(client: Any) -> str:
    """The secret token a registry client proves its names with (never published)."""
    token: str = client._token
    return token


@contextmanager
def holding_lock(obj: Any) -> Iterator[None]:
    """Holds ``obj``'s own lock for the block (a kvstore master, node or buffer pool):
    what the test reads meanwhile is one state, and whatever else wants the lock
    (its threads, the garbage collector ending a lease) waits or defers."""
    with obj._lock:
        yield


@contextmanager
def raw_link(client: Any) -> Iterator[Callable[[Any, float], Any]]:
    """A kvstore client's own connection to its master, held for the block:
    ``request(message, timeout)`` sends past the client's bookkeeping (a lease taken
    and kept, a put placed and never committed)."""
    with client._lock:
        yield client._link.request


def release_lease(client: Any, lease_id: int) -> None:
    """Queues ``lease_id`` for release with the client's next request, as a get does."""
    client._release.append(lease_id)


def pending_put_rows(master: Any, put_id: int) -> Any:
    """The object table rows a master holds for a put placed and not committed."""
    return master._puts[put_id].rows


def local_tier(client: Any) -> Any:
    """A kvstore client's local DRAM tier (None without ``local_cache_bytes``)."""
    return client._tier


def clock_hand(store: Any) -> int:
    """Where a KV store's CLOCK eviction hand points now (a flat slot position)."""
    hand: int = store._clock_policy.hand
    return hand


def sorted_layers(layers: Any) -> set[int]:
    """The ids of the ``ExpiryLayers`` layers sorted into heaps so far."""
    heaped: set[int] = layers._heaped
    return heaped


def mooncake_batch(engine: Any, batch_id: int) -> Any:
    """The record behind a Mooncake drop-in batch id: its handle and deadline."""
    return engine._batches[batch_id]


def sglang_given_up(manager: Any) -> Any:
    """The (room, nonce) pairs a prefill rank was told were given up before their
    request arrived."""
    return manager._given_up


def sglang_hooks(hook_registry: Any, target: str) -> list[Any]:
    """The hooks SGLang's own ``HookRegistry`` holds for ``target``."""
    hooks: list[Any] = hook_registry._hooks[target]
    return hooks


def forget_sglang_mounts(plugin: Any) -> None:
    """Lets ``plugin.mount`` mount again in this process (after SGLang's hooks were
    reset)."""
    plugin._MOUNTED.clear()


def fake_pyverbs(monkeypatch: Any, fake: Any) -> None:
    """Has the RDMA transport use ``fake`` as pyverbs for the test."""
    monkeypatch.setattr("transfer_engine.transport.rdma.verbs._VERBS", fake)


def before_later_reads(worker: Any, action: Callable[[], None]) -> None:
    """Has a vLLM connector worker run ``action`` each time the first READ of a
    layer-wise load landed, just before it posts the READs of the later layer groups."""
    original = worker._issue_rest

    def cut(recv: Any) -> bool:
        action()
        ok: bool = original(recv)
        return ok

    worker._issue_rest = cut


def early_sent_notes(worker: Any) -> set[str]:
    """The request ids of the decoders' "sent" notifications a vLLM connector worker
    keeps until it holds those requests itself."""
    early: set[str] = worker._holds._sent_early
    return early


def serving_process_boots_with(monkeypatch: Any, code: str) -> None:
    """Has every serving process started in the test run ``code`` instead of its own
    boot code (``"import sys; sys.exit(3)"``: one that cannot start)."""
    monkeypatch.setattr("transfer_engine.transport.stream.process._BOOT", code)
