"""What a strategy author needs to test a strategy the way kvroute tests its own.

* `StrategyConformance`: a pytest base class checking the `kvroute.Strategy` contract.
* `ScalingStateMachine`: a Hypothesis state machine that scales a fleet and checks the
  placement and load properties a strategy claims (`Claims`), with stated tolerances
  (`Tolerance`), and reports what a run exercised (`Coverage`).
* `kvroute.testing.measure`: assignments, movement, shares and the exact ``load_factor`` cap
  (`load_factor_cap`), for tests and benchmarks.
* `kvroute.testing.footprint`: the reference model of what each backend's cache holds
  (`CacheModel`, `cache_room`) that capacity-aware placement claims are checked against.

Both check generated cases: evidence, not proof. The state machine runs ``max_examples``
histories of up to ``steps`` rules (20 and 30 by default; this repository's CI runs use 8 to
20 examples per strategy, listed in docs/strategies.md).

This package needs ``pytest`` and ``hypothesis`` (``pip install "kvroute[testing]"``). They
are imported lazily: ``import kvroute.testing`` works without them, and only the names that
need them (`ScalingStateMachine`, `StrategyConformance` uses pytest inside its tests) import them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvroute.testing.footprint import CacheModel, cache_room
from kvroute.testing.measure import (
    Movement,
    Tolerance,
    assign,
    backend_id_of,
    exact,
    load_factor_cap,
    sample_requests,
    shares,
    weight_shares,
)

if TYPE_CHECKING:
    from kvroute.testing.conformance import StrategyConformance, varied_requests
    from kvroute.testing.stateful import Claims, Coverage, ScalingStateMachine

__all__ = [
    "CacheModel",
    "Claims",
    "Coverage",
    "Movement",
    "ScalingStateMachine",
    "StrategyConformance",
    "Tolerance",
    "assign",
    "backend_id_of",
    "cache_room",
    "exact",
    "load_factor_cap",
    "sample_requests",
    "shares",
    "varied_requests",
    "weight_shares",
]

_LAZY = {
    "Claims": "kvroute.testing.stateful",
    "Coverage": "kvroute.testing.stateful",
    "ScalingStateMachine": "kvroute.testing.stateful",
    "StrategyConformance": "kvroute.testing.conformance",
    "varied_requests": "kvroute.testing.conformance",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'kvroute.testing' has no attribute {name!r}")
    import importlib

    try:
        value = getattr(importlib.import_module(module), name)
    except ModuleNotFoundError as exc:
        raise ModuleNotFoundError(
            f'kvroute.testing.{name} needs {exc.name!r}: pip install "kvroute[testing]"', name=exc.name
        ) from exc
    globals()[name] = value
    return value
