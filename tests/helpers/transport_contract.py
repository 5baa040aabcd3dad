"""One conformance suite for every transport.

A test module subclasses :class:`TransportContract` and sets ``transports`` (and, for
hardware, a marker). Each test builds an initiator ``a`` and a target ``b`` in this
process, connected over loopback through the real handshake, and checks behaviour on
seeded random data.
"""

from __future__ import annotations

import collections
import faulthandler
import random
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import pytest

from transfer_engine import (
    ClosedError,
    Descriptor,
    Engine,
    InvalidDescriptorError,
    Op,
    Peer,
    RemoteSegment,
    Segment,
    TransferState,
    TransferTimeout,
    UnknownPeerError,
)

MiB = 1 << 20


_DRAWN: collections.OrderedDict[tuple[int, int], np.ndarray] = collections.OrderedDict()
_DRAWN_BYTES = 512 * MiB  # kept draws; a fresh copy of one costs a memcpy, not a draw


def random_bytes(n: int, seed: int) -> np.ndarray:
    """``n`` seeded random bytes, a fresh array each call. Large draws are kept and
    copied: drawing 72 MiB takes 0.3 s, and the contract suites draw hundreds."""
    if n < MiB:
        return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)
    key = (n, seed)
    drawn = _DRAWN.pop(key, None)
    if drawn is None:
        drawn = np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)
        drawn.flags.writeable = False
    _DRAWN[key] = drawn
    while sum(a.nbytes for a in _DRAWN.values()) > _DRAWN_BYTES and len(_DRAWN) > 1:
        _DRAWN.popitem(last=False)
    return drawn.copy()


@dataclass
class Pair:
    a: Engine
    b: Engine
    peer: Peer
    src: np.ndarray  # registered with a as "src"
    dst: np.ndarray  # registered with b as "dst"
    src_seg: Segment
    dst_seg: Segment
    remote: RemoteSegment


class TransportContract:
    transports: ClassVar[list[Any]] = []
    size: ClassVar[int] = 72 * MiB

    def transports_for(self, role: str) -> list[Any]:
        return list(self.transports)

    @pytest.fixture
    def pair(self, make_engine: Callable[..., Engine]) -> Pair:
        a = make_engine("a", transports=self.transports_for("a"))
        b = make_engine("b", transports=self.transports_for("b"))
        src = random_bytes(self.size, 1)
        dst = random_bytes(self.size, 2)
        src_seg = a.register(src, name="src")
        dst_seg = b.register(dst, name="dst")
        peer = a.connect(b.endpoint)
        return Pair(a, b, peer, src, dst, src_seg, dst_seg, peer.segment("dst"))

    def expected_transport(self) -> str:
        name = self.transports[0]
        return name if isinstance(name, str) else name.name

    # --- round trips ------------------------------------------------------------------

    @pytest.mark.parametrize("size", [1, 7, 4096, 65536 + 3, MiB + 5, 64 * MiB])
    def test_write_then_read_roundtrip(self, pair: Pair, size: int) -> None:
        rng = random.Random(size)
        loff, roff = rng.randrange(0, 4096), rng.randrange(0, 4096)
        h = pair.a.write(pair.peer, [(Descriptor(pair.src_seg, loff, size),
                                      Descriptor(pair.remote, roff, size))])
        h.wait(30)
        assert h.state is TransferState.DONE and h.bytes_done == size
        assert h.transport == self.expected_transport()
        assert np.array_equal(pair.dst[roff:roff + size], pair.src[loff:loff + size])
        # read it back into a different place
        back = loff + size + 17
        if back + size > self.size:
            back = 0 if loff >= size else self.size - size
        pair.src[back:back + size] = random_bytes(size, 99)[:size]
        h = pair.a.read(pair.peer, [(Descriptor(pair.src_seg, back, size),
                                     Descriptor(pair.remote, roff, size))])
        h.wait(30)
        assert np.array_equal(pair.src[back:back + size], pair.dst[roff:roff + size])

    @pytest.mark.parametrize("op", [Op.WRITE, Op.READ])
    @pytest.mark.parametrize("count", [1, 128, 4096])
    def test_many_noncontiguous_pairs(self, pair: Pair, op: Op, count: int) -> None:
        rng = random.Random(count)
        slot = 8192
        slots = rng.sample(range(self.size // slot // 2), count)
        rslots = rng.sample(range(self.size // slot // 2), count)
        pairs, expect = [], []
        for ls, rs in zip(slots, rslots, strict=True):
            n = rng.randint(1, slot // 2)  # destinations never overlap
            lo, ro = ls * slot, rs * slot + rng.randint(0, slot // 2)
            pairs.append((Descriptor(pair.src_seg, lo, n), Descriptor(pair.remote, ro, n)))
            expect.append((lo, ro, n))
        before = pair.dst.copy() if op is Op.WRITE else pair.src.copy()
        h = pair.a.write(pair.peer, pairs) if op is Op.WRITE else pair.a.read(pair.peer, pairs)
        h.wait(30)
        for lo, ro, n in expect:
            assert np.array_equal(pair.src[lo:lo + n], pair.dst[ro:ro + n])
        # bytes outside the destinations are untouched
        changed = pair.dst if op is Op.WRITE else pair.src
        mask = np.ones(self.size, dtype=bool)
        for lo, ro, n in expect:
            if op is Op.WRITE:
                mask[ro:ro + n] = False
            else:
                mask[lo:lo + n] = False
        assert np.array_equal(changed[mask], before[mask])

    def test_many_transfers_in_flight(self, pair: Pair) -> None:
        handles = []
        for i in range(64):
            off = i * 64 * 1024
            handles.append(pair.a.write(pair.peer, [(Descriptor(pair.src_seg, off, 65536),
                                                     Descriptor(pair.remote, off, 65536))],
                                        notify=b"n%d" % i))
        for h in handles:
            h.wait(30)
        assert np.array_equal(pair.dst[:64 * 65536], pair.src[:64 * 65536])
        notes = []
        for _ in range(50):
            notes += pair.b.notifications(timeout=0.2)
            if len(notes) >= 64:
                break
        assert sorted(n.payload for n in notes) == sorted(b"n%d" % i for i in range(64))

    # --- notifications ----------------------------------------------------------------

    def test_notification_once_after_all_bytes(self, pair: Pair) -> None:
        """The target's callback checks the bytes at the moment it is notified."""
        seen: list[tuple[bytes, bool]] = []
        expected: dict[bytes, tuple[int, int]] = {}
        lock = threading.Lock()

        def check(note: Any) -> None:
            roff, n = expected[note.payload]
            ok = np.array_equal(pair.dst[roff:roff + n], pair.src[roff:roff + n])
            with lock:
                seen.append((note.payload, ok))

        pair.b.on_notify(check)
        handles = []
        for i in range(8):
            off, n = i * 8 * MiB, 8 * MiB - i * 4099
            expected[b"t%d" % i] = (off, n)
        for key, (off, n) in expected.items():
            # many pieces striped over every rail, so rails finish out of order
            pieces = [(Descriptor(pair.src_seg, off + k, min(65536, n - k)),
                       Descriptor(pair.remote, off + k, min(65536, n - k)))
                      for k in range(0, n, 65536)][::-1]
            handles.append(pair.a.write(pair.peer, pieces, notify=key))
        for h in handles:
            try:
                h.wait(30)
            except TransferTimeout:  # rare, seen only in full runs: what waits where
                faulthandler.dump_traceback(all_threads=True)
                raise
        for _ in range(50):
            if len(seen) >= len(expected):
                break
            pair.b.notifications(timeout=0.1)
        assert sorted(k for k, _ in seen) == sorted(expected)
        assert all(ok for _, ok in seen)

    def test_read_notifies_target(self, pair: Pair) -> None:
        h = pair.a.read(pair.peer, [(Descriptor(pair.src_seg, 0, 4096),
                                     Descriptor(pair.remote, 0, 4096))], notify=b"done")
        h.wait(10)
        notes = pair.b.notifications(timeout=5)
        assert [n.payload for n in notes] == [b"done"] and notes[0].peer == "a"

    # --- bad input: precise errors, nothing written ------------------------------------

    def _assert_untouched(self, pair: Pair, snapshot: np.ndarray) -> None:
        assert np.array_equal(pair.dst, snapshot)

    @pytest.mark.parametrize("case", ["remote_oob", "local_oob", "zero", "mismatch",
                                      "negative"])
    def test_bad_descriptors_rejected_before_anything_moves(self, pair: Pair,
                                                            case: str) -> None:
        snapshot = pair.dst.copy()
        good = (Descriptor(pair.src_seg, 0, 4096), Descriptor(pair.remote, 0, 4096))
        bad = {
            "remote_oob": (Descriptor(pair.src_seg, 0, 4096),
                           Descriptor(pair.remote, self.size - 100, 4096)),
            "local_oob": (Descriptor(pair.src_seg, self.size - 1, 2),
                          Descriptor(pair.remote, 8192, 2)),
            "zero": (Descriptor(pair.src_seg, 0, 0), Descriptor(pair.remote, 8192, 0)),
            "mismatch": (Descriptor(pair.src_seg, 0, 10), Descriptor(pair.remote, 0, 11)),
            "negative": (Descriptor(pair.src_seg, 0, 10), Descriptor(pair.remote, -5, 10)),
        }[case]
        with pytest.raises(InvalidDescriptorError) as info:
            pair.a.write(pair.peer, [good, bad])
        err = info.value
        assert err.peer == "b" and err.op == "write" and err.length is not None
        assert err.segment in ("src", "dst") and err.offset is not None
        assert "peer=b" in str(err)
        self._assert_untouched(pair, snapshot)

    def test_target_checks_bounds_itself(self, pair: Pair) -> None:
        """A peer with wrong metadata (here: a forged, larger segment) is refused by the
        target; no byte lands."""
        snapshot = pair.dst.copy()
        forged = RemoteSegment("b", pair.remote.id, "dst", self.size * 2)
        with pytest.raises(InvalidDescriptorError) as info:
            pair.a.write(pair.peer, [(Descriptor(pair.src_seg, 0, 4096),
                                      Descriptor(forged, 0, 4096)),
                                     (Descriptor(pair.src_seg, 0, 4096),
                                      Descriptor(forged, self.size + 4096, 4096))]).wait(10)
        assert info.value.peer == "b" and info.value.offset == self.size + 4096
        self._assert_untouched(pair, snapshot)

    def test_deregistered_remote_segment_refused(self, pair: Pair) -> None:
        snapshot = pair.dst.copy()
        pair.dst_seg.close()
        with pytest.raises(InvalidDescriptorError) as info:
            pair.a.write(pair.peer, [(Descriptor(pair.src_seg, 0, 4096),
                                      Descriptor(pair.remote, 0, 4096))]).wait(10)
        assert "deregistered" in str(info.value) and info.value.peer == "b"
        self._assert_untouched(pair, snapshot)
        with pytest.raises(InvalidDescriptorError):
            pair.peer.segment("no-such-segment")

    def test_deregistered_local_segment_refused(self, pair: Pair) -> None:
        pair.src_seg.close()
        with pytest.raises(InvalidDescriptorError):
            pair.a.write(pair.peer, [(Descriptor(pair.src_seg, 0, 16),
                                      Descriptor(pair.remote, 0, 16))])

    def test_unknown_peer(self, pair: Pair) -> None:
        with pytest.raises(UnknownPeerError) as info:
            pair.a.write("nobody", [(Descriptor(pair.src_seg, 0, 16),
                                     Descriptor(pair.remote, 0, 16))])
        assert info.value.peer == "nobody"

    # --- close semantics --------------------------------------------------------------

    def test_close_fails_inflight_and_is_idempotent(self, pair: Pair) -> None:
        handles = [pair.a.write(pair.peer, [(Descriptor(pair.src_seg, 0, 32 * MiB),
                                             Descriptor(pair.remote, 0, 32 * MiB))])
                   for _ in range(4)]
        pair.a.close()
        pair.a.close()
        for h in handles:
            try:
                h.wait(10)
            except ClosedError:
                assert h.state is TransferState.FAILED
            else:
                assert h.state is TransferState.DONE
        with pytest.raises(ClosedError):
            pair.a.write(pair.peer, [(Descriptor(pair.src_seg, 0, 16),
                                      Descriptor(pair.remote, 0, 16))])
        assert "CLOSED" in repr(pair.a)
