"""The proxy's optional parts turned off: each is an object that does nothing, and the answers are as without it."""

from __future__ import annotations

import json

from kvroute_server import ProxyApp
from kvroute_server.fleet.discovery import NoDiscovery
from kvroute_server.fleet.warm_join import NoWarmJoin
from kvroute_server.ops.admin import NoAdminApi
from kvroute_server.ops.shadow import NoShadows
from kvroute_server.ops.status import NoStatusRoutes
from kvroute_server.ops.tracing import NO_TRACE, NoTracing
from tests.server.harness import Servers, chat_body, http, in_loop


class TestOptionalPartsOff:
    def test_off_parts_are_null_objects(self, servers: Servers) -> None:
        """Without discovery, warm join, shadows, admin token, status page or OTLP endpoint, the proxy holds their null
        objects."""
        proxy = servers.proxy(servers.emulators(1), status="off")
        app = proxy.app
        assert isinstance(app, ProxyApp)
        assert isinstance(app.discovery, NoDiscovery) and isinstance(app.warm_join, NoWarmJoin)
        assert isinstance(app.shadows, NoShadows) and isinstance(app.admin, NoAdminApi)
        assert isinstance(app.status, NoStatusRoutes) and isinstance(app.tracing, NoTracing)
        assert app.tracing.start({"headers": []}, "r") is NO_TRACE
        assert in_loop(proxy, lambda: app.warm_join.warming) == []

    def test_answers_without_them(self, servers: Servers) -> None:
        """Requests are served; /health lists no discovery; /admin/... and /status.json are unknown routes, counted."""
        proxy = servers.proxy(servers.emulators(1), status="off")
        assert http("POST", proxy.url + "/v1/chat/completions", chat_body("hello there"))[0] == 200
        code, _, body = http("GET", proxy.url + "/health")
        assert code == 200 and json.loads(body) == {"status": "ok", "backends": 1, "routable": 1}
        for path in ("/admin/backends", "/status.json"):
            code, _, body = http("GET", proxy.url + path)
            assert code == 404
            assert json.loads(body)["error"] == {
                "message": f"Unknown route: GET {path}.",
                "type": "not_found_error",
                "param": None,
                "code": "unknown_url",
            }
        code, _, metrics = http("GET", proxy.url + "/metrics")
        assert 'kvroute_rejected_requests_total{status="404"} 2.0' in metrics.decode()
