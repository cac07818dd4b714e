"""kvroute-tracing's plugin for embedders: the routing decision as a span under the embedder's own span."""

from __future__ import annotations

from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor

from kvroute import Backend, Fleet, PluginManager, Router, RouteRequest
from kvroute_tracing import RoutingSpans
from tests.contrib.tracing.receiver import HttpReceiver


class TestRoutingSpans:
    def test_decision_span_is_a_child_of_the_current_span(self) -> None:
        """Registered on a router's plugin manager, RoutingSpans exports one kvroute.route span per decision, a
        child of the span current when Router.route ran, with the decision's attributes and no prompt text."""
        receiver = HttpReceiver().start()
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(OTLPSpanExporter(endpoint=receiver.url + "/v1/traces")))
        try:
            plugins = PluginManager()
            plugins.register(RoutingSpans(provider), name="kvroute-tracing")
            router = Router.create(Fleet([Backend("a"), Backend("b")]), "bounded-load", plugins=plugins)
            request = RouteRequest.from_text("a secret prompt", model="m", request_id="r1")
            tracer = provider.get_tracer("embedder")
            with tracer.start_as_current_span("litellm.request") as parent, router.route(request) as lease:
                chosen = lease.backend.id
            spans = receiver.wait_for(lambda s: len(s) >= 2)
            route = next(s for s in spans if s.name == "kvroute.route")
            assert route.parent_span_id == f"{parent.get_span_context().span_id:016x}"
            assert route.attributes["kvroute.route.strategy"] == "bounded-load"
            assert route.attributes["kvroute.route.backend"] == chosen
            assert route.attributes["gen_ai.request.model"] == "m"
            assert route.attributes["kvroute.request_id"] == "r1"
            assert len(route.attributes["kvroute.route.key"]) == 16
            assert all("secret" not in str(v) for v in route.attributes.values())
        finally:
            provider.shutdown()
            receiver.stop()

    def test_not_loaded_by_every_router(self) -> None:
        """kvroute-tracing registers no entry point: a router made without it calls no routed hook."""
        router = Router.create(Fleet([Backend("a")]), "bounded-load")
        assert router.plugins is not None
        assert not router.plugins.has_implementations("kvroute_request_routed")
