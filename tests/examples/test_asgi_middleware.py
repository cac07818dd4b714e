"""kvroute.integrations.asgi: the routing middleware, driven in-process through httpx's ASGI transport."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, Request

from kvroute import Backend, BackendState, BaseStrategy, Decision, Fleet, KvrouteError, Outcome, Router, RouteRequest
from kvroute.integrations.asgi import STATE_KEY, RoutingMiddleware, lease_from, upstream_headers

BODY = {"model": "m", "messages": [{"role": "user", "content": "hello"}]}


class Recording(BaseStrategy):
    """Picks the candidate with the fewest in flight (first on ties); records requests and outcomes."""

    def __init__(self) -> None:
        self.requests: list[RouteRequest] = []
        self.outcomes: list[Outcome] = []

    def pick(self, request: RouteRequest, candidates: Sequence[BackendState]) -> Decision:
        self.requests.append(request)
        best = min(candidates, key=lambda s: s.in_flight)
        return Decision(best.backend, reason="test")

    def on_request_finish(self, request: RouteRequest, decision: Decision, outcome: Outcome) -> None:
        self.outcomes.append(outcome)


def make_router(n: int = 2) -> tuple[Router, Recording]:
    strategy = Recording()
    return Router(Fleet([Backend(f"b{i}", url=f"http://b{i}") for i in range(n)]), strategy), strategy


def streaming_app(router: Router, seen: list[dict[str, Any]], status: int = 200, fail: bool = False) -> Any:
    """An ASGI app that reads the replayed body, answers in two chunks, and records in-flight counts."""

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        lease = lease_from(scope)
        message = await receive()
        state = router.fleet.get(lease.backend.id)
        seen.append({"backend": lease.backend.id, "body": message["body"], "in_flight_at_start": state.in_flight})
        if fail:
            raise RuntimeError("handler broke")
        await send({"type": "http.response.start", "status": status, "headers": [(b"content-type", b"text/plain")]})
        await send({"type": "http.response.body", "body": b"one ", "more_body": True})
        seen.append({"in_flight_mid_stream": state.in_flight})
        await send({"type": "http.response.body", "body": b"two", "more_body": False})

    return app


async def post(app: Any, path: str = "/v1/chat/completions", body: object = BODY, **kwargs: Any) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as client:
        return await client.post(path, content=content, **kwargs)


class TestRoutingMiddleware:
    @pytest.mark.anyio
    async def test_routes_and_counts_until_the_last_byte(self) -> None:
        """The app gets the body intact and the lease; the request is in flight until the final chunk is sent."""
        router, strategy = make_router()
        seen: list[dict[str, Any]] = []
        response = await post(RoutingMiddleware(streaming_app(router, seen), router))
        assert response.status_code == 200 and response.text == "one two"
        assert response.headers["x-kvroute-backend"] == seen[0]["backend"]
        assert json.loads(seen[0]["body"]) == BODY
        assert seen[0]["in_flight_at_start"] == 1 and seen[1]["in_flight_mid_stream"] == 1
        assert [s.in_flight for s in router.fleet] == [0, 0]
        assert [o.status for o in strategy.outcomes] == ["ok"]
        assert strategy.requests[0].text == RouteRequest.from_openai(BODY).text

    @pytest.mark.anyio
    async def test_server_error_counts_as_failure(self) -> None:
        """A 5xx answer from the app ends the lease as an error naming the status."""
        router, strategy = make_router()
        response = await post(RoutingMiddleware(streaming_app(router, [], status=502), router))
        assert response.status_code == 502
        assert [(o.status, o.error) for o in strategy.outcomes] == [("error", "HTTP 502")]

    @pytest.mark.anyio
    async def test_app_exception_ends_the_lease(self) -> None:
        """When the app raises, the lease ends as an error and the exception propagates."""
        router, strategy = make_router()
        with pytest.raises(RuntimeError, match="handler broke"):
            await post(RoutingMiddleware(streaming_app(router, [], fail=True), router))
        assert [o.status for o in strategy.outcomes] == ["error"] and "handler broke" in str(strategy.outcomes[0].error)
        assert [s.in_flight for s in router.fleet] == [0, 0]

    @pytest.mark.anyio
    async def test_incomplete_response_is_cancelled(self) -> None:
        """An app that returns without finishing its response leaves no request counted in flight."""
        router, strategy = make_router()

        async def app(scope: Any, receive: Any, send: Any) -> None:
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"x", "more_body": True})

        middleware = RoutingMiddleware(app, router)
        messages = [{"type": "http.request", "body": json.dumps(BODY).encode(), "more_body": False}]
        sent: list[Any] = []

        async def receive() -> Any:
            return messages.pop(0) if messages else {"type": "http.disconnect"}

        async def send(message: Any) -> None:
            sent.append(message)

        scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions", "headers": []}
        await middleware(scope, receive, send)
        assert [o.status for o in strategy.outcomes] == ["cancelled"] and [s.in_flight for s in router.fleet] == [0, 0]

    @pytest.mark.anyio
    @pytest.mark.parametrize(
        "body, status, fragment, param",
        [
            (b"{not json", 400, "The request body must be JSON", None),
            ({"model": "m"}, 400, "'messages' must be a non-empty list", "messages"),
            ({"model": "m", "messages": [{"role": "user", "content": "x" * 200}]}, 413, "at most 100 bytes", None),
            (b'{"model": "m", "messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", 400, "nests too deeply", None),
        ],
    )
    async def test_bad_requests_never_reach_the_app(
        self, body: object, status: int, fragment: str, param: str | None
    ) -> None:
        """Unparseable, invalid and oversized bodies get OpenAI-shaped errors and no lease."""
        router, strategy = make_router()
        seen: list[dict[str, Any]] = []
        limit = 1_000_000 if isinstance(body, bytes) and len(body) > 1000 else 100
        response = await post(RoutingMiddleware(streaming_app(router, seen), router, max_body_bytes=limit), body=body)
        error = response.json()["error"]
        assert response.status_code == status and fragment in error["message"] and error["param"] == param
        assert seen == [] and strategy.requests == []

    @pytest.mark.anyio
    async def test_no_backend_is_503(self) -> None:
        """An empty fleet answers 503 with the router's explanation."""
        router = Router(Fleet(), Recording())
        response = await post(RoutingMiddleware(streaming_app(router, []), router))
        assert response.status_code == 503 and "the fleet is empty" in response.json()["error"]["message"]

    @pytest.mark.anyio
    async def test_other_requests_pass_through(self) -> None:
        """GETs and unrouted paths reach the app without a lease; lease_from then says why it has none."""
        router, strategy = make_router()
        errors: list[str] = []

        async def app(scope: Any, receive: Any, send: Any) -> None:
            try:
                lease_from(scope)
            except KvrouteError as exc:
                errors.append(str(exc))
            await send({"type": "http.response.start", "status": 204, "headers": []})
            await send({"type": "http.response.body", "body": b""})

        middleware = RoutingMiddleware(app, router)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=middleware), base_url="http://gw") as client:
            assert (await client.get("/v1/chat/completions")).status_code == 204
            assert (await client.post("/v1/embeddings", json=BODY)).status_code == 204
        assert len(errors) == 2 and "add RoutingMiddleware" in errors[0] and "'/v1/embeddings'" in errors[1]
        assert strategy.requests == []

    @pytest.mark.anyio
    async def test_headers_reach_the_route_request(self) -> None:
        """The affinity, LoRA and request-id headers shape the RouteRequest like in kvroute serve."""
        router, strategy = make_router()
        headers = {"X-Kvroute-Affinity": "session-9", "x-kvroute-lora": "ad", "X-Request-Id": "r-1"}
        await post(RoutingMiddleware(streaming_app(router, []), router), headers=headers)
        request = strategy.requests[0]
        assert (request.affinity_key, request.lora, request.request_id) == ("session-9", "ad", "r-1")

    @pytest.mark.anyio
    async def test_starlette_request_state(self) -> None:
        """In FastAPI, request.state.kvroute_lease and lease_from(request) are the same lease."""
        router, _ = make_router()
        app = FastAPI()
        app.add_middleware(RoutingMiddleware, router=router, backend_header=None)

        @app.post("/v1/completions")
        async def handler(request: Request) -> dict[str, Any]:
            lease = lease_from(request)
            assert getattr(request.state, STATE_KEY) is lease
            return {"backend": lease.backend.id, "prompt": (await request.json())["prompt"]}

        response = await post(app, "/v1/completions", {"model": "m", "prompt": "p"})
        assert response.json() == {"backend": "b0", "prompt": "p"} and "x-kvroute-backend" not in response.headers

    @pytest.mark.anyio
    async def test_upstream_headers_name_the_rank(self) -> None:
        """A keyed decision on a data-parallel backend gives the app an x-data-parallel-rank; one rank gives none."""

        class Keyed(BaseStrategy):
            def pick(self, request: RouteRequest, candidates: Sequence[BackendState]) -> Decision:
                return Decision(candidates[0].backend, reason="hash", key=0xFEED)

        seen: dict[str, dict[str, str]] = {}
        for size in (1, 4):
            router = Router(Fleet([Backend("dp", url="http://dp", data_parallel_size=size)]), Keyed())

            async def app(scope: Any, receive: Any, send: Any, size: int = size) -> None:
                seen[str(size)] = upstream_headers(lease_from(scope))
                await send({"type": "http.response.start", "status": 200, "headers": []})
                await send({"type": "http.response.body", "body": b"ok"})

            assert (await post(RoutingMiddleware(app, router))).status_code == 200
        assert seen["1"] == {}
        assert set(seen["4"]) == {"x-data-parallel-rank"} and seen["4"]["x-data-parallel-rank"] in {"0", "1", "2", "3"}

    def test_constructor_checks(self) -> None:
        """Paths must map to chat or completions and the body limit must be positive."""
        router, _ = make_router()
        with pytest.raises(ValueError, match="must map to 'chat' or 'completions'"):
            RoutingMiddleware(streaming_app(router, []), router, paths={"/x": "embeddings"})  # type: ignore[dict-item]
        with pytest.raises(ValueError, match="'max_body_bytes' must be >= 1"):
            RoutingMiddleware(streaming_app(router, []), router, max_body_bytes=0)

    @pytest.mark.anyio
    async def test_disconnect_before_body(self) -> None:
        """A client that disconnects while sending its body gets nothing routed."""
        router, strategy = make_router()

        async def receive() -> Any:
            return {"type": "http.disconnect"}

        async def send(message: Any) -> None:
            raise AssertionError("nothing should be sent")

        scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions", "headers": []}
        await RoutingMiddleware(streaming_app(router, []), router)(scope, receive, send)
        assert strategy.requests == []
