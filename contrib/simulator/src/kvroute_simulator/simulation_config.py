"""The simulated fleet of a run: how many instances, each engine's settings and costs, scale events."""

from __future__ import annotations

import re

import attrs

from kvroute.errors import ConfigError
from kvroute_simulator._validators import positive_integer, positive_number
from kvroute_simulator.engine_config import CostModel, EngineConfig

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

    instances: int = attrs.field(default=7, validator=positive_integer)
    engine: EngineConfig = attrs.field(factory=EngineConfig)
    cost: CostModel = attrs.field(factory=CostModel)
    scale: tuple[ScaleEvent, ...] = ()
    #: Seed given to strategies that take a ``seed`` option (unless the options set one).
    seed: int = 0
    #: Send a conversation's next turn ``think_time`` after the previous one finished.
    closed_loop: bool = True
    #: Width in seconds of the windows of the hit-rate and load time series.
    sample_interval: float = attrs.field(default=10.0, validator=positive_number)
