"""Verbs send requests as arrays: the RDMA transport's hot path, no object per request.

A rail's work of many scattered blocks becomes hundreds of verbs requests. Described
one Python object at a time (``plan.WrSpec``) that costs a few microseconds per
request, more than a NIC needs to move 64 KiB. :class:`WrBatch` holds them as columns
(opcode, remote address, rkey, immediate, signaled flag, and the SGE list as three
columns with per-request ends), and :func:`build_wr_batch` fills it with a fixed number
of NumPy operations whatever the request count, in the common case of a work whose
extents pair one local range with one remote range. Anything else (a remote range
gathered from several local extents, an extent longer than ``max_msg_size``, an error to
report precisely) takes ``plan.build_work_requests``, whose rules this follows.

Signaling: only the last request is signaled (an RC queue pair completes in order, so
its completion covers the rest), plus every ``signal_every``-th one.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from transfer_engine.descriptor import Op
from transfer_engine.transport.rdma.plan import MrKey, Opcode, Sge, WrSpec, build_work_requests

__all__ = ["WrBatch", "build_wr_batch"]

_EMPTY = np.empty(0, dtype=np.int64)


@dataclass(slots=True)
class WrBatch:
    """Send requests as columns. Request ``i`` has SGEs ``sge_end[i-1]:sge_end[i]``."""

    opcode: np.ndarray  # int64, Opcode values
    raddr: np.ndarray  # int64 (addresses fit: user space is below 2**63)
    rkey: np.ndarray  # int64
    imm: np.ndarray  # int64, host order; meaningful for *_WITH_IMM
    signaled: np.ndarray  # bool
    sge_end: np.ndarray  # int64
    addr: np.ndarray  # int64, per SGE
    length: np.ndarray  # int64, per SGE
    lkey: np.ndarray  # int64, per SGE

    def __len__(self) -> int:
        return len(self.opcode)

    @property
    def nbytes(self) -> np.ndarray:
        """Bytes of each request."""
        ends = np.concatenate(([0], np.cumsum(self.length)))
        out: np.ndarray = ends[self.sge_end] - ends[np.concatenate(([0], self.sge_end[:-1]))]
        return out

    @classmethod
    def from_specs(cls, specs: Sequence[WrSpec]) -> WrBatch:
        sges = [s for spec in specs for s in spec.sges]
        return cls(np.array([int(s.opcode) for s in specs], dtype=np.int64),
                   np.array([s.remote_addr for s in specs], dtype=np.int64),
                   np.array([s.rkey for s in specs], dtype=np.int64),
                   np.array([s.imm or 0 for s in specs], dtype=np.int64),
                   np.array([s.signaled for s in specs], dtype=bool),
                   np.cumsum([len(s.sges) for s in specs], dtype=np.int64),
                   np.array([s.addr for s in sges], dtype=np.int64),
                   np.array([s.length for s in sges], dtype=np.int64),
                   np.array([s.lkey for s in sges], dtype=np.int64))

    def specs(self) -> list[WrSpec]:
        """The requests as ``WrSpec`` objects (what a pyverbs chain is built from)."""
        out = []
        addr, length, lkey = self.addr.tolist(), self.length.tolist(), self.lkey.tolist()
        start = 0
        for op, raddr, rkey, imm, sig, end in zip(
                self.opcode.tolist(), self.raddr.tolist(), self.rkey.tolist(),
                self.imm.tolist(), self.signaled.tolist(), self.sge_end.tolist(), strict=True):
            opcode = Opcode(op)
            with_imm = opcode in (Opcode.WRITE_WITH_IMM, Opcode.SEND_WITH_IMM)
            out.append(WrSpec(opcode, tuple(Sge(a, n, k) for a, n, k in zip(
                addr[start:end], length[start:end], lkey[start:end], strict=True)),
                raddr, rkey, bool(sig), imm if with_imm else None))
            start = end
        return out

    def unsignal_last(self) -> None:
        if len(self):
            self.signaled[-1] = False

    def append(self, spec: WrSpec) -> WrBatch:
        """This batch with ``spec`` after it (the notification SEND)."""
        tail = WrBatch.from_specs([spec])
        return WrBatch(np.concatenate((self.opcode, tail.opcode)),
                       np.concatenate((self.raddr, tail.raddr)),
                       np.concatenate((self.rkey, tail.rkey)),
                       np.concatenate((self.imm, tail.imm)),
                       np.concatenate((self.signaled, tail.signaled)),
                       np.concatenate((self.sge_end, tail.sge_end + (
                           self.sge_end[-1] if len(self) else 0))),
                       np.concatenate((self.addr, tail.addr)),
                       np.concatenate((self.length, tail.length)),
                       np.concatenate((self.lkey, tail.lkey)))


def empty_batch() -> WrBatch:
    return WrBatch(_EMPTY, _EMPTY, _EMPTY, _EMPTY, np.empty(0, dtype=bool), _EMPTY,
                   _EMPTY, _EMPTY, _EMPTY)


def _columns(spans: Sequence[Any]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(segment, offset, length)`` int64 columns of planner ``Extents`` or tuples."""
    seg = getattr(spans, "segment", None)
    if isinstance(seg, np.ndarray):
        return (seg.astype(np.int64, copy=False),
                spans.offset.astype(np.int64, copy=False),  # type: ignore[attr-defined]
                spans.length.astype(np.int64, copy=False))  # type: ignore[attr-defined]
    rows = np.array([(e[0], e[1], e[2]) for e in spans], dtype=np.int64).reshape(-1, 3)
    return rows[:, 0], rows[:, 1], rows[:, 2]


def _keys(seg: np.ndarray, keys: Mapping[int, MrKey]
          ) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """Per-row (base, length, key) of each row's segment; None if one is unknown."""
    first = int(seg[0])
    if bool((seg == first).all()):
        mr = keys.get(first)
        if mr is None:
            return None
        return (np.int64(mr.base), np.int64(mr.length),  # type: ignore[return-value]
                np.int64(mr.key))
    ids, inverse = np.unique(seg, return_inverse=True)
    table = []
    for sid in ids.tolist():
        mr = keys.get(sid)
        if mr is None:
            return None
        table.append((mr.base, mr.length, mr.key))
    arr = np.array(table, dtype=np.int64)[inverse]
    return arr[:, 0], arr[:, 1], arr[:, 2]


def build_wr_batch(op: Op, local: Sequence[Any], remote: Sequence[Any], *,
                   local_keys: Mapping[int, MrKey], remote_keys: Mapping[int, MrKey],
                   max_sge: int, max_msg_size: int, imm: int | None = None,
                   signal_every: int = 0, peer: str | None = None) -> WrBatch:
    """``build_work_requests`` as a :class:`WrBatch`: the same requests, the same
    errors (``InvalidDescriptorError`` for unregistered or out-of-bounds extents)."""
    def slow() -> WrBatch:
        return WrBatch.from_specs(build_work_requests(
            op, local, remote, local_keys=local_keys, remote_keys=remote_keys,
            max_sge=max_sge, max_msg_size=max_msg_size, imm=imm,
            signal_every=signal_every, peer=peer))
    if op is Op.READ and imm is not None:
        raise ValueError("RDMA READ carries no immediate")
    if len(local) != len(remote) or not len(local):
        return slow()
    lseg, loff, llen = _columns(local)
    rseg, roff, rlen = _columns(remote)
    lu, ru = getattr(local, "uniform", None), getattr(remote, "uniform", None)
    if not (lu is not None and ru is not None and lu[1] == ru[1]) and not (
            llen is rlen or np.array_equal(llen, rlen)):
        return slow()
    lk, rk = _keys(lseg, local_keys), _keys(rseg, remote_keys)
    if lk is None or rk is None:
        return slow()
    lbase, lsize, lkey = lk
    rbase, rsize, rkey = rk
    bad = ((llen <= 0) | (loff < 0) | (roff < 0) | (loff + llen > lsize)
           | (roff + llen > rsize) | (llen > max_msg_size))
    if bool(bad.any()):
        return slow()  # the precise error, or an extent cut over several requests
    raddr = rbase + roff
    n = len(llen)
    if n > 1:
        follows = raddr[1:] == raddr[:-1] + llen[:-1]
        if np.ndim(rkey):
            follows &= rkey[1:] == rkey[:-1]
        if bool(follows.any()):
            return slow()  # remote ranges that continue each other share a request
    base_op = Opcode.READ if op is Op.READ else Opcode.WRITE
    opcode = np.full(n, int(base_op), dtype=np.int64)
    imms = np.zeros(n, dtype=np.int64)
    if imm is not None:
        opcode[-1] = int(Opcode.WRITE_WITH_IMM)
        imms[-1] = imm
    signaled = np.zeros(n, dtype=bool)
    if signal_every > 0:
        signaled[signal_every - 1::signal_every] = True
    signaled[-1] = True
    return WrBatch(opcode, raddr, rkey if np.ndim(rkey) else np.full(n, rkey),
                   imms, signaled, np.arange(1, n + 1, dtype=np.int64),
                   lbase + loff, llen, lkey if np.ndim(lkey) else np.full(n, lkey))
