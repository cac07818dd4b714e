"""A request's latency objectives and priority class: read from its headers, else from the configured defaults.

Headers (values in milliseconds, as llm-d spells them): ``x-slo-ttft-ms`` and ``x-slo-tpot-ms``, or llm-d's
``x-llm-d-slo-ttft-ms`` and ``x-llm-d-slo-tpot-ms`` (kvroute's own name wins when both are sent), and
``x-priority`` (``critical``, ``standard``, ``sheddable``). A value that is not a finite number, not positive,
over an hour, given twice, or a priority that is no class is ignored with its reason (`IgnoredObjective`,
counted in ``kvroute_objectives_ignored_total``) and the default stands: a bad header never fails a request.
Defaults come from ``[slo]`` (`kvroute_server.config.SloConfig`): the model's table, then the global values.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from enum import StrEnum
from typing import Any

import attrs

from kvroute.slo import Objectives, Priority
from kvroute_server.config import MAX_OBJECTIVE_MS, SloConfig

__all__ = ["OBJECTIVE_HEADERS", "IgnoredObjective", "ObjectiveReader"]


class IgnoredObjective(StrEnum):
    """Why a header's objective or priority was not used (the ``reason`` of ``kvroute_objectives_ignored_total``)."""

    #: Not a finite decimal number of milliseconds (``abc``, ``NaN``, ``inf``, ``500ms``, empty).
    NOT_A_NUMBER = "not_a_number"
    #: Zero or negative.
    NOT_POSITIVE = "not_positive"
    #: Over an hour (`MAX_OBJECTIVE_MS`): no latency objective, a mistake.
    TOO_LARGE = "too_large"
    #: The same header sent more than once (which one was meant is unknown).
    REPEATED = "repeated"
    #: ``x-priority`` that is not ``critical``, ``standard`` or ``sheddable``.
    UNKNOWN_PRIORITY = "unknown_priority"


_TTFT, _TPOT, _PRIORITY = "ttft", "tpot", "priority"
#: Header (lower-case bytes, as ASGI gives names) -> (what it sets, rank: lower wins when both names are sent).
OBJECTIVE_HEADERS: dict[bytes, tuple[str, int]] = {
    b"x-slo-ttft-ms": (_TTFT, 0),
    b"x-llm-d-slo-ttft-ms": (_TTFT, 1),
    b"x-slo-tpot-ms": (_TPOT, 0),
    b"x-llm-d-slo-tpot-ms": (_TPOT, 1),
    b"x-priority": (_PRIORITY, 0),
}
#: Longest header value looked at: a number of milliseconds is short.
_MAX_VALUE_BYTES = 64


def _milliseconds(raw: bytes) -> float | IgnoredObjective:
    """A header's value as seconds, or why it cannot be one."""
    if len(raw) > _MAX_VALUE_BYTES:
        return IgnoredObjective.NOT_A_NUMBER
    try:
        value = float(raw.decode("ascii").strip())
    except (UnicodeDecodeError, ValueError):
        return IgnoredObjective.NOT_A_NUMBER
    if not math.isfinite(value):
        return IgnoredObjective.NOT_A_NUMBER
    if value <= 0:
        return IgnoredObjective.NOT_POSITIVE
    if value > MAX_OBJECTIVE_MS:
        return IgnoredObjective.TOO_LARGE
    return value / 1000.0


def _default(table: Mapping[str, Any], fallback: Objectives | None) -> Objectives:
    def seconds(key: str, inherited: float | None) -> float | None:
        value = table.get(key)
        return float(value) / 1000.0 if value is not None else inherited

    return Objectives(
        ttft_s=seconds("ttft_ms", fallback.ttft_s if fallback else None),
        tpot_s=seconds("tpot_ms", fallback.tpot_s if fallback else None),
        priority=table.get("priority", fallback.priority if fallback else Priority.STANDARD),
    )


@attrs.define
class ObjectiveReader:
    """Reads each request's `Objectives` from its headers over the configured defaults (see the module)."""

    config: SloConfig = attrs.field(factory=SloConfig)
    _global: Objectives = attrs.field(init=False)
    _models: dict[str, Objectives] = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        c = self.config
        self._global = _default({"ttft_ms": c.ttft_ms, "tpot_ms": c.tpot_ms, "priority": c.priority}, None)
        self._models = {model: _default(table, self._global) for model, table in c.models.items()}

    def defaults(self, model: str) -> Objectives:
        """The objectives of a request for ``model`` that names none in its headers."""
        return self._models.get(model, self._global)

    def read(
        self, headers: Iterable[tuple[bytes, bytes]], model: str, ignored: list[IgnoredObjective] | None = None
    ) -> Objectives | None:
        """The request's objectives (``None``: none at all, and the standard class), the reasons for any header
        not used appended to ``ignored``."""
        found: dict[str, tuple[int, bytes]] = {}
        repeated: set[str] = set()
        for name, value in headers:
            known = OBJECTIVE_HEADERS.get(name) if name[:2] == b"x-" else None
            if known is None:
                continue
            what, rank = known
            held = found.get(what)
            if held is None or rank < held[0]:
                found[what] = (rank, value)
            elif rank == held[0]:
                repeated.add(what)
        base = self.defaults(model)
        if not found:
            return base if base.any or base.priority is not Priority.STANDARD else None
        ttft, tpot, priority = base.ttft_s, base.tpot_s, base.priority
        for what, (_, raw) in found.items():
            if what in repeated:
                problem: Any = IgnoredObjective.REPEATED
            elif what == _PRIORITY:
                try:
                    priority = Priority(raw.decode("latin-1").strip().lower())
                    continue
                except ValueError:
                    problem = IgnoredObjective.UNKNOWN_PRIORITY
            else:
                problem = _milliseconds(raw)
                if not isinstance(problem, IgnoredObjective):
                    if what == _TTFT:
                        ttft = problem
                    else:
                        tpot = problem
                    continue
            if ignored is not None:
                ignored.append(problem)
        objectives = Objectives(ttft_s=ttft, tpot_s=tpot, priority=priority)
        return objectives if objectives.any or priority is not Priority.STANDARD else None
