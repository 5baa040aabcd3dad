"""Registered host memory shared, in place, with the serving process.

A serving process (see :mod:`.process`) moves a rail's bytes without the application's
GIL, so it needs the application's registered memory in its own address space. The
pages that lie wholly inside a segment are moved, where they are, onto an anonymous
``memfd``: the contents are copied into it and it is mapped over the same addresses
(``MAP_FIXED``), so every pointer, tensor and view the application holds stays valid and
now reads and writes memory the serving process maps too. The fd travels only over the
serving process's private socket pair; no name exists that another process could open.

Only the pages of a chunk that glibc's ``malloc`` mapped for itself are moved (every
large torch tensor, numpy array or buffer: they are ``free``'d by unmapping, so the
moved pages never go back to ``malloc`` for reuse), and never the partial pages at a
segment's two ends: the serving process reaches those few bytes, and every other kind
of memory (the heap, another allocator's, a file mapping), through ``/proc/<pid>/mem``
instead. Heap pages in particular must never be moved: once freed, ``malloc`` would hand
them out again, and a child made with ``fork()`` would then share, and overwrite, the
parent's allocations. Writes another thread makes to a segment
*while it is being registered* may be lost (registration copies it); register memory
before it is in use, as an RDMA registration also expects.

What changes for the application: the moved pages are a shared mapping. A child made
with ``fork()`` afterwards shares them instead of getting copy-on-write pages.
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import os
import threading
from dataclasses import dataclass

PAGE = mmap.PAGESIZE
MIN_SHARED = 64 << 10  # below this the whole segment goes through /proc/<pid>/mem
MOVE_CHUNK = 64 << 20  # bytes copied and remapped at a time (the extra memory it needs)

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                       ctypes.c_int, ctypes.c_long]
_MAP_FAILED = ctypes.c_void_p(-1).value
_MADV_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", 14)
# page tables filled at mmap: both sides map a body populated (see worker.ServedSegment)
MAP_POPULATE = getattr(mmap, "MAP_POPULATE", 0x8000)


@dataclass(frozen=True, slots=True)
class Body:
    """The shared pages of one segment: ``[start, end)`` in the application's address
    space, backed by ``fd`` from ``fd_offset`` on (``fd`` is the caller's to close;
    :func:`release` hands back the record's own)."""

    fd: int
    start: int
    end: int
    fd_offset: int
    inode: int


_lock = threading.Lock()
_open: dict[int, list[int]] = {}  # memfd inode -> [fd, segments using it]
_NAME = "te-serve"


def _maps(start: int, end: int) -> list[tuple[int, int, str, int, int, str]]:
    """(low, high, perms, file offset, inode, path) of this process's mappings that
    overlap ``[start, end)``."""
    out = []
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            lo, hi = (int(v, 16) for v in parts[0].split("-"))
            if hi <= start:
                continue
            if lo >= end:
                break
            out.append((lo, hi, parts[1], int(parts[2], 16), int(parts[4]),
                        parts[5].strip() if len(parts) > 5 else ""))
    return out


def _covers(maps: list[tuple[int, int, str, int, int, str]], start: int, end: int,
            ok: object) -> bool:
    covered = start
    for vma in maps:
        if vma[0] > covered or not ok(vma):  # type: ignore[operator]
            return False
        covered = vma[1]
    return covered >= end


def _private(vma: tuple[int, int, str, int, int, str]) -> bool:
    """Private anonymous read-write memory, or pages moved before for a segment gone
    since (memory the application reuses: nothing else maps that memfd now)."""
    perms, inode, path = vma[2], vma[4], vma[5]
    if perms[:2] != "rw":
        return False
    if perms[3] == "s":
        return path.startswith(f"/memfd:{_NAME}") and inode not in _open
    return inode == 0 and path in ("", "[heap]")


@functools.cache
def _glibc_malloc() -> bool:
    """Whether ``malloc`` here is glibc's (not one preloaded in front of it)."""
    try:
        glibc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    as_int = ctypes.cast(_libc.malloc, ctypes.c_void_p).value
    return as_int is not None and as_int == ctypes.cast(glibc.malloc, ctypes.c_void_p).value


def _mmapped_chunk(address: int, length: int) -> bool:
    """Whether ``[address, address + length)`` lies in a chunk glibc's ``malloc`` mapped
    on its own: its header (just below ``address`` for a segment that starts the
    allocation, or at the start of ``address``'s page for a plain ``malloc``'s) says
    ``IS_MMAPPED`` and covers the range."""
    if not _glibc_malloc():
        return False
    candidates = [address - 16] if address % 16 == 0 else []
    candidates.append(address // PAGE * PAGE)  # malloc's own mapping: header, then data
    for chunk in candidates:
        head = _maps(chunk, chunk + 16)
        if not head or head[0][0] > chunk or head[0][1] < chunk + 16:
            continue
        if not _private(head[0]) or head[0][5]:
            continue  # not plain anonymous memory (the heap, a file, a shared mapping)
        prev = ctypes.c_size_t.from_address(chunk).value
        size = ctypes.c_size_t.from_address(chunk + 8).value
        if chunk % PAGE == 0 and prev:
            continue  # a chunk at a page start is malloc's own mapping: no offset
        if size & 2 and chunk + 16 <= address and address + length <= chunk + (size & ~7):
            return True
    return False


def share_body(address: int, length: int) -> Body | None:
    """Moves the whole pages of ``[address, address + length)`` onto a memfd (see the
    module's notes) and returns them, or None when there are too few or they cannot
    be moved (the serving process then reaches the segment through its mem file).
    Pages moved for a segment still registered are shared again, not moved twice."""
    start = -(-address // PAGE) * PAGE
    end = (address + length) // PAGE * PAGE
    if end - start < MIN_SHARED:
        return None
    with _lock:
        maps = _maps(start, end)
        if maps and maps[0][4] in _open:  # ours, from a segment still registered
            inode, base = maps[0][4], maps[0][3] - maps[0][0]
            if _covers(maps, start, end, lambda v: v[4] == inode and v[2][3] == "s"
                       and v[3] - v[0] == base and _NAME in v[5]):
                entry = _open[inode]
                entry[1] += 1
                return Body(os.dup(entry[0]), start, end, base + start, inode)
            return None
        if not (_covers(maps, start, end, _private) and _mmapped_chunk(address, length)):
            return None
        size = end - start
        fd = os.memfd_create(_NAME, os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, size)
            inode = os.fstat(fd).st_ino
            for at in range(0, size, MOVE_CHUNK):  # at most one chunk held twice
                n = min(MOVE_CHUNK, size - at)
                view = memoryview((ctypes.c_ubyte * n).from_address(start + at)).cast("B")
                done = 0
                while done < n:
                    done += os.pwrite(fd, view[done:], at + done)
                del view
                # populated: the application's next touch of each page (a forward
                # writing KV) would otherwise take a fault on its compute path
                got = _libc.mmap(start + at, n, mmap.PROT_READ | mmap.PROT_WRITE,
                                 mmap.MAP_SHARED | 0x10 | MAP_POPULATE,  # MAP_FIXED
                                 fd, at)
                if got in (None, _MAP_FAILED) or got != start + at:
                    raise OSError(ctypes.get_errno(), "mmap over the segment failed")
                # huge pages where the host lets shared memory have them
                # (/sys/kernel/mm/transparent_hugepage/shmem_enabled: advise or more)
                _libc.madvise(ctypes.c_void_p(start + at), ctypes.c_size_t(n), _MADV_HUGEPAGE)
        except OSError:
            # chunks moved so far stay moved (same bytes, same addresses), unrecorded:
            # a later registration may move them again
            os.close(fd)
            return None
        _open[inode] = [fd, 1]
        return Body(os.dup(fd), start, end, 0, inode)


def release(body: Body) -> None:
    """The segment that ``body`` was shared for is gone: once no other uses the memfd,
    our fd to it closes (the application's mapping alone keeps the pages, and frees
    them with it)."""
    with _lock:
        entry = _open.get(body.inode)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] <= 0:
            del _open[body.inode]
            os.close(entry[0])
