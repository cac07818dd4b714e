"""Shadow strategies in the proxy: a `kvroute.ShadowSet` fed by the forwarder, counted in the metrics.

Off unless ``--shadow`` / ``[routing] shadow`` names at least one strategy: otherwise `ProxyShadows.create`
returns `NoShadows`, whose methods do nothing, and the forwarder's only cost is one call to it per request.

A request is scored on its first attempt: the live decision, the candidates it was made from (the
same event-loop step, so the same fleet state) and each shadow's pick among them. A request retried
on another backend still counts where its first attempt went. It ends for every shadow when the
live request ends. What each shadow keeps is described in `kvroute.shadow` and docs/serve.md.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Collection

from kvroute.cache_view import CacheView
from kvroute.errors import ConfigError
from kvroute.fleet import Fleet
from kvroute.plugins import PluginManager
from kvroute.request import RouteRequest
from kvroute.shadow import ShadowRound, ShadowSet
from kvroute.strategy import Decision, Outcome, Status
from kvroute_server.config import ServerConfig
from kvroute_server.ops.metrics import ProxyMetrics, RequestOutcome, ShadowMetrics

__all__ = ["NoShadows", "ProxyShadows", "cache_view_factory"]

#: What the shadows are told of a request that ended with each outcome (any other is an error).
_STATUS = {RequestOutcome.OK: Status.OK, RequestOutcome.CANCELLED: Status.CANCELLED}


def cache_view_factory(config: ServerConfig) -> Callable[[], CacheView]:
    """A function making one `CacheView` with ``config.cache_view``'s settings; `ConfigError` if they are invalid."""
    settings = dict(config.cache_view)
    try:
        CacheView(**settings)
    except ValueError as exc:
        raise ConfigError(f"[routing.cache_view]: {exc}") from None
    return functools.partial(CacheView, **settings)


class ProxyShadows:
    """The shadow set of one proxy process and the metrics it feeds."""

    def __init__(self, shadows: ShadowSet, metrics: ShadowMetrics) -> None:
        self.set = shadows
        self.metrics = metrics
        self._candidates = shadows.fleet.candidates

    @classmethod
    def create(
        cls, config: ServerConfig, fleet: Fleet, metrics: ProxyMetrics, plugins: PluginManager
    ) -> ProxyShadows | NoShadows:
        """The shadows ``config`` names, or `NoShadows` when it names none."""
        if not config.shadow:
            return NoShadows()
        shadows = ShadowSet.create(
            fleet,
            config.strategy,
            config.shadow,
            config.shadow_options,
            plugins=plugins,
            view_factory=cache_view_factory(config),
        )
        return cls(shadows, metrics.shadow_metrics(config.strategy, config.shadow))

    def routed(self, request: RouteRequest, decision: Decision, exclude: Collection[str]) -> ShadowRound:
        """Score the live decision and ask every shadow; call right after the lease, before any ``await``."""
        round_ = self.set.routed(request, decision, self._candidates(request.model, exclude))
        self.metrics.observe(round_.verdicts)
        return round_

    def finished(self, round_: ShadowRound, outcome: RequestOutcome, started: float) -> None:
        """The live request ended with ``outcome``; it ends for the shadows too."""
        status = _STATUS.get(outcome, Status.ERROR)
        self.set.finished(round_, Outcome(status, time.perf_counter() - started))

    def close(self) -> None:
        self.set.close()


class NoShadows:
    """No shadow strategy configured: no request is scored."""

    def routed(self, request: RouteRequest, decision: Decision, exclude: Collection[str]) -> None:
        """Score nothing: the request has no shadow round."""

    def finished(self, round_: ShadowRound, outcome: RequestOutcome, started: float) -> None:
        """Nothing to end (never called: no request has a round)."""

    def close(self) -> None:
        """Nothing to close."""
