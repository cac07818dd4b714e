"""The proxy's side of latency objectives: objectives into each request, observations out of each answer.

`SloHost.apply` sets `RouteRequest.objectives` from the headers and the configured defaults
(`kvroute_server.proxy.objectives`), counting headers it ignored. `SloHost.finished` runs once per finished
request: it compares the TTFT predicted when the request was routed (`Decision.prediction`) with the one
observed (the first byte of a stream), and tells admission (`kvroute_server.proxy.admission`) that a backend
has room again.
"""

from __future__ import annotations

from collections.abc import Iterable

import attrs

from kvroute.request import RouteRequest
from kvroute.router import Router
from kvroute_server.config import ServerConfig
from kvroute_server.ops.metrics import ProxyMetrics, RequestOutcome
from kvroute_server.proxy.admission import Admission, NoAdmission
from kvroute_server.proxy.objectives import IgnoredObjective, ObjectiveReader
from kvroute_server.proxy.relay import Exchange

__all__ = ["SloHost"]


class SloHost:
    """Objectives in (`apply`), observations out (`finished`)."""

    def __init__(self, config: ServerConfig, router: Router, metrics: ProxyMetrics) -> None:
        self.reader = ObjectiveReader(config.slo)
        self.metrics = metrics.slo
        self.admission: Admission | NoAdmission = Admission.create(
            config.admission, router, metrics, retry_after_s=config.retry_after_s
        )

    def apply(self, request: RouteRequest, headers: Iterable[tuple[bytes, bytes]]) -> RouteRequest:
        """``request`` with its objectives set (the same object when it has none)."""
        ignored: list[IgnoredObjective] = []
        objectives = self.reader.read(headers, request.model, ignored)
        for reason in ignored:
            self.metrics.ignored(reason)
        if objectives is None:
            return request
        return attrs.evolve(request, objectives=objectives)

    def finished(self, ex: Exchange) -> None:
        """A request ended: compare its predicted TTFT with the observed one, and wake admission."""
        decision = ex.decision
        prediction = decision.prediction if decision is not None else None
        if prediction is not None and ex.ttft is not None and ex.outcome is RequestOutcome.OK:
            assert decision is not None
            self.metrics.predicted(decision.backend.id, prediction.ttft_s, ex.ttft)
        self.admission.finished()
