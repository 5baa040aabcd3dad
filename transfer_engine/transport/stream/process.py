"""The application's side of a serving process (``serve="process"`` of the tcp and shm
transports).

Why a process: a thread of ours inside the application must win the GIL back after
every wait for a peer, and a busy application thread holds it for up to the switch
interval (5 ms) each time (docs/data-plane.md). The serving process has a GIL of its
own: the bytes of peers' WRITEs and READs move between its sockets and the
application's memory (shared in place, see :mod:`.shared`) while the application runs.
What still needs the application: a rail's opening (its tickets), and the immediates,
which arrive here in order on one thread, after their bytes.

If the serving process dies, its rails drop (initiators see their transfers fail), new
rails are refused (the listening socket died with it), and this side logs it once; the
engine's own transfers to other peers are unaffected.
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
    ``host``; closed by its transport."""

    PULSE = 2.0  # seconds between pings
    HUNG_AFTER = 2 * CALL_TIMEOUT  # no answer for this long: the process is killed

    def __init__(self, kind: str, listener: socket.socket, host: Host, *,
                 stall_timeout: float, buffer_bytes: int = 0,
                 congestion: str | None = None) -> None:
        self.kind = kind
        self._host = host
        self._admitted: dict[int, Any] = {}  # admission id -> the host's ticket
        self._next_admission = 0
        self._bodies: dict[int, shared.Body] = {}  # segment id -> its shared pages
        self._lock = threading.Lock()
        self._dead = False
        self._stopping = threading.Event()  # close() began: nothing to report after it
        self._hung = False  # killed for answering no ping (_watch)
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        mem: int | None = None
        try:
            mem = os.open("/proc/self/mem", os.O_RDWR | os.O_CLOEXEC)
            fds = (theirs.fileno(), listener.fileno(), mem)
            env = {**os.environ, "TE_SERVE_FDS": ",".join(map(str, fds)),
                   "TE_SERVE_PARENT": str(os.getpid())}
            self._proc = subprocess.Popen([sys.executable, "-c", _BOOT, _ROOT], env=env,
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
        self._chan = Channel(ours)
        try:
            self._chan.send({"kind": kind, "name": host.name, "host_id": host.host_id,
                             "buffer_bytes": buffer_bytes, "congestion": congestion,
                             "stall": stall_timeout})
            ours.settimeout(START_TIMEOUT)
            ready, _ = self._chan.recv()
            ours.settimeout(None)
            if ready.get("op") != "ready":
                raise ChannelClosed(f"unexpected {ready!r}")
        except (ChannelClosed, OSError) as exc:
            self._kill()
            self._chan.close()
            raise ClosedError(f"{kind} serving process did not start: {exc}",
                              transport=kind) from None
        listener.close()  # the serving process holds it now; on failure it stays ours
        self.pid = int(ready["pid"])
        # immediates go to the engine from a thread of their own, in order: a
        # notification callback may call back here (register, close a segment), which
        # waits for an answer only the link's reader can take
        self._immediates: queue.SimpleQueue[
            tuple[str, Immediate, bytes, int | None, bool] | None] = queue.SimpleQueue()
        self._deliverer = threading.Thread(target=self._deliver, daemon=True,
                                           name=f"te-{kind}-serve-notify")
        self._deliverer.start()
        self._reader = threading.Thread(target=self._read, daemon=True,
                                        name=f"te-{kind}-serve-link")
        self._reader.start()
        self._pulse = threading.Thread(target=self._watch, daemon=True,
                                       name=f"te-{kind}-serve-pulse")
        self._pulse.start()

    # --- what the serving process asks ------------------------------------------------

    def _read(self) -> None:
        reason = "link closed"
        try:
            while True:
                msg, fds = self._chan.recv()
                for fd in fds:
                    os.close(fd)
                if self._chan.answer(msg):
                    continue
                op = msg.get("op")
                if op == "imm":
                    self._immediates.put((msg["peer"], Immediate(
                        msg["transfer"], msg["expected"], msg["notify"], msg.get("first")),
                        msg["origin"], msg.get("work"), bool(msg.get("resent"))))
                elif op == "admit":
                    self._admit(msg)
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
            self._gone(reason)

    def _watch(self) -> None:
        """Pings the serving process every :attr:`PULSE` seconds. One that answers
        nothing for :attr:`HUNG_AFTER` seconds (stopped, or hung) is killed: its peers'
        transfers then fail at once, where they would wait for it for ever, since
        this process still answers their control probes."""
        while not self._stopping.wait(self.PULSE):
            try:
                self._call({"op": "ping"}, timeout=self.HUNG_AFTER)
            except ClosedError as exc:
                if (self._stopping.is_set() or self._dead
                        or self._proc.poll() is not None or sys.is_finalizing()):
                    return  # closed, or it exited (the link's reader tells)
                log.error("%s serving process answered nothing for %gs (%s): killing "
                          "it; peers' rails to this engine are down", self.kind,
                          self.HUNG_AFTER, exc)
                self._hung = True  # said once, here
                self._kill()
                return

    def _deliver(self) -> None:
        while (item := self._immediates.get()) is not None:
            try:
                self._host.deliver_immediate(*item)
            except Exception:
                log.exception("immediate from %s not delivered", item[0])

    def _admit(self, msg: dict[str, Any]) -> None:
        try:
            ticket, proof = self._host.admit_rail(msg["ticket"], msg["transport"],
                                                  msg["challenge"], msg["nonce"],
                                                  msg["proof"])
        except TransferError:
            self._chan.send({"re": msg["id"], "ok": False})
            return
        with self._lock:
            self._next_admission += 1
            admission = self._next_admission
            self._admitted[admission] = ticket
        self._chan.send({"re": msg["id"], "ok": True, "admission": admission,
                         "ticket": ticket.id, "peer": ticket.peer, "pid": ticket.pid,
                         "proof": proof})

    def _gone(self, reason: str = "link closed") -> None:
        with self._lock:
            was_dead, self._dead = self._dead, True
            admitted = list(self._admitted.values())
            self._admitted.clear()
        for ticket in admitted:
            ticket.release()
        self._immediates.put(None)  # after every immediate that arrived
        if not was_dead and not self._stopping.is_set() and not self._hung:
            code = self._proc.poll()
            if code is None:  # the link failed, not the process: it exits without it
                log.error("%s serving process link failed (%s): peers' rails to this "
                          "engine are down", self.kind, reason)
            elif code != 0:
                log.error("%s serving process exited (%s): peers' rails to this engine "
                          "are down", self.kind, _describe(code))
        self._chan.close()

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
                self._bodies[seg.id] = body

    def deregister(self, seg: Segment) -> None:
        """Returns once the serving process no longer touches ``seg``."""
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

    def stats(self) -> dict[str, Any]:
        if not self.alive:
            return {"bytes_received": 0, "stats": {}}
        return self._call({"op": "stats"})

    def _kill(self) -> None:
        if self._proc.poll() is None:
            self._proc.kill()
        self._proc.wait(timeout=10)

    def close(self) -> None:
        self._stopping.set()
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
            self._kill()
        self._chan.close()
        self._reader.join(timeout=5)
        self._deliverer.join(timeout=5)
        self._pulse.join(timeout=5)
        with self._lock:
            bodies = list(self._bodies.values())
            self._bodies.clear()
        for body in bodies:
            shared.release(body)


def _describe(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"status {code}"
