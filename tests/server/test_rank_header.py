"""The proxy and data-parallel ranks: it sends ``X-data-parallel-rank`` from the decision, and drops a client's own."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from kvroute_server import BackendConfig, HealthConfig, ProxyApp, ServerConfig, ServerThread
from kvroute_server.proxy.headers import filter_request_headers
from tests.server.harness import chat_body, http

NO_HEALTH = HealthConfig(interval=0, discover_models=False)


class RecordingUpstream:
    """An OpenAI-shaped upstream that answers every request as a chat completion and keeps each POST's headers."""

    def __init__(self) -> None:
        self.seen: list[dict[str, str]] = []

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        more = True
        while more:
            more = (await receive()).get("more_body", False)
        if scope["method"] == "POST":  # not the startup parity check's GETs
            self.seen.append({k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]})
        body = json.dumps(
            {
                "id": "c",
                "object": "chat.completion",
                "model": "m",
                "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
            }
        ).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": body})


@pytest.fixture
def upstream() -> Iterator[tuple[RecordingUpstream, ServerThread]]:
    app = RecordingUpstream()
    server = ServerThread(app).start()
    try:
        yield app, server
    finally:
        server.stop()


def proxy_for(
    server: ServerThread, strategy: str, options: dict[str, Any] | None = None, **adapter: Any
) -> ServerThread:
    backend = BackendConfig(id="dp", url=server.url, adapter_options=adapter)
    config = ServerConfig(
        backends=(backend,), strategy=strategy, options=options or {}, health=NO_HEALTH, access_log=False
    )
    return ServerThread(ProxyApp(config)).start()


class TestRequestHeaderFilter:
    def test_client_rank_dropped_and_reported(self) -> None:
        """A client's X-data-parallel-rank (any case) is dropped and its name reported as forged."""
        forged: list[str] = []
        raw = [(b"X-Data-Parallel-Rank", b"3"), (b"x-other", b"1")]
        out = filter_request_headers(raw, forward_authorization=True, api_key=None, request_id="r", forged=forged)
        assert "x-data-parallel-rank" not in out and out["x-other"] == "1"
        assert forged == ["x-data-parallel-rank"]

    def test_rank_set_by_the_proxy(self) -> None:
        """The rank given is sent, replacing a client's forged one."""
        raw = [(b"x-data-parallel-rank", b"7")]
        out = filter_request_headers(raw, forward_authorization=True, api_key=None, request_id="r", rank=1)
        assert out["x-data-parallel-rank"] == "1"


class TestRankHeaderUpstream:
    def test_hash_strategy_sends_a_stable_rank(self, upstream: tuple[RecordingUpstream, ServerThread]) -> None:
        """With 4 configured ranks, consistent-hash requests carry a rank, the same one for the same prompt."""
        app, server = upstream
        proxy = proxy_for(server, "consistent-hash", data_parallel_size=4)
        try:
            for text in ("alpha " * 50, "beta " * 50, "alpha " * 50, "gamma " * 50, "beta " * 50):
                status, _, _ = http("POST", proxy.url + "/v1/chat/completions", chat_body(text))
                assert status == 200
        finally:
            proxy.stop()
        ranks = [int(h["x-data-parallel-rank"]) for h in app.seen]
        assert all(0 <= r < 4 for r in ranks)
        assert ranks[0] == ranks[2] and ranks[1] == ranks[4]

    def test_tokenizer_prefix_sends_its_rank(self, upstream: tuple[RecordingUpstream, ServerThread]) -> None:
        """tokenizer-prefix's decisions name a rank of a 4-rank backend; a prompt sent again goes to the same rank."""
        app, server = upstream
        proxy = proxy_for(server, "tokenizer-prefix", data_parallel_size=4)
        try:
            texts = [f"document {i} " + "shared words " * 60 for i in range(6)]
            for text in [*texts, *texts]:
                assert http("POST", proxy.url + "/v1/chat/completions", chat_body(text))[0] == 200
        finally:
            proxy.stop()
        ranks = [h["x-data-parallel-rank"] for h in app.seen]
        assert ranks[:6] == ranks[6:] and all(r in {"0", "1", "2", "3"} for r in ranks)

    def test_forged_rank_dropped_without_dp(self, upstream: tuple[RecordingUpstream, ServerThread]) -> None:
        """Without data parallelism no rank is sent, and a client's forged one never reaches the engine."""
        app, server = upstream
        proxy = proxy_for(server, "consistent-hash")
        try:
            status, _, _ = http(
                "POST",
                proxy.url + "/v1/chat/completions",
                chat_body("hello " * 30),
                headers={"X-data-parallel-rank": "2"},
            )
            assert status == 200
            _, _, metrics = http("GET", proxy.url + "/metrics")
        finally:
            proxy.stop()
        assert "x-data-parallel-rank" not in app.seen[0]
        assert 'kvroute_dropped_request_headers_total{header="x-data-parallel-rank"} 1.0' in metrics.decode()

    def test_forged_rank_replaced_by_the_decision(self, upstream: tuple[RecordingUpstream, ServerThread]) -> None:
        """With ranks, a client's forged rank is replaced by the proxy's own for that prompt."""
        app, server = upstream
        proxy = proxy_for(server, "consistent-hash", data_parallel_size=2)
        try:
            body = chat_body("delta " * 40)
            http("POST", proxy.url + "/v1/chat/completions", body)
            http("POST", proxy.url + "/v1/chat/completions", body, headers={"X-data-parallel-rank": "99"})
        finally:
            proxy.stop()
        assert app.seen[0]["x-data-parallel-rank"] == app.seen[1]["x-data-parallel-rank"] in ("0", "1")

    def test_bad_configured_size_is_a_config_error(self, upstream: tuple[RecordingUpstream, ServerThread]) -> None:
        """A data_parallel_size that is not an integer from 1 is refused when the proxy starts, naming it."""
        from kvroute.errors import ConfigError

        _, server = upstream
        with pytest.raises(ConfigError, match="'data_parallel_size' must be an integer from 1 to 65536"):
            ProxyApp(
                ServerConfig(
                    backends=(BackendConfig(id="dp", url=server.url, adapter_options={"data_parallel_size": 0}),),
                    health=NO_HEALTH,
                )
            )


class TestStatusRanks:
    def test_status_shows_ranks_and_dropped_headers(self, upstream: tuple[RecordingUpstream, ServerThread]) -> None:
        """/status.json lists a backend's ranks with the attempts sent to each, the decision's rank and the drops."""
        app, server = upstream
        backend = BackendConfig(id="dp", url=server.url, adapter_options={"data_parallel_size": 2})
        config = ServerConfig(
            backends=(backend,), strategy="consistent-hash", health=NO_HEALTH, access_log=False, status="on"
        )
        proxy = ServerThread(ProxyApp(config)).start()
        try:
            for i in range(6):
                headers = {"X-data-parallel-rank": "1"} if i == 0 else {}
                http("POST", proxy.url + "/v1/chat/completions", chat_body(f"topic {i} " * 30), headers=headers)
            _, _, raw = http("GET", proxy.url + "/status.json")
        finally:
            proxy.stop()
        status = json.loads(raw)
        (row,) = status["backends"]
        assert row["data_parallel_size"] == 2 and [r["rank"] for r in row["ranks"]] == [0, 1]
        sent = [int(h["x-data-parallel-rank"]) for h in app.seen]
        assert [r["requests"] for r in row["ranks"]] == [sent.count(0), sent.count(1)]
        assert status["dropped_headers"] == {"x-data-parallel-rank": 1}
        recent = status["decisions"]["recent"]
        assert sorted(r["data_parallel_rank"] for r in recent) == sorted(sent)
        assert status["tiers"] is None  # consistent-hash counts no tiers

    def test_status_shows_tier_hits_for_tokenizer_prefix(
        self, upstream: tuple[RecordingUpstream, ServerThread]
    ) -> None:
        """With tokenizer-prefix, /status.json carries prefix hits by tier (GPU tokens once a prompt repeats)."""
        _, server = upstream
        backend = BackendConfig(id="one", url=server.url)
        config = ServerConfig(
            backends=(backend,), strategy="tokenizer-prefix", health=NO_HEALTH, access_log=False, status="on"
        )
        proxy = ServerThread(ProxyApp(config)).start()
        try:
            for _ in range(2):
                http("POST", proxy.url + "/v1/chat/completions", chat_body("the same long question " * 40))
            _, _, raw = http("GET", proxy.url + "/status.json")
        finally:
            proxy.stop()
        tiers = json.loads(raw)["tiers"]
        assert tiers["hit_tokens"]["GPU"] > 0 and tiers["blocks"] == {}
