"""Engines' numbers for Prometheus: the counters every engine keeps (``Engine.stats``),
its peers and transfers in flight, and a histogram of transfer latency by operation and
transport (:class:`~transfer_engine.latency.Latencies`, which every engine keeps).
:func:`serve_metrics` puts them on an HTTP ``/metrics`` port; prometheus-client is an
optional dependency (``pip install 'transfer-engine[metrics]'``), imported only there.

The port shows counts and timings, never memory, yet it follows the engine's rule: it
serves loopback only, unless clients must present a certificate (mutual TLS).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

from transfer_engine.control.auth import is_loopback
from transfer_engine.latency import BUCKETS

if TYPE_CHECKING:
    from transfer_engine.engine import Engine

class EngineCollector:
    """A prometheus-client collector over live engines (read at each scrape)."""

    def __init__(self, engines: Iterable[Engine]) -> None:
        self.engines = list(engines)

    def describe(self) -> list[Any]:
        return []  # unchecked: the families depend on what the engines have counted

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import (  # noqa: PLC0415
            CounterMetricFamily,
            GaugeMetricFamily,
            HistogramMetricFamily,
        )

        events = CounterMetricFamily(
            "te_engine_events", "what an engine counted: transfers (done, failed, timed "
            "out), bytes read and written, notifications, rails torn down, fallbacks",
            labels=["engine", "event"])
        peers = GaugeMetricFamily("te_engine_peers", "peers an engine knows",
                                  labels=["engine"])
        live = GaugeMetricFamily("te_engine_transfers_in_flight",
                                 "transfers submitted and not finished", labels=["engine"])
        latency = HistogramMetricFamily(
            "te_engine_transfer_seconds", "from a transfer's (last) attempt to its end, "
            "transfers that succeeded", labels=["engine", "op", "transport"])
        for engine in self.engines:
            name = engine.name
            for event, value in sorted(engine.stats.items()):
                events.add_metric([name, event], value)
            peers.add_metric([name], len(engine.peers))
            live.add_metric([name], engine.in_flight)
            for (op, transport), (counts, total) in sorted(
                    engine.latencies.snapshot().items()):
                buckets, running = [], 0
                for bound, count in zip((*map(str, BUCKETS), "+Inf"), counts, strict=True):
                    running += count
                    buckets.append((bound, running))
                latency.add_metric([name, op, transport], buckets, total)
        yield from (events, peers, live, latency)


class MetricsServer:
    """A running ``/metrics`` HTTP server; closing it stops it and frees its port."""

    def __init__(self, server: Any, thread: threading.Thread) -> None:
        self._server = server
        self._thread = thread
        self.host, self.port = server.server_address[:2]

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5.0)

    def __enter__(self) -> MetricsServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def serve_metrics(engines: Engine | Iterable[Engine], host: str = "127.0.0.1",
                  port: int = 0, *, certfile: str | None = None,
                  keyfile: str | None = None, client_cafile: str | None = None
                  ) -> MetricsServer:
    """Serves the engines' metrics at ``http://host:port/metrics`` (``port`` 0: a free
    one, see :attr:`MetricsServer.port`) until closed. A host reachable from other
    machines needs ``certfile``, ``keyfile`` and ``client_cafile``: HTTPS that admits
    only clients with a certificate that CA signed."""
    try:
        import prometheus_client  # noqa: PLC0415
    except ImportError as exc:
        raise ImportError("serving metrics needs prometheus-client: pip install "
                          "'transfer-engine[metrics]' (or prometheus-client)") from exc
    tls = (certfile, keyfile, client_cafile)
    if any(tls) and not all(tls):
        raise ValueError("TLS for metrics needs certfile, keyfile and client_cafile")
    if not is_loopback(host) and not all(tls):
        raise ValueError(f"metrics on {host!r} would be open to other machines: serve "
                         "them on loopback, or give certfile, keyfile and client_cafile "
                         "(mutual TLS)")
    from transfer_engine.engine import Engine  # noqa: PLC0415

    listed = [engines] if isinstance(engines, Engine) else list(engines)
    registry = prometheus_client.CollectorRegistry(auto_describe=False)
    registry.register(EngineCollector(listed))
    server, thread = prometheus_client.start_http_server(
        port, addr=host, registry=registry, certfile=certfile, keyfile=keyfile,
        client_cafile=client_cafile, client_auth_required=all(tls))
    return MetricsServer(server, thread)
