"""Import the routing part of an Amazon SageMaker endpoint configuration.

Accepted input: the JSON given to ``CreateEndpointConfig`` or returned by
``DescribeEndpointConfig`` (``{"ProductionVariants": [{"VariantName", "RoutingConfig": {...}}]}``),
one production variant object, or a bare ``RoutingConfig`` object. Mapping:

============================  ==================  ===========================================
SageMaker                     kvroute strategy    options
============================  ==================  ===========================================
``RANDOM``                    ``random``          (none)
``LEAST_OUTSTANDING_REQUESTS`` ``least-outstanding`` (none)
``PREFIX_AWARE``              ``bounded-load``    ``prefix_length`` <- ``PrefixLength``,
                                                  ``concurrency_threshold`` <- ``ConcurrencyThreshold``
============================  ==================  ===========================================

SageMaker's config names no instance URLs, so backends still come from ``--backend`` or
the TOML file. ``PrefixAwareRoutingConfig`` is read inside ``RoutingConfig`` or next to it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kvroute.errors import ConfigError

__all__ = ["STRATEGY_MAP", "import_sagemaker", "load_sagemaker"]

STRATEGY_MAP = {
    "RANDOM": "random",
    "LEAST_OUTSTANDING_REQUESTS": "least-outstanding",
    "PREFIX_AWARE": "bounded-load",
}

_RANGES = {"PrefixLength": (1024, 65536), "ConcurrencyThreshold": (1, 1024)}
_OPTION_NAMES = {"PrefixLength": "prefix_length", "ConcurrencyThreshold": "concurrency_threshold"}


def _pick_variant(doc: Mapping[str, Any], variant: str | None) -> Mapping[str, Any]:
    variants = doc.get("ProductionVariants")
    if variants is None:
        return doc  # a single variant or a bare RoutingConfig
    if not isinstance(variants, list) or not variants:
        raise ConfigError("SageMaker config: 'ProductionVariants' must be a non-empty list.")
    names = [v.get("VariantName") for v in variants if isinstance(v, Mapping)]
    if variant is not None:
        for v in variants:
            if isinstance(v, Mapping) and v.get("VariantName") == variant:
                return v
        raise ConfigError(
            f"SageMaker config: no production variant named {variant!r} (found: {', '.join(map(str, names))})."
        )
    if len(variants) > 1:
        raise ConfigError(
            f"SageMaker config has {len(variants)} production variants ({', '.join(map(str, names))}); "
            "choose one with --sagemaker-variant."
        )
    if not isinstance(variants[0], Mapping):
        raise ConfigError("SageMaker config: each production variant must be an object.")
    return variants[0]


def import_sagemaker(doc: object, variant: str | None = None) -> tuple[str, dict[str, int]]:
    """Return ``(strategy, options)`` for a parsed SageMaker endpoint-config document."""
    if not isinstance(doc, Mapping):
        raise ConfigError(f"SageMaker config must be a JSON object (got {type(doc).__name__}).")
    chosen = _pick_variant(doc, variant)
    routing = chosen.get("RoutingConfig", chosen if "RoutingStrategy" in chosen else None)
    if routing is None:
        raise ConfigError("SageMaker config: no 'RoutingConfig' found (expected RoutingConfig.RoutingStrategy).")
    if not isinstance(routing, Mapping):
        raise ConfigError("SageMaker config: 'RoutingConfig' must be an object.")
    name = routing.get("RoutingStrategy")
    if name not in STRATEGY_MAP:
        raise ConfigError(
            f"SageMaker config: 'RoutingStrategy' must be one of {', '.join(STRATEGY_MAP)} (got {name!r})."
        )
    prefix = routing.get("PrefixAwareRoutingConfig", chosen.get("PrefixAwareRoutingConfig"))
    options: dict[str, int] = {}
    if prefix is not None:
        if name != "PREFIX_AWARE":
            raise ConfigError(
                f"SageMaker config: 'PrefixAwareRoutingConfig' is only valid with PREFIX_AWARE (got {name})."
            )
        if not isinstance(prefix, Mapping):
            raise ConfigError("SageMaker config: 'PrefixAwareRoutingConfig' must be an object.")
        unknown = sorted(set(prefix) - set(_RANGES))
        if unknown:
            raise ConfigError(f"SageMaker config: unknown PrefixAwareRoutingConfig key(s) {', '.join(unknown)}.")
        for key, (lo, hi) in _RANGES.items():
            if key not in prefix:
                continue
            value = prefix[key]
            if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
                raise ConfigError(
                    f"SageMaker config: '{key}' must be an integer between {lo} and {hi} (got {value!r})."
                )
            options[_OPTION_NAMES[key]] = value
    return STRATEGY_MAP[name], options


def load_sagemaker(path: str | Path, variant: str | None = None) -> tuple[str, dict[str, int]]:
    """Read a SageMaker endpoint-config JSON file and map it (see :func:`import_sagemaker`)."""
    path = Path(path)
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"SageMaker config file {str(path)!r} does not exist.") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"SageMaker config file {str(path)!r} is not valid JSON: {exc}.") from None
    return import_sagemaker(doc, variant)
