"""Which keys the cluster store holds: the one question a scheduler asks.

:class:`Lookup` asks the master and nothing else (no engine, no memory);
:class:`~kvstore.client.Client` asks the same way (:func:`query`), and both answer how
many leading blocks of a chain are stored (:func:`leading`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import numpy as np
import numpy.typing as npt

from kvstore.client_state import expect
from kvstore.errors import StoreError
from kvstore.keys import key_rows
from kvstore.link import MasterLink
from kvstore.protocol import MAX_BATCH, KvFound, KvQuery, Status, column
from transfer_engine.closeable import Closeable
from transfer_engine.control.auth import AuthConfig
from transfer_engine.control.messages import Message

__all__ = ["Lookup", "query", "leading"]


def query(keys: object, request: Callable[[Message], Message],
           release: Callable[[], bytes]) -> npt.NDArray[np.bool_]:
    """Which ``keys`` are stored: one master request per ``MAX_BATCH`` keys."""
    rows = key_rows(keys)
    out = np.zeros(rows.shape[0], dtype=bool)
    for s in range(0, rows.shape[0], MAX_BATCH):
        reply = request(KvQuery(keys=rows[s:s + MAX_BATCH].tobytes(), release=release()))
        reply = expect(reply, KvFound)
        st = column(reply.status, "<i1", min(MAX_BATCH, rows.shape[0] - s), "status")
        out[s:s + MAX_BATCH] = st == Status.OK
    return out


def leading(found: npt.NDArray[np.bool_]) -> int:
    miss = np.flatnonzero(~found)
    return int(miss[0]) if miss.size else int(found.size)


class Lookup(Closeable):
    """Asks the master which keys are stored, and nothing else: no engine, no memory.

    For a process that only decides what to load (a vLLM scheduler): a :class:`Client`
    would start an engine it never uses.

    Parameters:
        master: the master's endpoint.
        timeout: seconds for a master request.
        auth: control-message signing, as for :class:`Client`.
    """

    def __init__(self, master: str, *, timeout: float = 10.0,
                 auth: AuthConfig | str | bytes | None = None) -> None:
        self._closed = True
        if not isinstance(auth, AuthConfig):
            auth = AuthConfig(secret=auth) if auth is not None else AuthConfig.from_env()
        self.timeout = timeout
        self._link = MasterLink(master, auth.signer())
        self._lock = threading.Lock()
        self._closed = False

    def __repr__(self) -> str:
        return f"<Lookup master={self._link.address} {'CLOSED' if self._closed else 'OPEN'}>"

    def _request(self, msg: Message) -> Message:
        if self._closed:
            raise StoreError("the lookup is closed")
        return self._link.request(msg, self.timeout)

    def batch_exists(self, keys: object) -> npt.NDArray[np.bool_]:
        with self._lock:
            return query(keys, self._request, lambda: b"")

    def longest_prefix(self, block_hashes: object) -> int:
        """As :meth:`Client.longest_prefix`."""
        return leading(self.batch_exists(block_hashes))

    def close(self) -> None:
        with self._lock:
            if not self._closed:
                self._closed = True
                self._link.close()
