"""The proxy's Prometheus metrics (prometheus-client), one registry per app.

Per-request costs are kept to a few label lookups on cached children; gauges that mirror
fleet state (in flight, healthy, draining) are read from the fleet at scrape time.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from kvroute.fleet import Fleet

__all__ = ["CONTENT_TYPE", "ProxyMetrics"]

CONTENT_TYPE = b"text/plain; version=0.0.4; charset=utf-8"

_DECISION_BUCKETS = (1e-6, 2.5e-6, 5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 1e-2)
_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_DURATION_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class _FleetCollector(Collector):
    def __init__(self, fleet: Fleet) -> None:
        self._fleet = fleet

    def collect(self) -> Iterator[GaugeMetricFamily]:
        in_flight = GaugeMetricFamily("kvroute_in_flight", "Requests in flight per backend.", labels=["backend"])
        healthy = GaugeMetricFamily("kvroute_backend_healthy", "1 when the backend passes health checks.", labels=["backend"])
        draining = GaugeMetricFamily("kvroute_backend_draining", "1 while the backend is draining.", labels=["backend"])
        for state in self._fleet:
            in_flight.add_metric([state.id], state.in_flight)
            healthy.add_metric([state.id], 1.0 if state.healthy else 0.0)
            draining.add_metric([state.id], 1.0 if state.draining else 0.0)
        yield in_flight
        yield healthy
        yield draining


class ProxyMetrics:
    """Every metric the proxy exports (names documented in docs/serve.md)."""

    def __init__(self, fleet: Fleet, strategy: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.strategy = strategy
        r = self.registry
        self.requests = Counter(
            "kvroute_requests", "Proxied requests by backend, strategy and outcome.", ["backend", "strategy", "outcome"], registry=r
        )
        self.decision_seconds = Histogram(
            "kvroute_routing_decision_seconds", "Time the strategy took to pick a backend.", ["strategy"],
            buckets=_DECISION_BUCKETS, registry=r,
        )
        self.spills = Counter(
            "kvroute_spills", "Requests sent away from their home backend, by reason.", ["strategy", "reason"], registry=r
        )
        self.ttft = Histogram(
            "kvroute_upstream_ttft_seconds",
            "From sending a streamed request upstream to its first body chunk.",
            ["backend"], buckets=_TTFT_BUCKETS, registry=r,
        )
        self.duration = Histogram(
            "kvroute_request_duration_seconds", "Whole request duration as the proxy saw it.", ["backend"],
            buckets=_DURATION_BUCKETS, registry=r,
        )
        self.retries = Counter(
            "kvroute_retries", "Attempts retried on another backend, by the failed backend and reason.", ["backend", "reason"],
            registry=r,
        )
        self.ejections = Counter(
            "kvroute_ejections", "Backends ejected, by cause (probe or passive).", ["backend", "cause"], registry=r
        )
        self.restorations = Counter(
            "kvroute_restorations", "Ejected backends restored by passing probes.", ["backend"], registry=r
        )
        self.prompt_tokens = Counter(
            "kvroute_prompt_tokens", "Prompt tokens reported by backends in usage.", ["backend"], registry=r
        )
        self.cached_tokens = Counter(
            "kvroute_prompt_tokens_cached",
            "Prompt tokens the backend served from its prefix cache (usage.prompt_tokens_details.cached_tokens).",
            ["backend"], registry=r,
        )
        self.rejected = Counter(
            "kvroute_rejected_requests", "Requests answered by the proxy itself with an error, by status.", ["status"],
            registry=r,
        )
        r.register(_FleetCollector(fleet))
        self._decision = self.decision_seconds.labels(strategy)
        self._children: dict[tuple[object, ...], Any] = {}

    def child(self, metric: Any, *labels: str) -> Any:
        """``metric.labels(*labels)``, cached: prometheus-client's lookup costs microseconds per call."""
        key = (metric, *labels)
        found = self._children.get(key)
        if found is None:
            found = self._children[key] = metric.labels(*labels)
        return found

    def observe_decision(self, seconds: float) -> None:
        self._decision.observe(seconds)

    def request_done(self, backend: str, outcome: str, duration: float | None) -> None:
        self.child(self.requests, backend, self.strategy, outcome).inc()
        if duration is not None:
            self.child(self.duration, backend).observe(duration)

    def render(self) -> bytes:
        return generate_latest(self.registry)
