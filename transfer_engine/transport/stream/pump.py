"""The process's data-plane threads, shared by every stream rail of every engine in it.

A thread per rail (a sender and a reader) made an engine connected to N peers run about
4N threads, all contending for one GIL. Here the count is fixed whatever the peers:

- one **poller** waits on every watched socket at once (``epoll``, one-shot); what is
  whole in the kernel and needs no wait (a WRITE's answer) it handles itself, the rest
  it hands to a worker;
- a bounded pool of **workers** handles them (answers, requests, and work posted to a
  busy rail, :meth:`Pump.submit`), each free to wait for the rest of its bytes.

A worker that has handled a socket waits on it for the next bytes for a short while
(:data:`LINGER`) unless other work waits (:meth:`Pump.crowded`): a rail that carries
back-to-back requests keeps one thread, as it had before, and pays no hand-off per
request; rails beyond the pool share the workers. A socket is armed only while nobody
handles it, so exactly one thread reads it at a time; sends are serialized by the rail
itself. The pump starts with the first rail or served connection of the process and
stops, leaving no thread or descriptor, when the last one closes; ``$TE_DATA_THREADS``
sets the worker count (default: cores + 2).
"""

from __future__ import annotations

import collections
import logging
import os
import select
import threading
import time
from collections.abc import Callable

from transfer_engine.transport import held

log = logging.getLogger(__name__)

__all__ = ["Pump", "acquire", "release", "in_pump", "worker_count"]

_EVENTS = select.EPOLLIN | select.EPOLLRDHUP | select.EPOLLONESHOT
_WRITABLE = select.EPOLLOUT | select.EPOLLRDHUP | select.EPOLLONESHOT
# seconds a worker waits on a socket it just served for its next bytes (12 ms, which
# would cover the gaps a busy Python thread makes, measured slower when idle)
LINGER = 0.002
STARVED = 0.05  # seconds no worker may take up waiting work before one more starts
SPARE_IDLE = 2.0  # seconds an extra worker stays idle before it ends
_local = threading.local()


def in_pump() -> bool:
    """Whether the calling thread is one of the pump's (a rail queues the work they post
    rather than sending it inline: pump threads serve every rail of the process)."""
    return getattr(_local, "pump", False)


def worker_count() -> int:
    value = os.environ.get("TE_DATA_THREADS", "").strip()
    if value:
        try:
            count = int(value)
        except ValueError:
            raise ValueError(f"TE_DATA_THREADS must be a positive integer, not {value!r}"
                             ) from None
        if count < 1:
            raise ValueError(f"TE_DATA_THREADS must be a positive integer, not {value!r}")
        return count
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return cores + 2


class Pump:
    """A poller thread and ``workers`` worker threads (started on demand, on the CPUs
    the pump was created with).

    A worker may wait on a peer (a send into a full socket, a payload still arriving),
    and that peer may be served by this very pump (two engines of one process): should
    every worker wait so, the work that would free them waits for a worker. Work that
    has waited while no worker took up any work for :data:`STARVED` seconds gets a worker
    more, up to ``4 * workers`` (a busy pool that keeps taking work gets none); those
    extra workers end once idle for :data:`SPARE_IDLE` seconds.
    """

    def __init__(self, workers: int) -> None:
        self.pid = os.getpid()
        self._max = max(1, workers)
        self._limit = 4 * self._max
        self._starved = False  # work waits with every worker busy: the poller watches
        self._taken = time.monotonic()  # when a worker last took up work
        self._epoll = select.epoll()
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._epoll.register(self._wake_r, select.EPOLLIN)
        # sockets a caller reads itself for a while (hold): fd -> when the poller takes
        # them back, and the timer that tells it (never fires while callers keep up)
        self._held: dict[int, float] = {}
        # sockets armed with a time limit (rearm's ``until``): fd -> when the handler runs
        # even though nothing came (a parked request whose peer must keep a pace)
        self._until: dict[int, float] = {}
        self._held_lock = threading.Lock()
        self._timer = held.timer() if held.AVAILABLE else None
        self._timer_at: float | None = None
        if self._timer is not None:
            self._epoll.register(self._timer, select.EPOLLIN)
        # fd -> (handler run on a worker, quick handler run on the poller or None)
        self._handlers: dict[int, tuple[Callable[[], None], Callable[[], bool] | None]] = {}
        # (when queued, job)
        self._jobs: collections.deque[tuple[float, Callable[[], None]]] = collections.deque()
        self._cond = threading.Condition(threading.Lock())
        self._idle = 0
        self._workers = 0
        self._stopping = False
        self.users = 0  # rails and connections holding the pump (see acquire/release)
        try:
            self._cpus: set[int] | None = os.sched_getaffinity(0)
        except (AttributeError, OSError):
            self._cpus = None
        self._poller = threading.Thread(target=self._poll_loop, daemon=True,
                                        name="te-pump-poll")
        self._poller.start()

    # the poller
    def watch(self, fd: int, handler: Callable[[], None],
              quick: Callable[[], bool] | None = None) -> None:
        """Runs ``handler`` on a worker when ``fd`` turns readable; it is then disarmed
        until :meth:`rearm`. ``quick``, if given, runs first on the poller itself and
        must never wait: True if it dealt with the event (and rearmed), False to hand it
        to ``handler``."""
        self._handlers[fd] = (handler, quick)
        self._epoll.register(fd, _EVENTS)

    def rearm(self, fd: int, until: float | None = None, writable: bool = False,
              watch: bool = True) -> None:
        """Watches ``fd`` again (for room to send, if ``writable``); with ``until``
        (``time.monotonic()``), its handler also runs then should nothing have come
        (see :attr:`timed`); not ``watch``: only then."""
        if until is not None and self._timer is not None:
            with self._held_lock:
                self._until[fd] = until
                if self._timer_at is None or until < self._timer_at:
                    self._set_timer(until)
        elif not watch:
            watch = True  # no timer to come back on: the socket's readiness must do
        self._modify(fd, (_WRITABLE if writable else _EVENTS) if watch else 0)

    @property
    def timed(self) -> bool:
        """Whether :meth:`rearm` keeps its ``until`` (the host has the timer for it)."""
        return self._timer is not None

    def quiet(self, fd: int) -> None:
        """Stops watching ``fd`` until :meth:`rearm` (its reader waits on it itself)."""
        self._modify(fd, 0)

    def hold(self, fd: int, grace: float) -> bool:
        """Stops watching ``fd`` for up to ``grace`` seconds: a caller that sent on it
        will read the answer itself (:meth:`unhold`), and the poller, woken for it,
        would only contend for the GIL. Past ``grace`` the poller watches it again. False
        (nothing done) where the host has no timer for it."""
        if self._timer is None:
            return False
        due = time.monotonic() + grace
        with self._held_lock:  # the watch changes under it too: unhold may race us
            self._held[fd] = due
            if self._timer_at is None or due < self._timer_at:
                self._set_timer(due)
            self._modify(fd, 0)
        return True

    def unhold(self, fd: int) -> None:
        """The caller is done with ``fd``: watched again (from before :meth:`hold`)."""
        with self._held_lock:
            if self._held.pop(fd, None) is not None and not self._held and not self._until:
                self._set_timer(None)  # the timer would wake the poller for nothing
            self._modify(fd, _EVENTS)

    def _set_timer(self, due: float | None) -> None:  # holding _held_lock
        if self._timer is None:
            return  # stopped
        self._timer_at = due
        try:
            held.set_timer(self._timer, None if due is None else due - time.monotonic())
        except OSError:
            pass  # closed by stop()

    def _held_due(self) -> None:
        """On the poller: watches again the held sockets whose grace ran out."""
        if self._timer is None:
            return
        try:
            os.read(self._timer, 8)
        except OSError:
            pass
        now = time.monotonic()
        with self._held_lock:
            due = [fd for fd, when in self._held.items() if when <= now]
            for fd in due:
                del self._held[fd]
                self._modify(fd, _EVENTS)
            late = [fd for fd, when in self._until.items() if when <= now]
            for fd in late:
                del self._until[fd]
                self._modify(fd, 0)  # its handler runs now, once
            left = [*self._held.values(), *self._until.values()]
            self._set_timer(min(left) if left else None)
        for fd in late:
            entry = self._handlers.get(fd)
            if entry is not None:
                self.submit(entry[0])

    def _modify(self, fd: int, events: int) -> None:
        # holding the GIL: the call never waits, and giving the GIL up would cost a
        # hand-off to a busy Python thread (transport/held.py)
        try:
            if held.AVAILABLE:
                held.epoll_modify(self._epoll.fileno(), fd, events)
            else:
                self._epoll.modify(fd, events)
        except (OSError, ValueError):
            pass  # forgotten meanwhile: the rail closed

    def forget(self, fd: int) -> None:
        """Stops watching ``fd`` (before it is closed: its number may come back)."""
        with self._held_lock:
            self._held.pop(fd, None)
            self._until.pop(fd, None)
        if self._handlers.pop(fd, None) is not None:
            try:
                self._epoll.unregister(fd)
            except (OSError, ValueError):
                pass

    def crowded(self) -> bool:
        """Whether work waits that no idle worker is about to take: a worker lingering
        on its socket (see the module's notes) should hand it back instead."""
        return len(self._jobs) > self._idle or self._stopping

    def _poll_loop(self) -> None:
        _local.pump = True
        try:
            while not self._stopping:
                try:
                    events = self._epoll.poll(STARVED if self._starved else -1)
                except InterruptedError:
                    continue
                if self._starved:
                    self._relieve()
                for fd, _ in events:
                    if fd == self._wake_r:
                        try:
                            os.read(self._wake_r, 4096)
                        except OSError:
                            pass
                        continue
                    if fd == self._timer:
                        self._held_due()
                        continue
                    entry = self._handlers.get(fd)
                    if entry is None:
                        continue
                    if self._until:
                        with self._held_lock:
                            self._until.pop(fd, None)  # it came in time
                    handler, quick = entry
                    try:
                        if quick is not None and quick():
                            continue
                    except Exception:  # one rail's bug must not stop the others
                        log.exception("data-plane handler failed")
                        continue
                    self.submit(handler)
        finally:
            with self._cond:  # under the lock: stop() writes the pipe under it
                self._epoll.close()
                os.close(self._wake_r)
                os.close(self._wake_w)
                with self._held_lock:
                    if self._timer is not None:
                        os.close(self._timer)
                        self._timer = None

    def _relieve(self) -> None:
        """Starts a worker more if work waits and no worker has taken up any for too
        long (every one waits on a peer)."""
        with self._cond:
            if len(self._jobs) <= self._idle:
                self._starved = False
                return
            now = time.monotonic()
            if (now - max(self._jobs[0][0], self._taken) < STARVED
                    or self._workers >= self._limit or self._stopping):
                return
            name = self._add_worker()
        log.debug("no data-plane worker took up work for %.0f ms: %s started",
                  STARVED * 1e3, name)
        self._start_worker(name)

    # the workers
    def submit(self, job: Callable[[], None]) -> None:
        """Runs ``job`` on a worker (an idle one, else the first to come free)."""
        with self._cond:
            if self._stopping:
                return
            self._jobs.append((time.monotonic(), job))
            if self._idle:
                self._cond.notify()
            # an idle worker notified already may not have woken yet: it takes one job,
            # and more jobs than idle workers need another (or the poller's watch)
            if len(self._jobs) <= self._idle:
                return
            if self._workers >= self._max:
                if not self._starved:  # the poller times the wait from now on
                    self._starved = True
                    try:
                        os.write(self._wake_w, b"x")
                    except OSError:
                        pass
                return
            name = self._add_worker()
        self._start_worker(name)

    def _add_worker(self) -> str:  # holding _cond
        self._workers += 1
        return f"te-pump-work{self._workers}"

    def _start_worker(self, name: str) -> None:
        """Starts a worker counted by :meth:`_add_worker`; should the system refuse a
        thread, the count goes back and the job waits for the workers there are (the
        poller watches for starvation)."""
        try:
            threading.Thread(target=self._work_loop, daemon=True, name=name).start()
        except RuntimeError as exc:  # can't start new thread
            log.warning("data-plane worker not started: %s", exc)
            with self._cond:
                self._workers -= 1
                if not self._jobs or self._starved:
                    return
                self._starved = True
                try:
                    os.write(self._wake_w, b"x")
                except OSError:
                    pass

    def _work_loop(self) -> None:
        _local.pump = True
        if self._cpus is not None:  # not the CPUs of whichever caller started us
            try:
                os.sched_setaffinity(0, self._cpus)
            except OSError:
                pass
        while True:
            with self._cond:
                while not self._jobs and not self._stopping:
                    self._idle += 1
                    spare = self._workers > self._max
                    woken = self._cond.wait(SPARE_IDLE if spare else None)
                    self._idle -= 1
                    if not woken and not self._jobs and self._workers > self._max:
                        self._workers -= 1  # a spare that is no longer needed
                        return
                if self._stopping:
                    self._workers -= 1
                    return
                _, job = self._jobs.popleft()
                self._taken = time.monotonic()
            try:
                job()
            except Exception:  # one rail's bug must not stop the others
                log.exception("data-plane job failed")

    def stop(self) -> None:
        """Ends every thread (without waiting: the caller may be one of them); jobs not
        started are dropped (their rails are closed)."""
        with self._cond:
            if self._stopping:
                return
            self._stopping = True
            self._jobs.clear()
            self._cond.notify_all()
            try:
                os.write(self._wake_w, b"x")
            except OSError:
                pass


_lock = threading.Lock()
_current: Pump | None = None


def current() -> Pump | None:
    """This process's pump while a rail uses it, else None (its threads are gone)."""
    return _current


def acquire() -> Pump:
    """The process's pump, started if needed; pair with :func:`release`."""
    global _current
    with _lock:
        if _current is None or _current.pid != os.getpid():  # none yet, or forked
            _current = Pump(worker_count())
        _current.users += 1
        return _current


def release(pump: Pump) -> None:
    """Gives back one :func:`acquire`; the last one stops the pump."""
    global _current
    with _lock:
        pump.users -= 1
        if pump.users > 0:
            return
        if _current is pump:
            _current = None
    pump.stop()
