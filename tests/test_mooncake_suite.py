"""Mooncake's own transfer-engine Python tests, unchanged, on our engine (P2P handshake,
HTTP metadata server, etcd, redis): see tests/helpers/mooncake_suite.py. Needs a
Mooncake source checkout: ``MOONCAKE_SRC=/path/to/Mooncake``; skipped without one."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from bench.etcd_server import etcd_skip_reason
from tests.helpers import mooncake_suite
from tests.helpers.redis_helpers import redis_skip_reason

SRC = os.environ.get("MOONCAKE_SRC", "")
# Cases allowed to fail here: none (the import-structure cases' mooncake.store and
# BufferPool come from the KV store).
NEEDS_STORE: set[str] = set()

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not SRC or not (Path(SRC) / mooncake_suite.WHEEL_TESTS).is_dir(),
                       reason="set MOONCAKE_SRC to a Mooncake source checkout"),
]


@pytest.mark.parametrize("mode", ["p2p", "http", "etcd", "redis"])
def test_mooncakes_own_tests_pass(mode: str, tmp_path: Path) -> None:
    reason = {"etcd": etcd_skip_reason(), "redis": redis_skip_reason()}.get(mode)
    if reason:
        pytest.skip(reason)
    runner = mooncake_suite.Runner(Path(SRC), mooncake_suite.sys.executable, False,
                                   tmp_path)
    results = mooncake_suite.run_mode(runner, mode)
    assert len(results) == 12
    failed = {r.name for r in results if not r.passed}
    assert failed <= NEEDS_STORE, [(r.name, r.detail) for r in results if not r.passed]
