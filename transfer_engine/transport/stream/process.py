"""The application's side of a serving process (``serve="process"`` of the tcp and shm
transports).

Why a process: a thread of ours inside the application must win the GIL back after
every wait for a peer, and a busy application thread holds it for up to the switch
interval (5 ms) each time (docs/data-plane.md). The serving process has a GIL of its
own: the bytes of peers' WRITEs and READs move between its sockets and the
application's memory (shared in place, see :mod:`.shared`) while the application runs.
What still needs the application: a rail's opening (its tickets), and the immediates,
which arrive here in order on one thread, after their bytes.

If the serving process dies, its rails drop (initiators see their transfers fail), this
side logs it once and starts it again on the same address with every registered
segment, so that peers' next rails reach it; the engine's own transfers to other peers
are unaffected.
"""

from __future__ import annotations

import logging
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from transfer_engine.errors import ClosedError, TransferError
from transfer_engine.segment import Segment
from transfer_engine.transport.base import Host, Immediate
from transfer_engine.transport.stream import shared
from transfer_engine.transport.stream.channel import Channel, ChannelClosed

log = logging.getLogger(__name__)
START_TIMEOUT = 60.0  # seconds for the process to start (imports on a loaded host)
CALL_TIMEOUT = 10.0
_ROOT = str(Path(__file__).resolve().parents[3])  # the folder holding transfer_engine
_BOOT = ("import sys; sys.path.insert(0, sys.argv[1]); "
         "from transfer_engine.transport.stream.worker import main; main()")


def serve_mode(serve: str | None) -> str:
    """``serve`` as given, else ``$TE_SERVE``, else ``"thread"``; ValueError if unknown."""
    mode = serve or os.environ.get("TE_SERVE") or "thread"
    if mode not in ("thread", "process"):
        raise ValueError(f"serve must be 'thread' or 'process', not {mode!r}")
    return mode


class ServeProcess:
    """Starts the serving process of transport ``kind`` (``"tcp"`` or ``"shm"``) on
    ``listener``, bound and not yet listening: the serving process listens, so that a
    unix socket's peers see its credentials (shm initiators let that process copy).
    The serving process owns the listener from then on (if it cannot start, raises
    ``ClosedError`` and the listener stays the caller's). Relays what it asks of
    ``host``; closed by its transport. One that dies (killed, crashed, or hung and
    killed) is started again on a listener from ``rebind`` (the same address), with
    every segment registered, at most :attr:`RESPAWNS` times in
    :attr:`RESPAWN_WINDOW` seconds."""

    PULSE = 2.0  # seconds between pings
    HUNG_AFTER = 2 * CALL_TIMEOUT  # no answer for this long: the process is killed
    RESPAWNS = 3
    RESPAWN_WINDOW = 60.0

    def __init__(self, kind: str, listener: socket.socket, host: Host, *,
                 stall_timeout: float, buffer_bytes: int = 0,
                 congestion: str | None = None,
                 rebind: Callable[[], socket.socket] | None = None) -> None:
        self.kind = kind
        self._host = host
        self._hello = {"kind": kind, "name": host.name, "host_id": host.host_id,
                       "buffer_bytes": buffer_bytes, "congestion": congestion,
                       "stall": stall_timeout}
        self._rebind = rebind
        self._respawns: list[float] = []  # when it was started again
        self._segments: dict[int, Segment] = {}  # what a new process is told of
        self._registering = threading.RLock()  # registrations and a respawn: one at once
        self._admitted: dict[int, Any] = {}  # admission id -> the host's ticket
        self._next_admission = 0
        self._bodies: dict[int, shared.Body] = {}  # segment id -> its shared pages
        self._lock = threading.Lock()
        self._stopping = threading.Event()  # close() began: nothing to report after it
        self._generation = 0  # which process the link's threads serve
        # immediates go to the engine from a thread of their own, in order: a
        # notification callback may call back here (register, close a segment), which
        # waits for an answer only the link's reader can take
        self._immediates: queue.SimpleQueue[
            tuple[str, Immediate, bytes, int | None, bool] | None] = queue.SimpleQueue()
        self._spawn(listener)
        self._deliverer = threading.Thread(target=self._deliver, daemon=True,
                                           name=f"te-{kind}-serve-notify")
        self._deliverer.start()

    def _spawn(self, listener: socket.socket) -> None:
        """Starts a serving process on ``listener`` and the threads of its link."""
        kind = self.kind
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        mem: int | None = None
        try:
            mem = os.open("/proc/self/mem", os.O_RDWR | os.O_CLOEXEC)
            fds = (theirs.fileno(), listener.fileno(), mem)
            env = {**os.environ, "TE_SERVE_FDS": ",".join(map(str, fds)),
                   "TE_SERVE_PARENT": str(os.getpid())}
            proc = subprocess.Popen([sys.executable, "-c", _BOOT, _ROOT], env=env,
                                    pass_fds=fds, stdin=subprocess.DEVNULL,
                                    start_new_session=False)
        except OSError as exc:
            ours.close()
            raise ClosedError(f"{kind} serving process did not start: {exc}",
                              transport=kind) from None
        finally:
            theirs.close()
            if mem is not None:
                os.close(mem)
        chan = Channel(ours)
        try:
            chan.send(self._hello)
            ours.settimeout(START_TIMEOUT)
            ready, _ = chan.recv()
            ours.settimeout(None)
            if ready.get("op") != "ready":
                raise ChannelClosed(f"unexpected {ready!r}")
        except (ChannelClosed, OSError) as exc:
            _kill(proc)
            chan.close()
            raise ClosedError(f"{kind} serving process did not start: {exc}",
                              transport=kind) from None
        listener.close()  # the serving process holds it now; on failure it stays ours
        with self._lock:
            self._proc, self._chan = proc, chan
            self.pid = int(ready["pid"])
            self._dead = False
            self._hung = False  # killed for answering no ping (_watch)
            self._generation += 1
            generation = self._generation
        self._reader = threading.Thread(target=self._read, args=(chan, generation),
                                        daemon=True, name=f"te-{kind}-serve-link")
        self._reader.start()
        self._pulse = threading.Thread(target=self._watch, args=(proc, generation),
                                       daemon=True, name=f"te-{kind}-serve-pulse")
        self._pulse.start()

    # --- what the serving process asks ------------------------------------------------

    def _read(self, chan: Channel, generation: int) -> None:
        reason = "link closed"
        try:
            while True:
                msg, fds = chan.recv()
                for fd in fds:
                    os.close(fd)
                if chan.answer(msg):
                    continue
                op = msg.get("op")
                if op == "imm":
                    self._immediates.put((msg["peer"], Immediate(
                        msg["transfer"], msg["expected"], msg["notify"], msg.get("first")),
                        msg["origin"], msg.get("work"), bool(msg.get("resent"))))
                elif op == "admit":
                    self._admit(chan, msg)
                elif op == "release":
                    with self._lock:
                        ticket = self._admitted.pop(msg["admission"], None)
                    if ticket is not None:
                        ticket.release()
        except ChannelClosed as exc:
            reason = str(exc)
        except Exception as exc:
            log.exception("serving process link failed")
            reason = repr(exc)
        finally:
            self._gone(reason, generation)

    def _watch(self, proc: subprocess.Popen[bytes], generation: int) -> None:
        """Pings the serving process every :attr:`PULSE` seconds. One that answers
        nothing for :attr:`HUNG_AFTER` seconds (stopped, or hung) is killed: its peers'
        transfers then fail at once, where they would wait for it for ever, since
        this process still answers their control probes."""
        while not self._stopping.wait(self.PULSE) and self._generation == generation:
            try:
                self._call({"op": "ping"}, timeout=self.HUNG_AFTER)
            except ClosedError as exc:
                if (self._stopping.is_set() or self._generation != generation
                        or self._dead or proc.poll() is not None or sys.is_finalizing()):
                    return  # closed, or it exited (the link's reader tells)
                log.error("%s serving process answered nothing for %gs (%s): killing "
                          "it; peers' rails to this engine are down", self.kind,
                          self.HUNG_AFTER, exc)
                self._hung = True  # said once, here
                _kill(proc)
                return

    def _deliver(self) -> None:
        while (item := self._immediates.get()) is not None:
            try:
                self._host.deliver_immediate(*item)
            except Exception:
                log.exception("immediate from %s not delivered", item[0])

    def _admit(self, chan: Channel, msg: dict[str, Any]) -> None:
        try:
            ticket, proof = self._host.admit_rail(msg["ticket"], msg["transport"],
                                                  msg["challenge"], msg["nonce"],
                                                  msg["proof"])
        except TransferError:
            chan.send({"re": msg["id"], "ok": False})
            return
        with self._lock:
            self._next_admission += 1
            admission = self._next_admission
            self._admitted[admission] = ticket
        chan.send({"re": msg["id"], "ok": True, "admission": admission,
                         "ticket": ticket.id, "peer": ticket.peer, "pid": ticket.pid,
                         "proof": proof})

    def _gone(self, reason: str, generation: int) -> None:
        with self._lock:
            was_dead, self._dead = self._dead, True
            admitted = list(self._admitted.values())
            self._admitted.clear()
            proc, chan = self._proc, self._chan
        for ticket in admitted:
            ticket.release()
        if not was_dead and not self._stopping.is_set() and not self._hung:
            try:  # a killed process's link closes before it can be reaped
                code: int | None = proc.wait(timeout=1)
            except subprocess.TimeoutExpired:
                code = None
            if code is None:  # the link failed, not the process: it exits without it
                log.error("%s serving process link failed (%s): peers' rails to this "
                          "engine are down", self.kind, reason)
            elif code != 0:
                log.error("%s serving process exited (%s): peers' rails to this engine "
                          "are down", self.kind, _describe(code))
        chan.close()
        if not self._stopping.is_set() and self._respawn(proc):
            return
        self._immediates.put(None)  # after every immediate that arrived

    def _respawn(self, proc: subprocess.Popen[bytes]) -> bool:
        """Starts the serving process again after ``proc`` died, on the same address and
        with every registered segment: peers' next rails reach it. False where it
        stays down (closing, no ``rebind``, or too many deaths lately)."""
        if self._rebind is None:
            return False
        now = time.monotonic()
        self._respawns = [t for t in self._respawns if now - t < self.RESPAWN_WINDOW]
        if len(self._respawns) >= self.RESPAWNS:
            log.error("%s serving process died %d times in %gs: it stays down, and "
                      "peers' rails to this engine are refused", self.kind,
                      len(self._respawns) + 1, self.RESPAWN_WINDOW)
            return False
        self._respawns.append(now)
        while not self._registering.acquire(timeout=0.1):
            if self._stopping.is_set():
                return False
        try:
            if self._stopping.is_set():
                return False
            _kill(proc)  # a link that failed leaves it running
            try:
                self._spawn(self._rebind())
            except (OSError, ClosedError) as exc:
                log.error("%s serving process not started again: %s", self.kind, exc)
                return False
            lost = []
            for seg in list(self._segments.values()):
                try:
                    self._share(seg)
                except (ClosedError, OSError) as exc:
                    lost.append(f"{seg.name}: {exc}")
            log.warning("%s serving process started again (pid %d) with %d segments%s",
                        self.kind, self.pid, len(self._segments) - len(lost),
                        f"; not served: {lost}" if lost else "")
            return True
        finally:
            self._registering.release()

    # --- what the transport tells it --------------------------------------------------

    @property
    def alive(self) -> bool:
        """Whether the serving process can still answer: at interpreter exit the link's
        reader (a daemon thread) no longer runs, so nothing it would answer can be
        waited for."""
        return (not self._dead and self._proc.poll() is None
                and not sys.is_finalizing() and self._reader.is_alive())

    def _call(self, msg: dict[str, Any], timeout: float = CALL_TIMEOUT,
              fds: tuple[int, ...] = ()) -> dict[str, Any]:
        if not self.alive:
            raise ClosedError(f"{self.kind} serving process is gone", transport=self.kind)
        try:
            return self._chan.call(msg, timeout, fds)
        except (ChannelClosed, TimeoutError) as exc:
            raise ClosedError(f"{self.kind} serving process unreachable: {exc}",
                              transport=self.kind) from None

    def register(self, seg: Segment) -> None:
        """Tells the serving process of ``seg`` (sharing its pages when it can) before
        the engine publishes it."""
        with self._registering:
            self._share(seg)
            self._segments[seg.id] = seg

    def _share(self, seg: Segment) -> None:
        body = shared.share_body(seg.address, seg.length) if seg.device == "cpu" else None
        msg: dict[str, Any] = {"op": "seg", "seg": seg.id, "name": seg.name,
                               "address": seg.address, "length": seg.length,
                               "device": seg.device, "writable": seg.writable}
        if body is not None:
            msg["body"] = [body.start, body.end, body.fd_offset]
        try:
            self._call(msg, fds=(body.fd,) if body is not None else ())
        except BaseException:
            if body is not None:
                shared.release(body)
            raise
        finally:
            if body is not None:
                os.close(body.fd)
        if body is not None:
            with self._lock:
                old = self._bodies.pop(seg.id, None)
                self._bodies[seg.id] = body
            if old is not None:  # shared again for a new serving process
                shared.release(old)

    def deregister(self, seg: Segment) -> None:
        """Returns once the serving process no longer touches ``seg``."""
        with self._registering:
            self._segments.pop(seg.id, None)
        with self._lock:
            body = self._bodies.pop(seg.id, None)
        try:
            if self.alive:  # the serving process's transfers get close's time too
                wait = 5.0 if seg.close_timeout is None else min(seg.close_timeout, 5.0)
                reply = self._call({"op": "drop", "seg": seg.id, "timeout": wait},
                                   timeout=CALL_TIMEOUT + 2 * wait)
                if not reply.get("ok"):
                    log.warning("segment %s: %s", seg.name, reply.get("error"))
        except ClosedError as exc:
            log.warning("segment %s: %s", seg.name, exc)
        finally:
            if body is not None:
                shared.release(body)

    def revoke(self, seg: Segment) -> None:
        try:
            self._chan.send({"op": "revoke", "seg": seg.id})
        except ChannelClosed:
            pass

    def cut(self, peer: str, timeout: float) -> bool:
        """As :meth:`StreamServer.cut`, in the serving process. True where that process
        is gone (nothing it served can land now)."""
        try:
            return bool(self._call({"op": "cut", "peer": peer, "timeout": timeout},
                                   timeout=CALL_TIMEOUT + timeout).get("ok"))
        except ClosedError:
            return not self.alive

    def stats(self) -> dict[str, Any]:
        if not self.alive:
            return {"bytes_received": 0, "stats": {}}
        return self._call({"op": "stats"})

    def close(self) -> None:
        self._stopping.set()
        with self._registering:  # a respawn under way ends first
            pass
        try:
            self._chan.send({"op": "close"})
        except ChannelClosed:
            pass
        if sys.is_finalizing():  # it exits on its own once the channel closes
            self._chan.close()
            return
        try:
            self._proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            log.warning("%s serving process did not stop; killing it", self.kind)
            _kill(self._proc)
        self._chan.close()
        self._reader.join(timeout=5)
        self._deliverer.join(timeout=5)
        self._pulse.join(timeout=5)
        with self._lock:
            bodies = list(self._bodies.values())
            self._bodies.clear()
        for body in bodies:
            shared.release(body)


def _kill(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=10)


def _describe(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"status {code}"
