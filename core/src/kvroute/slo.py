"""Latency objectives a request carries and the latency the router predicts for it.

These are the value types the host (the proxy, the simulator, an embedder), the router and
the strategies share: `Objectives` says what a request needs (time to first token, time per
output token, and how much it matters), `Prediction` says what a backend is expected to give
it. Reading objectives from headers, learning the rates that make predictions, and holding or
shedding requests that no backend can serve in time are built on top of these.
"""

from __future__ import annotations

from enum import StrEnum

import attrs

__all__ = ["Objectives", "Prediction", "Priority"]


class Priority(StrEnum):
    """How much a request matters when the fleet cannot serve everyone in time."""

    #: Never shed: held or sent even when predicted to miss its objectives.
    CRITICAL = "critical"
    #: The default class.
    STANDARD = "standard"
    #: Shed first.
    SHEDDABLE = "sheddable"


def _positive_or_none(instance: object, attribute: attrs.Attribute[float | None], value: float | None) -> None:
    if value is not None and not value > 0:
        raise ValueError(f"'{attribute.name}' must be a positive number of seconds or None (got {value!r}).")


@attrs.frozen
class Objectives:
    """A request's latency objectives, in seconds; ``None`` means no objective of that kind."""

    ttft_s: float | None = attrs.field(default=None, validator=_positive_or_none)
    tpot_s: float | None = attrs.field(default=None, validator=_positive_or_none)
    priority: Priority = attrs.field(default=Priority.STANDARD, converter=Priority)

    @property
    def any(self) -> bool:
        """True when at least one latency objective is set."""
        return self.ttft_s is not None or self.tpot_s is not None


@attrs.frozen
class Prediction:
    """What one backend is expected to give a request.

    ``stale`` says the backend's telemetry was too old and configured priors were used instead.
    """

    ttft_s: float
    tpot_s: float | None = None
    stale: bool = False

    def meets(self, objectives: Objectives | None) -> bool | None:
        """Whether this prediction meets ``objectives``; ``None`` when there is nothing to meet."""
        if objectives is None or not objectives.any:
            return None
        if objectives.ttft_s is not None and self.ttft_s > objectives.ttft_s:
            return False
        return not (objectives.tpot_s is not None and self.tpot_s is not None and self.tpot_s > objectives.tpot_s)
