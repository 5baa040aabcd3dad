"""Fixtures of the SGLang backend's in-process tests: SGLang's modules (or the subset
the backend needs), the backend, and managers with their bootstrap servers, built in
this process and closed after each test. Test modules import the fixtures they use."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tests.helpers import sglang_worker as sw

# short timeouts, loopback only: a test fails in seconds, not minutes
FAST = {"host": "127.0.0.1", "bootstrap_host": "127.0.0.1", "timeout_s": 5.0,
        "heartbeat_s": 0.2, "heartbeat_misses": 2, "bootstrap_timeout_s": 30.0,
        "waiting_timeout_s": 30.0, "register_attempts": 2}


def sglang_mark() -> pytest.MarkDecorator:
    """A module's mark: skip without SGLang's modules, and with ``TE_SGLANG_REQUIRED=1``
    (scripts/test.sh) fail at import instead."""
    reason = sw.skip_reason()
    if reason is not None and os.environ.get("TE_SGLANG_REQUIRED") == "1":
        raise RuntimeError(f"TE_SGLANG_REQUIRED=1 but {reason}")
    return pytest.mark.skipif(reason is not None, reason=reason or "")


def poll_until(conn: Any, states: set[int], timeout: float = 10.0) -> int:
    """A sender's or receiver's poll state once it is one of ``states`` (or the last
    one seen when ``timeout`` ran out)."""
    deadline = time.monotonic() + timeout
    state = conn.poll()
    while state not in states and time.monotonic() < deadline:
        time.sleep(0.005)
        state = conn.poll()
    return int(state)


def failure(conn: Any) -> BaseException:
    """The exception a failed sender or receiver reports."""
    with pytest.raises(Exception) as info:
        conn.failure_exception()
    return info.value


@pytest.fixture(scope="module")
def sg() -> sw.SGLang:
    return sw.load_sglang()


@pytest.fixture(scope="module")
def te(sg: sw.SGLang) -> Any:
    import transfer_engine.connectors.sglang as te

    return te


@pytest.fixture
def ranks(sg: sw.SGLang, te: Any) -> Iterator[Callable[..., Any]]:
    """Builds managers (``ranks(mode, bootstrap_port, ...)``) and bootstrap servers
    (``ranks.server()``) in this process; closes them all."""
    owned: list[Any] = []

    def make(mode: str, port: int = 0, seed: int | None = None,
             spec: sw.PoolSpec | None = None, rank: int = 0, **config: Any) -> Any:
        spec = spec or sw.PoolSpec(layers=2, pages=16)
        kv, aux = sw.build_pool(spec, seed)
        mgr = te.TransferEngineKVManager(
            sw.kv_args(sg, spec, kv, aux, rank), sg.utils.DisaggregationMode(mode),
            sw.server_args(port), False, config=te.SGLangBackendConfig(**{**FAST, **config}))
        mgr.test_pool = (spec, kv, aux)  # registered by raw pointer: must outlive mgr
        owned.append(mgr)
        return mgr

    def server() -> Any:
        srv = te.TransferEngineKVBootstrapServer("127.0.0.1", 0)
        owned.append(srv)
        return srv

    make.server = server  # type: ignore[attr-defined]
    yield make
    for obj in reversed(owned):
        obj.close()
