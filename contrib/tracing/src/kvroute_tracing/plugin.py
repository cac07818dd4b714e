"""The routing decision as a span, for code that embeds the library (LiteLLM, an ASGI app, a script).

Register it on the router's plugin manager::

    from kvroute import PluginManager, Router
    from kvroute_tracing import RoutingSpans

    plugins = PluginManager()
    plugins.register(RoutingSpans(), name="kvroute-tracing")
    router = Router.create(fleet, "bounded-load", plugins=plugins)

Each decision then becomes a ``kvroute.route`` span, a child of whatever span is current when
``Router.route`` runs (the embedder's request span), on the tracer provider the application set up
(`opentelemetry.trace.get_tracer_provider`, or the one given). It is not an entry point: a plugin
loaded by every router in the process would put a hook call on the request path of those, such as
``kvroute serve``'s, that make their own spans.
"""

from __future__ import annotations

import time

from opentelemetry import trace

from kvroute import hookimpl
from kvroute.request import RouteRequest
from kvroute.strategy import Decision
from kvroute_tracing import names
from kvroute_tracing.attributes import decision_attributes, request_attributes

__all__ = ["RoutingSpans"]


class RoutingSpans:
    """A kvroute plugin: one ``kvroute.route`` span per routing decision (the ``kvroute_request_routed`` hook)."""

    def __init__(self, tracer_provider: trace.TracerProvider | None = None) -> None:
        self._provider = tracer_provider
        self._tracer: trace.Tracer | None = None

    @property
    def tracer(self) -> trace.Tracer:
        """The tracer, taken on first use (an application may set its provider after registering the plugin)."""
        if self._tracer is None:
            self._tracer = trace.get_tracer(names.SCOPE, tracer_provider=self._provider)
        return self._tracer

    @hookimpl
    def kvroute_request_routed(self, request: RouteRequest, decision: Decision) -> None:
        """Record the decision as a span that started when the strategy's pick did and ended as it returned."""
        end = time.time_ns()
        start = end - int(decision.duration_s * 1e9)
        span = self.tracer.start_span(names.ROUTE_SPAN, start_time=start)
        if span.is_recording():
            span.set_attributes(request_attributes(request))
            span.set_attributes(decision_attributes(decision))
            span.set_attribute(names.REQUEST_ID, request.request_id)
        span.end(end_time=end)
