"""What every part of the Mooncake ``TransferEngine`` API shares: its state, the
conversion of failures into return codes (:meth:`EngineBase._call`), and its peers:
found through the metadata directory, probed, handshaken on first use and cached."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from transfer_engine.engine import Engine
from transfer_engine.errors import TransferEngineError
from transfer_engine.handle import TransferHandle
from transfer_engine.peer import Peer
from transfer_engine.segment import Segment

from .address_map import AddressMap, remote_map
from .codes import ERR_DNS, Failed, log
from .metadata import Directory, DirectoryError, Location, probe

__all__ = ["EngineBase", "Batch"]

_PROBE_TIMEOUT = 3.0  # seconds for the TCP probe before a first handshake


@dataclass(eq=False)
class Batch:
    """One submitted batch: its handle (None: nothing to move), temporary segments, and
    deadline."""

    handle: TransferHandle | None
    deadline: float
    temps: list[Segment] = field(default_factory=list)


class EngineBase:
    """The state of one Mooncake ``TransferEngine`` and the plumbing its parts share
    (memory in :class:`~.memory.MemoryAPI`, transfers in :class:`~.transfers.TransferAPI`)."""

    def __init__(self) -> None:
        self._engine: Engine | None = None
        self._directory: Directory | None = None
        self._name = ""  # our segment name
        self._lock = threading.RLock()
        self._local: dict[int, Segment] = {}  # base address -> registered segment
        self._local_map = AddressMap()
        self._managed: dict[int, tuple[np.ndarray, int]] = {}  # addr -> (memory, length)
        self._peers: dict[str, Peer] = {}
        self._maps: dict[str, AddressMap] = {}
        self._batches: dict[int, Batch] = {}
        self._batch_ids = itertools.count(1)
        self._timeout = 30.0

    def _need_engine(self) -> Engine:
        if self._engine is None or self._engine.closed:
            raise Failed(-1, "engine not initialised (or closed)")
        return self._engine

    def _call(self, name: str, fn: Callable[..., object], *args: Any) -> int:
        try:
            fn(*args)
            return 0
        except (Failed, TransferEngineError) as exc:
            log.warning("%s: %s", name, exc)
            return exc.code if isinstance(exc, Failed) else -1

    # --- peers ------------------------------------------------------------------------

    def _locate(self, target: str) -> Location:
        """Where ``target``'s handshake listens; fails at once when nobody does."""
        directory = self._directory
        if directory is None:
            raise Failed(-1, "engine not initialised (or closed)")
        try:
            location = directory.lookup(target)
        except DirectoryError as exc:
            raise Failed(exc.code, str(exc)) from None
        code = probe(location, min(_PROBE_TIMEOUT, self._timeout))
        if code == ERR_DNS:
            raise Failed(code, f"{location.host!r} does not resolve")
        if code:
            raise Failed(code, f"nobody listens at {location.host}:{location.port}")
        return location

    def _peer(self, target: str) -> Peer:
        engine = self._need_engine()
        with self._lock:
            peer = self._peers.get(target)
            if peer is not None and peer.lost is None:
                return peer
        location = self._locate(target)
        peer = engine.connect(location.endpoint, timeout=min(self._timeout, 10.0))
        with self._lock:
            if self._peers.get(target) is not peer:
                self._peers[target] = peer
                self._maps[target] = remote_map(peer)
        return peer

    def send_probe(self, peer_server_name: str) -> int:
        """0 when the peer answers; -101 its host does not resolve, -102 refused, -200
        not in the metadata server, -1 otherwise."""
        def run() -> None:
            self._need_engine()
            self._locate(peer_server_name)
            self._peer(peer_server_name).refresh()
        return self._call("send_probe", run)

    def warmup_efa_segment(self, segment_name: str) -> int:
        """Opens the connection to ``segment_name`` ahead of the first transfer. 0, or
        -1 when the peer cannot be reached (Mooncake builds without EFA always say 0)."""
        ret = self._call("warmup_efa_segment", self._peer, segment_name)
        return 0 if ret == 0 else -1
