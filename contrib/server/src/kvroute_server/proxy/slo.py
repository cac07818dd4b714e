"""The proxy's side of latency objectives: objectives into each request, observations out of each answer.

`slo_choice` builds the router's latency predictor and SLO-aware choice (`kvroute.SloChoice`) from ``[slo]``
when the SLO-aware choice or admission needs it. `SloHost.apply` sets `RouteRequest.objectives` from the headers
and the configured defaults (`kvroute_server.proxy.objectives`), counting headers it ignored. While a request
holds its lease, `SloHost.first_byte` and `SloHost.stream_done` report what was measured to the predictor
(`Predictor.observe`): the first byte of a stream is its first token (a prefill-rate sample; its prompt leaves
the backend's queue), and the stream's end with ``usage.completion_tokens`` gives its time per output token; the
time from its first byte until its lease is released is how long it held its batch seat. A non-streamed answer
teaches nothing: its first byte comes after the whole generation, and the proxy cannot tell its prefill from its
decode (a TTFT estimated as the whole time less a decode estimate would put that estimate's error into the
prefill rate).
`SloHost.finished` runs once per finished request: it compares the TTFT predicted when the request was routed
(`Decision.prediction`) with the one observed, and tells admission (`kvroute_server.proxy.admission`) that a
backend has room again.
"""

from __future__ import annotations

from collections.abc import Iterable

import attrs

from kvroute.errors import ConfigError
from kvroute.predictor import Predictor, Priors
from kvroute.request import RouteRequest
from kvroute.router import Router
from kvroute.slo_choice import SloChoice
from kvroute_server.config import ServerConfig
from kvroute_server.ops.metrics import ProxyMetrics, RequestOutcome
from kvroute_server.ops.shadow import cache_view_factory
from kvroute_server.proxy.admission import Admission, NoAdmission
from kvroute_server.proxy.objectives import IgnoredObjective, ObjectiveReader
from kvroute_server.proxy.relay import Exchange

__all__ = ["SloHost", "slo_choice"]


def slo_choice(config: ServerConfig) -> SloChoice | None:
    """The router's predictor and SLO-aware choice for ``config``; ``None`` when neither it nor admission is on."""
    slo = config.slo
    if not (slo.aware or config.admission.enabled):
        return None
    try:
        priors = Priors(
            prefill_tokens_per_s=slo.prefill_rate,
            ttft_overhead_s=slo.ttft_overhead,
            decode_step_s=slo.decode_step,
            decode_load_weight=slo.decode_load_weight,
            seats=slo.seats,
        )
        return SloChoice(
            Predictor(priors),
            aware=slo.aware,
            tpot_weight=slo.tpot_weight,
            unmet=slo.unmet,
            view=cache_view_factory(config)() if config.cache_view else None,
        )
    except ValueError as exc:
        raise ConfigError(f"[slo]: {exc}") from None


class SloHost:
    """Objectives in (`apply`), observations out (`first_byte`, `stream_done`, `finished`)."""

    def __init__(self, config: ServerConfig, router: Router, metrics: ProxyMetrics) -> None:
        self.reader = ObjectiveReader(config.slo)
        self.router = router
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

    def first_byte(self, request: RouteRequest, ttft_s: float) -> None:
        """A stream's first event arrived ``ttft_s`` after it was sent (call while its lease is held)."""
        predictor = self.router.predictor
        if predictor is not None:
            with self.router.fleet.lock:
                predictor.observe(request.request_id, ttft_s=ttft_s)

    def stream_done(self, request: RouteRequest, ex: Exchange, elapsed_s: float) -> None:
        """A stream ended whole ``elapsed_s`` after it was sent: its time per output token, from its usage."""
        predictor = self.router.predictor
        tokens = ex.usage_completion_tokens
        if predictor is None or ex.ttft is None or tokens is None or tokens < 2:
            return
        with self.router.fleet.lock:
            predictor.observe(request.request_id, tpot_s=max(elapsed_s - ex.ttft, 0.0) / (tokens - 1))

    def finished(self, ex: Exchange) -> None:
        """A request ended: compare its predicted TTFT with the observed one, and wake admission."""
        decision = ex.decision
        prediction = decision.prediction if decision is not None else None
        if prediction is not None and ex.ttft is not None and ex.outcome is RequestOutcome.OK:
            assert decision is not None
            self.metrics.predicted(decision.backend.id, prediction.ttft_s, ex.ttft)
        self.admission.wake()
