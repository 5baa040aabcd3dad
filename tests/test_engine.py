"""Engine API: registration from every kind of memory, lifecycle, reprs, imports."""

from __future__ import annotations

import ctypes
import mmap
import socket
import subprocess
import sys
import time
from collections.abc import Callable

import numpy as np
import pytest

from tests.helpers.transport_contract import random_bytes
from transfer_engine import (
    BusyError,
    Descriptor,
    Engine,
    InvalidDescriptorError,
    RegistrationError,
)

MiB = 1 << 20


def test_import_loads_no_heavy_libraries() -> None:
    code = ("import sys, transfer_engine; "
            "bad = [m for m in ('torch', 'cupy', 'pyverbs', 'pynvml') if m in sys.modules]; "
            "print(bad); sys.exit(1 if bad else 0)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


def _roundtrip(make_engine: Callable[..., Engine], obj: object, view: np.ndarray) -> None:
    a = make_engine("a", transports=["tcp"])
    b = make_engine("b", transports=["tcp"])
    n = view.nbytes
    src = random_bytes(n, 5)
    src_seg = a.register(src)
    dst_seg = b.register(obj, name="dst")
    assert dst_seg.length == n
    peer = a.connect(b.endpoint)
    remote = peer.segment("dst")
    a.write(peer, [(Descriptor(src_seg, 0, n), Descriptor(remote, 0, n))]).wait(10)
    assert np.array_equal(view, src)


def test_register_numpy(make_engine: Callable[..., Engine]) -> None:
    arr = random_bytes(MiB, 1).view(np.float32)
    _roundtrip(make_engine, arr, arr.view(np.uint8))


def test_register_bytearray_memoryview_mmap(make_engine: Callable[..., Engine]) -> None:
    ba = bytearray(random_bytes(4096, 2).tobytes())
    _roundtrip(make_engine, ba, np.frombuffer(ba, dtype=np.uint8))


def test_register_mmap(make_engine: Callable[..., Engine]) -> None:
    mm = mmap.mmap(-1, 65536)
    try:
        view = np.frombuffer(mm, dtype=np.uint8)
        _roundtrip(make_engine, memoryview(mm), view)
        del view
    finally:
        import gc

        gc.collect()
        try:
            mm.close()
        except BufferError:
            pass


def test_register_raw_address(make_engine: Callable[..., Engine]) -> None:
    buf = (ctypes.c_ubyte * 8192)()
    view = np.frombuffer(buf, dtype=np.uint8)
    _roundtrip(make_engine, (ctypes.addressof(buf), 8192), view)


def test_register_torch_tensor(make_engine: Callable[..., Engine]) -> None:
    torch = pytest.importorskip("torch")
    t = torch.from_numpy(random_bytes(2 * MiB, 3)).view(torch.bfloat16).reshape(2, 64, -1)
    _roundtrip(make_engine, t, t.view(torch.uint8).reshape(-1).numpy())


def test_register_rejects_unsupported(make_engine: Callable[..., Engine]) -> None:
    a = make_engine("a", transports=["tcp"])
    with pytest.raises(RegistrationError):
        a.register(object())
    with pytest.raises(RegistrationError):
        a.register(np.zeros((4, 4), dtype=np.uint8)[:, ::2])
    with pytest.raises(RegistrationError):
        a.register(bytearray())
    a.register(bytearray(16), name="x")
    with pytest.raises(RegistrationError):
        a.register(bytearray(16), name="x")
    torch = sys.modules.get("torch")
    if torch is not None:
        with pytest.raises(RegistrationError):
            a.register(torch.zeros(8, 8).t())


def test_read_only_memory_is_a_write_source_only(make_engine: Callable[..., Engine]) -> None:
    a = make_engine("a", transports=["tcp"])
    b = make_engine("b", transports=["tcp"])
    data = random_bytes(4096, 9).tobytes()
    ro = a.register(data)
    assert not ro.writable
    dst = np.zeros(4096, dtype=np.uint8)
    b.register(dst, name="dst")
    peer = a.connect(b.endpoint)
    remote = peer.segment("dst")
    a.write(peer, [(Descriptor(ro, 0, 4096), Descriptor(remote, 0, 4096))]).wait(10)
    assert dst.tobytes() == data
    with pytest.raises(InvalidDescriptorError, match="read-only"):
        a.read(peer, [(Descriptor(ro, 0, 16), Descriptor(remote, 0, 16))])


def test_deregister_waits_for_transfers_then_refuses(make_engine: Callable[..., Engine]) -> None:
    a = make_engine("a", transports=["tcp"])
    seg = a.register(bytearray(64))
    seg.pin()
    with pytest.raises(BusyError):
        seg.close(timeout=0.05)
    seg.unpin()
    seg.close()
    seg.close()
    assert seg.closed and "CLOSED" in repr(seg)


def test_reprs_tell_state(make_engine: Callable[..., Engine]) -> None:
    a = make_engine("prefill-0", transports=["shm", "tcp"])
    b = make_engine("decode-1", transports=["shm", "tcp"])
    b.register(bytearray(4096), name="dst")
    peer = a.connect(b.endpoint)
    assert repr(a) == "<Engine 'prefill-0' transports=[shm,tcp] peers=1 segments=0>"
    assert "<Peer 'decode-1' via shm rails=[shmx2,tcpx2] segments=1>" == repr(peer)
    rail = peer.rails["tcp"][0]
    assert repr(rail).startswith("<Rail tcp\u2192decode-1#") and "OPEN" in repr(rail)
    src = a.register(bytearray(b"x" * 4096))
    h = a.write(peer, [(Descriptor(src, 0, 4096), Descriptor(peer.segment("dst"), 0, 4096))])
    h.wait(10)
    assert "WRITE \u2192decode-1 4096/4096B via shm DONE" in repr(h)


def test_unclosed_engine_warns() -> None:
    engine = Engine("leaky", transports=["tcp"])
    with pytest.warns(ResourceWarning):
        engine.__del__()
    assert engine.closed


def test_connect_to_a_refused_port_fails_at_once(make_engine: Callable[..., Engine]) -> None:
    from transfer_engine import ConnectError

    a = make_engine("a", transports=["tcp"])
    started = time.monotonic()
    with pytest.raises(ConnectError) as info:
        a.connect("tcp://127.0.0.1:1", timeout=5)
    assert time.monotonic() - started < 2  # a timeout would take 5 s
    assert info.value.op == "connect"


def test_connect_to_a_silent_listener_times_out(make_engine: Callable[..., Engine]) -> None:
    from transfer_engine import TransferTimeout

    a = make_engine("a", transports=["tcp"])
    with socket.socket() as silent:  # accepts connections (the kernel does) but no hello
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        port = silent.getsockname()[1]
        with pytest.raises(TransferTimeout) as info:
            a.connect(f"tcp://127.0.0.1:{port}", timeout=0.3)
    assert info.value.op == "hello"


def test_ipv6_loopback(make_engine: Callable[..., Engine]) -> None:
    try:
        b = make_engine("b", host="::1", transports=["tcp"])
    except Exception as exc:  # no IPv6 on this host
        pytest.skip(f"no IPv6 loopback: {exc}")
    a = make_engine("a", host="::1", transports=["tcp"])
    dst = np.zeros(4096, dtype=np.uint8)
    b.register(dst, name="dst")
    src = random_bytes(4096, 1)
    seg = a.register(src)
    peer = a.connect(b.endpoint)
    a.write(peer, [(Descriptor(seg, 0, 4096), Descriptor(peer.segment("dst"), 0, 4096))]).wait(10)
    assert np.array_equal(src, dst)
