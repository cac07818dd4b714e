"""kvroute-tracing: OpenTelemetry for kvroute (``pip install "kvroute[tracing]"``).

- `RoutingSpans`: a plugin for code that embeds the library, one ``kvroute.route`` span per routing decision.
- `decision_attributes`, `request_attributes`: the decision's and the request's span attributes (`names`).
- `resolve`, `build_provider`, `BoundedSpanProcessor`: the exporter set-up ``kvroute serve`` uses.

The core library never imports this package (nor OpenTelemetry); see docs/tracing.md.
"""

from __future__ import annotations

from kvroute_tracing import names
from kvroute_tracing.attributes import decision_attributes, request_attributes
from kvroute_tracing.export import (
    PROTOCOLS,
    BoundedSpanProcessor,
    ExportSettings,
    TracingConfigError,
    build_provider,
    make_exporter,
    resolve,
)
from kvroute_tracing.plugin import RoutingSpans

__all__ = [
    "PROTOCOLS",
    "BoundedSpanProcessor",
    "ExportSettings",
    "RoutingSpans",
    "TracingConfigError",
    "build_provider",
    "decision_attributes",
    "make_exporter",
    "names",
    "request_attributes",
    "resolve",
]
