"""Verbs send requests as arrays: the RDMA transport's hot path, no object per request.

A rail's work of many scattered blocks becomes hundreds of verbs requests. Described
one Python object at a time (``plan.WrSpec``) that costs a few microseconds per
request, more than a NIC needs to move 64 KiB. :class:`WrBatch` holds them as columns
(opcode, remote address, rkey, immediate, signaled flag, and the SGE list as three
columns with per-request ends), and :func:`build_wr_batch` fills it with a fixed number
of NumPy operations whatever the request count, in the common case of a work whose
extents pair one local range with one remote range (remote ranges that continue each
other included: they share a request). Anything else (local ranges to merge, an extent
longer than ``max_msg_size``, an error to report precisely) takes
``plan.build_work_requests``, whose rules this follows.

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
    errors (``InvalidDescriptorError`` for unregistered or out-of-bounds extents).

    Rows that pair one local range with one remote range take a fixed number of NumPy
    operations; remote ranges that continue each other become one request with a local
    entry per row, as the object builder makes them. Blocks of one segment and one
    length (the planner's ``uniform``) skip the per-row key lookup and length checks."""
    def slow() -> WrBatch:
        return WrBatch.from_specs(build_work_requests(
            op, local, remote, local_keys=local_keys, remote_keys=remote_keys,
            max_sge=max_sge, max_msg_size=max_msg_size, imm=imm,
            signal_every=signal_every, peer=peer))
    if op is Op.READ and imm is not None:
        raise ValueError("RDMA READ carries no immediate")
    n = len(local)
    if n != len(remote) or not n:
        return slow()
    rows = _uniform_rows(local, remote, local_keys, remote_keys, max_msg_size)
    if rows is None:
        rows = _general_rows(local, remote, local_keys, remote_keys, max_msg_size)
        if rows is None:
            return slow()  # the precise error, or an extent cut over several requests
    laddr, llen, lkey, raddr, rkey = rows
    first = None
    if n > 1:
        follows = raddr[1:] == raddr[:-1] + (llen[:-1] if isinstance(llen, np.ndarray) else llen)
        if isinstance(rkey, np.ndarray):
            follows &= rkey[1:] == rkey[:-1]
        if bool(follows.any()):  # remote ranges that continue each other share a request
            first = _requests(follows, laddr, llen, lkey, max_sge, max_msg_size)
            if first is None:
                return slow()
    count = n if first is None else len(first)
    base_op = Opcode.READ if op is Op.READ else Opcode.WRITE
    opcode = np.full(count, int(base_op), dtype=np.int64)
    imms = np.zeros(count, dtype=np.int64)
    if imm is not None:
        opcode[-1] = int(Opcode.WRITE_WITH_IMM)
        imms[-1] = imm
    signaled = np.zeros(count, dtype=bool)
    if signal_every > 0:
        signaled[signal_every - 1::signal_every] = True
    signaled[-1] = True
    if first is None:
        sge_end = np.arange(1, n + 1, dtype=np.int64)
        req_raddr, req_rkey = raddr, rkey
    else:
        sge_end = np.append(first[1:], n)
        req_raddr = raddr[first]
        req_rkey = rkey[first] if isinstance(rkey, np.ndarray) else rkey
    return WrBatch(opcode, req_raddr, _column(req_rkey, count), imms, signaled, sge_end,
                   laddr, _column(llen, n), _column(lkey, n))


_Rows = tuple[np.ndarray, Any, Any, np.ndarray, Any]  # laddr, llen, lkey, raddr, rkey


def _column(value: Any, n: int) -> np.ndarray:
    return value if isinstance(value, np.ndarray) else np.full(n, value, dtype=np.int64)


def _uniform_rows(local: Any, remote: Any, local_keys: Mapping[int, MrKey],
                  remote_keys: Mapping[int, MrKey], max_msg_size: int) -> _Rows | None:
    """Addresses of blocks of one length between one local and one remote segment
    (lengths and keys as scalars), or None when that is not known or a check fails."""
    lu, ru = getattr(local, "uniform", None), getattr(remote, "uniform", None)
    if lu is None or ru is None or lu[1] != ru[1]:
        return None
    lmr, rmr = local_keys.get(lu[0]), remote_keys.get(ru[0])
    size = int(lu[1])
    if lmr is None or rmr is None or not 0 < size <= max_msg_size:
        return None
    loff, roff = local.offset, remote.offset
    if (int(loff.min()) < 0 or int(roff.min()) < 0 or int(loff.max()) > lmr.length - size
            or int(roff.max()) > rmr.length - size):
        return None
    return loff + lmr.base, size, lmr.key, roff + rmr.base, rmr.key


def _general_rows(local: Sequence[Any], remote: Sequence[Any],
                  local_keys: Mapping[int, MrKey], remote_keys: Mapping[int, MrKey],
                  max_msg_size: int) -> _Rows | None:
    """Per-row addresses, lengths and keys of rows that pair one local with one remote
    range of the same length, or None (lengths differ, a key unknown, a check fails)."""
    lseg, loff, llen = _columns(local)
    rseg, roff, rlen = _columns(remote)
    if not (llen is rlen or np.array_equal(llen, rlen)):
        return None
    lk, rk = _keys(lseg, local_keys), _keys(rseg, remote_keys)
    if lk is None or rk is None:
        return None
    lbase, lsize, lkey = lk
    rbase, rsize, rkey = rk
    bad = ((llen <= 0) | (loff < 0) | (roff < 0) | (loff + llen > lsize)
           | (roff + llen > rsize) | (llen > max_msg_size))
    if bool(bad.any()):
        return None
    return lbase + loff, llen, lkey, rbase + roff, rkey


def _requests(follows: np.ndarray, laddr: np.ndarray, llen: Any, lkey: Any, max_sge: int,
              max_msg_size: int) -> np.ndarray | None:
    """The first row of each request when rows whose remote ranges continue each other
    share one (at most ``max_sge`` entries), or None where the object builder would do
    otherwise: local ranges that continue each other under one key (one merged entry)
    or a request past ``max_msg_size`` (cut inside a row)."""
    n = len(laddr)
    lengths = _column(llen, n)
    local_follows = follows & (laddr[1:] == laddr[:-1] + lengths[:-1])
    if isinstance(lkey, np.ndarray):
        local_follows &= lkey[1:] == lkey[:-1]
    if bool(local_follows.any()):
        return None
    starts = np.empty(n, dtype=bool)
    starts[0] = True
    np.logical_not(follows, out=starts[1:])
    index = np.arange(n)
    run_start = np.maximum.accumulate(np.where(starts, index, 0))
    starts |= (index - run_start) % max_sge == 0
    first = np.flatnonzero(starts)
    if int(np.add.reduceat(lengths, first).max()) > max_msg_size:
        return None
    return first
