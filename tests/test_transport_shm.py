from __future__ import annotations

import os
import subprocess
from pathlib import Path

from tests.helpers.transport_contract import TransportContract
from transfer_engine import Engine
from transfer_engine.transport.shm import ShmTransport


class TestShmContract(TransportContract):
    """Same-host transport on its own (no TCP beside it to fall back to)."""

    transports = ["shm"]


def test_a_killed_processs_socket_folder_is_swept(tmp_path: Path) -> None:
    """A process killed outright leaves its socket folder behind: the next shm
    transport started there removes the folders of this user's dead processes, and
    only those."""
    gone = subprocess.Popen(["true"])
    gone.wait()
    dead = tmp_path / f"te-shm-{gone.pid}-abc123"
    dead.mkdir(mode=0o700)
    (dead / "rail.sock").write_bytes(b"")
    alive = tmp_path / f"te-shm-{os.getpid()}-def456"
    alive.mkdir(mode=0o700)
    other = tmp_path / "te-shm-notapid"
    other.mkdir()
    with Engine("sweeper", transports=[ShmTransport(socket_dir=str(tmp_path))]) as engine:
        assert not dead.exists() and alive.exists() and other.exists()
        mine = Path(engine.metadata()["transports"]["shm"]["path"]).parent
        assert mine.name.startswith(f"te-shm-{os.getpid()}-")
    assert not mine.exists()
