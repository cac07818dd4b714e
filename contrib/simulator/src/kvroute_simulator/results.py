"""The figures of a simulation: per instance, per strategy, and a comparison of strategies."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from kvroute_simulator.simulation_config import ScaleEvent, SimulationConfig

__all__ = ["Comparison", "InstanceResult", "JoinResult", "StrategyResult", "quantile"]


@attrs.frozen
class InstanceResult:
    """One instance's share of a run."""

    id: str
    requests: int
    share: float
    prompt_tokens: int
    hit_tokens: int
    output_tokens: int
    busy_time: float
    preemptions: int
    added_at: float
    removed_at: float | None

    @property
    def hit_rate(self) -> float:
        """Hit tokens over prompt tokens on this instance."""
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


@attrs.frozen
class JoinResult:
    """What one instance's join did to the requests of the window after it (``join_window``, 60 s).

    A request *moved* when its home is the new instance: a dry-run decision of the same
    strategy on the fleet after the join, every member at full weight and idle (for the
    hash strategies, where its prefix key now lives). TTFTs are in seconds; ``all_ttft_mean``
    times ``window_requests`` is the TTFT the window's requests waited in total, so two runs
    over the same arrivals compare what warming cost and saved.
    """

    backend: str
    time: float
    window_requests: int
    moved: int
    moved_ttft_p50: float
    moved_ttft_p90: float
    others_ttft_p90: float
    all_ttft_p90: float
    all_ttft_mean: float
    #: Pre-fill requests sent to the new instance, and when it began taking live traffic.
    warm_requests: int
    serving_from: float


@attrs.frozen
class StrategyResult:
    """The figures of one strategy over one workload (times in seconds)."""

    strategy: str
    options: Mapping[str, Any]
    requests: int
    completed: int
    rejected: int
    #: Rejected requests per reason (an engine's limit, or an empty fleet).
    rejected_reasons: Mapping[str, int]
    ttft_p50: float
    ttft_p90: float
    ttft_p99: float
    ttft_mean: float
    hit_rate: float
    output_tokens: int
    makespan: float
    output_throughput: float
    share_min: float
    share_max: float
    spills: int
    route_cost_p50: float
    route_cost_p99: float
    preemptions: int
    wall_time: float
    instances: tuple[InstanceResult, ...]
    decisions: Mapping[str, int]
    #: (window start s, hit rate in the window, requests in flight per instance id at the window's end)
    timeline: tuple[tuple[float, float, Mapping[str, int]], ...] = attrs.field(repr=False)
    ttfts: tuple[float, ...] = attrs.field(repr=False)
    #: One per instance a scale event added.
    joins: tuple[JoinResult, ...] = ()
    #: Time per output token after the first, over the requests of more than one output token.
    tpot_p50: float = math.nan
    tpot_p99: float = math.nan
    #: With objectives (``--slo``): requests that met both; goodput, those per second of the arrivals' window
    #: (attainment times the offered rate); attainment, their share of every request (rejected ones missed).
    slo_met: int = 0
    goodput: float = math.nan
    attainment: float = math.nan
    #: With an SLO-aware router: median |observed - predicted| TTFT, and the share predicted within 25 %.
    prediction_error_p50: float = math.nan
    predicted_within_25: float = math.nan
    #: Decisions the SLO-aware choice moved off the strategy's pick.
    slo_moved: int = 0

    def to_json(self, *, include_samples: bool = False) -> dict[str, Any]:
        """A JSON-ready dict (TTFT samples only with ``include_samples``)."""
        data = attrs.asdict(self, recurse=True, filter=lambda a, _v: a.name not in ("ttfts", "timeline"))
        data["options"] = dict(self.options)
        data["rejected_reasons"] = dict(self.rejected_reasons)
        data["instances"] = [dict(attrs.asdict(i), hit_rate=i.hit_rate) for i in self.instances]
        data["timeline"] = [{"t": t, "hit_rate": h, "in_flight": dict(f)} for t, h, f in self.timeline]
        if include_samples:
            data["ttfts"] = list(self.ttfts)
        return data


@attrs.frozen
class Comparison:
    """Several strategies over the same arrivals, with the hit-rate upper bound.

    ``prompt_tokens`` and the bound cover the requests the engines accept; ``rejected``
    counts the others (per reason in ``rejected_reasons``), which every strategy sees refused.
    ``pooled_hit_rate`` is the reference of one LRU cache holding the fleet's KV blocks
    together (the instances at the start), fed the same requests.
    """

    workload: str
    requests: int
    prompt_tokens: int
    upper_bound_hit_rate: float
    config: SimulationConfig
    results: tuple[StrategyResult, ...]
    scale: tuple[ScaleEvent, ...] = ()
    rejected: int = 0
    rejected_reasons: Mapping[str, int] = attrs.field(factory=dict)
    pooled_hit_rate: float = math.nan

    def baseline(self, name: str = "random") -> StrategyResult | None:
        """The result of ``name`` if it ran."""
        return next((r for r in self.results if r.strategy == name), None)


def quantile(sorted_values: Sequence[float], q: float) -> float:
    """Linear-interpolation quantile of already sorted values (NaN when empty)."""
    if not sorted_values:
        return math.nan
    pos = q * (len(sorted_values) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)
