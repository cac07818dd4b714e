"""The status page: ``GET /status.json`` content, ``GET /status`` and their access control, on a real proxy."""

from __future__ import annotations

import json
import re
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvroute.backend import EngineLoad
from kvroute.errors import ConfigError
from kvroute_server import ProxyApp, ServerConfig, ServerThread
from kvroute_server.cli import build_config
from kvroute_server.config import DiscoveryConfig, config_from_mapping
from kvroute_server.ops.status import page
from tests.server.harness import Servers, chat_body, http, in_loop

TOKEN = "status-admin-token-0123456789"
#: A phrase that must never appear on the status page or in /status.json.
SECRET = "purple-elephant-7f3a"


def status(proxy: ServerThread, token: str | None = None) -> dict[str, Any]:
    headers = {"authorization": f"Bearer {token}"} if token else {}
    code, _, body = http("GET", proxy.url + "/status.json", headers=headers)
    assert code == 200, f"expected 200 from /status.json, got {code}: {body[:300]!r}"
    return json.loads(body)  # type: ignore[no-any-return]


def metric_by_backend(proxy: ServerThread, name: str) -> dict[str, float]:
    code, _, body = http("GET", proxy.url + "/metrics")
    assert code == 200
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(body.decode()):
        for sample in family.samples:
            if sample.name == name:
                backend = sample.labels["backend"]
                out[backend] = out.get(backend, 0.0) + sample.value
    return out


def chat(proxy: ServerThread, text: str, **kwargs: Any) -> dict[str, str]:
    code, headers, body = http("POST", proxy.url + "/v1/chat/completions", chat_body(text, **kwargs))
    assert code == 200, body
    return headers


def wait_for(predicate: Any, what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.02)


def settled(proxy: ServerThread, routed: int) -> None:
    """Wait until ``routed`` requests are counted (a request is counted just after its answer went out)."""
    wait_for(lambda: status(proxy)["totals"]["routed"] == routed, f"{routed} requests to be counted")


class TestStatusJson:
    """``GET /status.json`` on a proxy in front of emulators."""

    def test_backends_strategy_and_counts_match_metrics(self, servers: Servers) -> None:
        """Each backend's identity, health, request count and share agree with the config and /metrics."""
        emulators = servers.emulators(3)
        proxy = servers.proxy(emulators, strategy="bounded-load", options={"prefix_length": 1024})
        for i in range(12):
            chat(proxy, f"conversation {i % 4} " + "context " * 300)
        settled(proxy, 12)
        doc = status(proxy)
        assert doc["schema"] == 1
        assert doc["strategy"] == {"name": "bounded-load", "options": {"prefix_length": 1024}}
        by_id = {b["id"]: b for b in doc["backends"]}
        assert sorted(by_id) == ["e0", "e1", "e2"]
        for i, emulator in enumerate(emulators):
            row = by_id[f"e{i}"]
            assert (row["kind"], row["url"], row["origin"]) == ("openai", emulator.url, "flag")
            assert (row["healthy"], row["draining"], row["routable"], row["in_flight"]) == (True, False, True, 0)
        requests = metric_by_backend(proxy, "kvroute_requests_total")
        assert {b: r["requests"]["total"] for b, r in by_id.items() if r["requests"]["total"]} == requests
        assert doc["totals"]["routed"] == 12 == sum(requests.values())
        for row in by_id.values():
            assert row["share"] == pytest.approx(row["requests"]["total"] / 12, abs=1e-4)
        assert doc["fleet"]["flags"] == ["e0", "e1", "e2"] and doc["fleet"]["discovery"] == []
        assert (doc["fleet"]["file"], doc["fleet"]["from_file"]) == (None, [])

    def test_reuse_matches_cached_tokens_metric(self, servers: Servers) -> None:
        """Per backend, prompt and cached tokens are the proxy's kvroute_prompt_tokens(_cached) counters."""
        proxy = servers.proxy(servers.emulators(2), strategy="bounded-load", options={"prefix_length": 1024})
        for _ in range(4):
            chat(proxy, "shared system prompt " * 200)
        settled(proxy, 4)
        doc = status(proxy)
        prompt = metric_by_backend(proxy, "kvroute_prompt_tokens_total")
        cached = metric_by_backend(proxy, "kvroute_prompt_tokens_cached_total")
        assert sum(cached.values()) > 0, "the repeated prompt should have hit the emulator's prefix cache"
        for row in doc["backends"]:
            reuse = row["reuse"]
            assert reuse["prompt_tokens"] == prompt.get(row["id"], 0)
            assert reuse["cached_tokens"] == cached.get(row["id"], 0)
        assert doc["totals"]["cached_tokens"] == sum(cached.values())

    def test_recent_decisions_explain_without_prompt_text(self, servers: Servers) -> None:
        """The last N decisions, newest first, carry explain(), a hex key, backend and TTFT, never the prompt."""
        proxy = servers.proxy(
            servers.emulators(2), strategy="bounded-load", options={"prefix_length": 1024}, status_decisions=5
        )
        ids = []
        for i in range(8):
            headers = chat(proxy, f"{SECRET} {i} " + "filler " * 300, stream=i % 2 == 0)
            ids.append(headers["x-request-id"])
        settled(proxy, 8)
        code, _, raw = http("GET", proxy.url + "/status.json")
        assert code == 200 and SECRET.encode() not in raw
        recent = json.loads(raw)["decisions"]["recent"]
        assert len(recent) == 5
        assert [r["request_id"] for r in recent] == [i for i in reversed(ids)][:5]
        for r in recent:
            assert re.fullmatch(r"[0-9a-f]{16}", r["key"]), r["key"]
            assert r["explain"].startswith(f"bounded-load -> {r['backend']} (")
            assert r["outcome"] == "ok" and r["status"] == 200 and r["duration_ms"] > 0
        streamed = [r for r in recent if r["ttft_ms"] is not None]
        assert streamed and all(r["ttft_ms"] > 0 for r in streamed)

    def test_zero_decisions_keeps_none(self, servers: Servers) -> None:
        """status_decisions = 0 records no decision but still counts requests."""
        proxy = servers.proxy(servers.emulators(1), status_decisions=0)
        chat(proxy, "hello")
        settled(proxy, 1)
        doc = status(proxy)
        assert doc["decisions"] == {"size": 0, "recent": []}
        assert doc["totals"]["routed"] == 1

    def test_engine_load_shown_when_fresh(self, servers: Servers) -> None:
        """An engine-reported load appears while fresh and disappears (marked stale) once too old."""
        proxy = servers.proxy(servers.emulators(2))
        app = proxy.app
        load = EngineLoad(running=3, waiting=2, kv_usage=0.25, prefix_cache_queries=200.0, prefix_cache_hits=50.0)
        in_loop(proxy, app.fleet.update_load, "e0", load)
        rows = {b["id"]: b for b in status(proxy)["backends"]}
        engine = rows["e0"]["engine"]
        assert engine is not None
        assert (engine["running"], engine["waiting"], engine["kv_usage"], engine["prefix_hit_rate"]) == (
            3,
            2,
            0.25,
            0.25,
        )
        assert rows["e1"]["engine"] is None and rows["e1"]["load_stale"] is False
        old = EngineLoad(running=1, observed_at=time.monotonic() - 3600)
        in_loop(proxy, app.fleet.update_load, "e0", old)
        row = next(b for b in status(proxy)["backends"] if b["id"] == "e0")
        assert row["engine"] is None and row["load_stale"] is True

    def test_drained_and_in_flight(self, servers: Servers) -> None:
        """A drain through the admin API shows as draining; a running stream shows as in flight."""
        a, b = servers.emulators(2, time_scale=0.2)
        proxy = servers.proxy([a, b], admin_token=TOKEN)
        done: list[int] = []

        def long_stream() -> None:
            done.append(
                http("POST", proxy.url + "/v1/chat/completions", chat_body("x", max_tokens=300, stream=True))[0]
            )

        thread = threading.Thread(target=long_stream)
        thread.start()
        try:
            wait_for(lambda: status(proxy)["totals"]["in_flight"] == 1, "the stream to show as in flight")
            busy = next(r["id"] for r in status(proxy)["backends"] if r["in_flight"] == 1)
            code, _, _ = http(
                "POST", proxy.url + f"/admin/backends/{busy}/drain", {}, headers={"authorization": f"Bearer {TOKEN}"}
            )
            assert code in (200, 202)
            row = next(r for r in status(proxy)["backends"] if r["id"] == busy)
            assert (row["draining"], row["routable"], row["in_flight"]) == (True, False, 1)
        finally:
            thread.join(timeout=60)
        assert done == [200]

    def test_discovered_backends_and_source_freshness(self, servers: Servers, tmp_path: Path) -> None:
        """Backends from a discovery source name it as their origin; the source's freshness is listed."""
        emulator = servers.emulator()
        path = tmp_path / "fleet.json"
        path.write_text(json.dumps([{"id": "d0", "url": emulator.url}]))
        source = DiscoveryConfig("file", {"target": str(path), "interval": 0.05})
        proxy = servers.proxy(discovery=(source,))
        doc = status(proxy)
        [row] = doc["backends"]
        [src] = doc["fleet"]["discovery"]
        assert row["id"] == "d0" and row["origin"] == f"discovery:{src['source']}"
        assert src["stale"] is False and src["backends"] == 1 and src["last_success_age_s"] is not None
        assert doc["fleet"]["counts"] == {"flag": 0, "file": 0, "discovery": 1, "admin": 0}

    def test_origins_flag_file_and_admin(self, servers: Servers, tmp_path: Path) -> None:
        """Each backend says whether it came from a --backend flag, the TOML file or the admin API."""
        a, b, c = servers.emulators(3)
        path = tmp_path / "kvroute.toml"
        path.write_text(f'[[backends]]\nid = "f0"\nurl = "{a.url}"\n', encoding="utf-8")
        config = build_config(config_file=str(path), backends=(f"g0={b.url}",), admin_token=TOKEN, access_log=False)
        proxy = ServerThread(ProxyApp(config)).start()
        servers.started.append(proxy)
        code, _, body = http(
            "POST",
            proxy.url + "/admin/backends",
            {"id": "a0", "url": c.url},
            headers={"authorization": f"Bearer {TOKEN}"},
        )
        assert code in (200, 201), body
        doc = status(proxy)
        assert {r["id"]: r["origin"] for r in doc["backends"]} == {"f0": "file", "g0": "flag", "a0": "admin"}
        fleet = doc["fleet"]
        assert (fleet["flags"], fleet["file"], fleet["from_file"]) == (["g0"], str(path), ["f0"])
        assert fleet["counts"] == {"flag": 1, "file": 1, "discovery": 0, "admin": 1}

    def test_spills_by_reason(self, servers: Servers) -> None:
        """Spilled requests are counted by reason overall (from /metrics) and per receiving backend."""
        a, b = servers.emulators(2, time_scale=0.2)
        proxy = servers.proxy(
            [a, b], strategy="bounded-load", options={"prefix_length": 1024, "concurrency_threshold": 2}
        )
        prompt = "same prefix " * 300
        threads = [
            threading.Thread(target=chat, args=(proxy, prompt), kwargs={"max_tokens": 100, "stream": True})
            for _ in range(6)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        doc = status(proxy)
        spills = doc["totals"]["spills"]
        assert sum(spills.values()) > 0, f"six concurrent requests on one key should spill (got {doc['totals']})"
        per_backend = sum(sum(r["spills_to"].values()) for r in doc["backends"])
        assert per_backend == sum(spills.values())


class TestStatusPage:
    """``GET /status``: one self-contained HTML page."""

    def test_self_contained_html(self, servers: Servers) -> None:
        """The page is HTML with inline script and style, and loads nothing from elsewhere."""
        proxy = servers.proxy(servers.emulators(1))
        chat(proxy, SECRET)
        code, headers, body = http("GET", proxy.url + "/status")
        assert code == 200 and headers["content-type"] == "text/html; charset=utf-8"
        text = body.decode()
        assert "<script>" in text and "status.json" in text
        assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", text), (
            "the page must not load external resources"
        )
        assert SECRET not in text


class TestStatusAccess:
    """The ``status`` setting: on, behind the admin token, or off."""

    def test_off_is_404(self, servers: Servers) -> None:
        """status = off serves neither route."""
        proxy = servers.proxy(servers.emulators(1), status="off")
        for path in ("/status", "/status.json"):
            code, _, body = http("GET", proxy.url + path)
            assert code == 404, (path, body)

    @pytest.mark.parametrize("header", [None, "Bearer wrong-token-0123456789", f"Basic {TOKEN}"])
    def test_admin_needs_the_token(self, servers: Servers, header: str | None) -> None:
        """status = admin answers /status.json 401 without the right bearer token."""
        proxy = servers.proxy(servers.emulators(1), admin_token=TOKEN, status="admin")
        code, headers, body = http(
            "GET", proxy.url + "/status.json", headers={"authorization": header} if header else {}
        )
        assert code == 401 and headers["www-authenticate"] == "Bearer"
        assert json.loads(body)["error"]["code"] == "invalid_admin_token"

    def test_admin_with_the_token(self, servers: Servers) -> None:
        """status = admin answers with the token; the page itself (no data in it) is served without."""
        proxy = servers.proxy(servers.emulators(1), admin_token=TOKEN, status="admin")
        assert status(proxy, TOKEN)["backends"][0]["id"] == "e0"
        code, _, body = http("GET", proxy.url + "/status")
        assert code == 200 and body == page()  # the static page: the data comes from /status.json only

    def test_on_ignores_the_token(self, servers: Servers) -> None:
        """status = on (the default) answers anyone, also with an admin token configured."""
        proxy = servers.proxy(servers.emulators(1), admin_token=TOKEN)
        assert status(proxy)["backends"][0]["id"] == "e0"


class TestStatusConfig:
    """The ``status`` and ``status_decisions`` settings in TOML and flags."""

    def test_defaults(self) -> None:
        """The page is on and keeps 100 decisions by default."""
        assert (ServerConfig().status, ServerConfig().status_decisions) == ("on", 100)

    def test_toml_and_flags(self) -> None:
        """[server] keys and the --status / --status-decisions flags set them; flags win."""
        config = config_from_mapping({"server": {"status": "off", "status_decisions": 7}})
        assert (config.status, config.status_decisions) == ("off", 7)
        flagged = build_config(status="admin", status_decisions=3, admin_token=TOKEN)
        assert (flagged.status, flagged.status_decisions) == ("admin", 3)

    @pytest.mark.parametrize(
        ("changes", "message"),
        [
            ({"status": "public"}, "'status' must be one of on, admin, off (got 'public')"),
            ({"status_decisions": -1}, "'status_decisions' must be an integer from 0 to 10000 (got -1)"),
            ({"status_decisions": 10_001}, "(got 10001)"),
            ({"status": "admin"}, "no admin token is set"),
        ],
    )
    def test_invalid(self, changes: dict[str, Any], message: str) -> None:
        """Bad values are refused with what was expected and what was got."""
        with pytest.raises(ConfigError, match=re.escape(message)):
            ServerConfig(**changes)
