"""The simulated fleet of a run: how many instances, each engine's settings and costs, scale events."""

from __future__ import annotations

import math
import re
from collections.abc import Sequence

import attrs
import click

from kvroute.errors import ConfigError
from kvroute.settings import setting
from kvroute.slo import Objectives
from kvroute.validators import integer, non_negative_number, optional, positive_integer, positive_number
from kvroute.warmup import SlowStart
from kvroute_simulator.bound import reused_blocks
from kvroute_simulator.engine_config import CostModel, EngineConfig
from kvroute_simulator.sequences import EngineRequest

__all__ = ["ScaleEvent", "SimulationConfig", "parse_scale"]

_SCALE_ITEM = re.compile(r"^\s*(?P<time>\d+(?:\.\d+)?)\s*(?P<unit>ms|s|m|h)?\s*:\s*(?P<delta>[+-]\d+)\s*$")
_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, None: 1.0}


@attrs.frozen
class ScaleEvent:
    """At ``time`` seconds, add (``delta`` > 0) or remove (``delta`` < 0) instances."""

    time: float
    delta: int


def parse_scale(spec: str) -> tuple[ScaleEvent, ...]:
    """Parse ``"300s:+1,600s:-2"`` (units ms, s, m, h; seconds by default) into scale events."""
    events = []
    for item in filter(None, (part.strip() for part in spec.split(","))):
        match = _SCALE_ITEM.match(item)
        if match is None or int(match["delta"]) == 0:
            raise ConfigError(
                f"'scale' items must look like TIME:+N or TIME:-N, for example 300s:+1 or 10m:-2 (got {item!r})."
            )
        events.append(ScaleEvent(float(match["time"]) * _UNITS[match["unit"]], int(match["delta"])))
    return tuple(sorted(events, key=lambda e: e.time))


@attrs.frozen(kw_only=True)
class SimulationConfig:
    """The simulated fleet: how many instances, each engine's settings and costs, scale events."""

    instances: int = setting(
        7,
        positive_integer,
        flag="--instances",
        short="-n",
        click_type=click.IntRange(1, 4096),
        help="Instances in the fleet.",
    )
    engine: EngineConfig = attrs.field(factory=EngineConfig)
    cost: CostModel = attrs.field(factory=CostModel)
    scale: tuple[ScaleEvent, ...] = ()
    #: Seed given to strategies that take a ``seed`` option (unless the options set one).
    seed: int = setting(0, flag="--seed", help="Seed of the workload and of seeded strategies.")
    #: Send a conversation's next turn ``think_time`` after the previous one finished.
    closed_loop: bool = True
    #: Width in seconds of the windows of the hit-rate and load time series.
    sample_interval: float = attrs.field(default=10.0, validator=positive_number)
    #: Warm join: ramp each instance a scale event adds from a tenth of its weight to all of it (Envoy's slow start).
    slow_start: SlowStart | None = None
    #: Warm join: before an added instance takes traffic, pre-fill it with this many of the hottest prefixes it owns.
    prefill: int = setting(
        0,
        integer,
        flag="--prefill",
        metavar="N",
        click_type=click.IntRange(min=0),
        help="Warm join: before an added instance takes traffic, pre-fill it with the N hottest prefixes it will own.",
    )
    #: Pre-fill requests in flight at once on the joining instance (the rate bound).
    prefill_concurrency: int = attrs.field(default=2, validator=positive_integer)
    #: Seconds after a join over which its figures are measured (:class:`~kvroute_simulator.results.JoinResult`).
    join_window: float = attrs.field(default=60.0, validator=positive_number)
    #: The working set over the fleet's KV capacity this fleet was sized for (:meth:`sized_for`), if any.
    working_set: float | None = attrs.field(default=None, validator=optional(positive_number))
    #: The router keeps sessions (`kvroute.sessions`, in simulated time), as ``kvroute serve`` does by default.
    sessions: bool = setting(
        False,
        flag="--sessions",
        help="The router keeps sessions and conversations on their backend (kvroute.sessions), as kvroute serve does.",
    )
    #: Every request's latency objectives (``--slo``): goodput and attainment are counted against them, and
    #: an SLO-aware router (a strategy named ``NAME+slo``) routes on them.
    slo: Objectives | None = None
    #: Arrival times are multiplied by this (``--load``: 0.5 brings requests twice as fast; 0: all at once).
    time_scale: float = attrs.field(default=1.0, validator=non_negative_number)
    #: The offered load this fleet runs at, as a multiple of its measured capacity (``--load``), if any.
    load: float | None = attrs.field(default=None, validator=optional(positive_number))
    #: The capacity (requests/s) ``load`` is a multiple of, when measured.
    capacity: float | None = attrs.field(default=None, validator=optional(positive_number))
    #: How instances are named: a pattern with ``{index}`` (0, 1, ... in the order they join), e.g.
    #: ``"e{index}"`` or ``"http://10.0.0.{index}:8000"``. Hash placement depends on the names, so a
    #: sweep over patterns shows how much a strategy's figures owe to the luck of the names.
    backend_names: str = attrs.field(default="i{index}")

    @backend_names.validator
    def _check_names(self, _attribute: object, value: object) -> None:
        try:
            names = {value.format(index=0), value.format(index=1)} if isinstance(value, str) else set()
        except (KeyError, IndexError, ValueError):
            names = set()
        if len(names) != 2 or "{index}" not in str(value):
            raise ConfigError(f"'backend_names' must be a pattern with {{index}}, like 'e{{index}}' (got {value!r}).")

    @property
    def fleet_blocks(self) -> int:
        """KV blocks of the instances present at the start, together (every data-parallel rank's)."""
        return self.instances * self.engine.data_parallel_size * self.engine.capacity_blocks

    def sized_for(self, requests: Sequence[EngineRequest], working_set: float) -> SimulationConfig:
        """Return this fleet with each engine's ``capacity_blocks`` set so the working set is ``working_set`` of it.

        The working set is the distinct blocks an infinite cache would hit at least once
        (:func:`~kvroute_simulator.bound.reused_blocks`: the shared prefixes' blocks); with
        ``working_set=0.8`` they fill 80 % of the instances' KV blocks together, with 1.5 they
        are half as much again as the fleet holds. The engines also need room for what runs,
        so a fleet can lose hits before 1.0. Raises `ConfigError` when no prefix is reused or
        when an engine would be too small for the largest request.
        """
        if not (isinstance(working_set, int | float) and math.isfinite(working_set) and working_set > 0):
            raise ConfigError(f"'working_set' must be a positive number (got {working_set!r}).")
        blocks = reused_blocks(requests, self.engine)
        if blocks == 0:
            raise ConfigError("'working_set' needs a workload whose requests share prefixes (got none reused).")
        capacity = math.ceil(blocks / (working_set * self.instances * self.engine.data_parallel_size))
        size = self.engine.block_size
        largest = max(-(-(len(r.prompt) + r.output_len) // size) for r in requests)
        if capacity < largest:
            raise ConfigError(
                f"'working_set'={working_set:g} would leave {capacity:,} KV blocks per instance ({blocks:,} reused "
                f"blocks over {self.instances} instances), fewer than the largest request needs ({largest:,}); "
                "use a smaller working set, fewer instances or more requests per prefix."
            )
        engine = attrs.evolve(self.engine, capacity_blocks=capacity)
        return attrs.evolve(self, engine=engine, working_set=float(working_set))
