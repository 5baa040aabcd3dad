"""Opening broken rails' paths again, in the background.

A rail whose path broke (a NIC link that went down, a queue pair an error left in its
error state) is closed, and its siblings carry on. :class:`Reopener` tries its path again
every ``retry`` seconds on one thread per transport while the peer is still in use, and
hands the new rail over once, for the engine to use in the broken one's place
(``Transport.revived``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

__all__ = ["Reopener"]

log = logging.getLogger(__name__)
R = TypeVar("R")


@dataclass(eq=False)
class _Broken(Generic[R]):
    open: Callable[[], R]  # opens the same path again (raises while it cannot)
    alive: Callable[[], bool]  # whether the rail's peer is still in use
    due: float
    tries: int = 0


class Reopener(Generic[R]):
    """Opens broken rails' paths again on one background thread, each every ``retry``
    seconds (at most ``max_tries`` times) while its ``alive`` says so; :meth:`revived`
    hands over the rail that replaced a broken one."""

    def __init__(self, name: str, retry: float = 1.0, max_tries: int = 600) -> None:
        if not retry > 0:
            raise ValueError("retry must be positive")
        self.name = name
        self.retry = retry
        self.max_tries = max_tries
        self.reopened = 0
        self._broken: dict[object, _Broken[R]] = {}
        self._revived: dict[object, R] = {}
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closed = False

    def schedule(self, broken: object, open_again: Callable[[], R],
                 alive: Callable[[], bool], soon: bool = False) -> None:
        """Tries ``open_again`` in ``retry`` seconds, or at once when ``soon`` (also for
        a path already waiting for its next try)."""
        with self._cond:
            if self._closed:
                return
            due = time.monotonic() + (0.0 if soon else self.retry)
            known = self._broken.get(broken)
            if known is not None:
                if soon and known.due > due:
                    known.due = due
                    self._cond.notify()
                return
            self._broken[broken] = _Broken(open_again, alive, due)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, daemon=True,
                                                name=f"te-{self.name}-reopen")
                self._thread.start()
            self._cond.notify()

    def revived(self, broken: object) -> R | None:
        with self._cond:
            return self._revived.pop(broken, None)

    def _run(self) -> None:
        while True:
            with self._cond:
                if self._closed:
                    return
                now = time.monotonic()
                due = [(k, b) for k, b in self._broken.items() if b.due <= now]
                if not due:
                    wait = min((b.due for b in self._broken.values()), default=now + 60)
                    self._cond.wait(max(0.01, wait - now))
                    continue
            for key, broken in due:
                self._try(key, broken)

    def _try(self, key: object, broken: _Broken[R]) -> None:
        rail: R | None = None
        if broken.alive():
            try:
                rail = broken.open()
            except Exception as exc:  # noqa: BLE001 - any failure: try again later
                log.debug("%s: reopening a rail failed: %s", self.name, exc)
        broken.tries += 1
        with self._cond:
            if rail is not None and not self._closed:
                del self._broken[key]
                self._revived[key] = rail
                self.reopened += 1
                return
            if not broken.alive() or broken.tries >= self.max_tries or self._closed:
                self._broken.pop(key, None)
            else:
                broken.due = time.monotonic() + self.retry
        if rail is not None:  # closed meanwhile
            getattr(rail, "close", lambda: None)()

    def close(self) -> None:
        """Stops retrying; rails revived and not taken are the caller's to close."""
        with self._cond:
            self._closed = True
            self._broken.clear()
            self._revived.clear()
            self._cond.notify()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(5)
