"""Sessions through the proxy: read from every documented source, kept on one engine, moved once, counted."""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest

from kvroute_server import BackendConfig, ProxyApp, ServerConfig, SessionConfig
from tests.server.harness import MODEL, Servers, http, in_loop

PREAMBLE = "You are a coding agent. Tools: read_file, write_file, run_tests. " * 40


def turn_body(turns: int, conversation: str, **extra: Any) -> dict[str, Any]:
    """A growing agent conversation with ``turns`` user turns under one shared preamble."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": PREAMBLE}]
    for i in range(turns):
        if i:
            messages.append({"role": "assistant", "content": f"step {i} of {conversation} done"})
        messages.append({"role": "user", "content": f"{conversation}: task part {i}"})
    return {"model": MODEL, "messages": messages, "max_tokens": 2, **extra}


def send(proxy: Any, body: dict[str, Any], **headers: str) -> str:
    status, got, raw = http("POST", proxy.url + "/v1/chat/completions", body, headers=headers)
    assert status == 200, raw
    return got["x-kvroute-backend"]


def metric_value(proxy: Any, name: str) -> float:
    """The value of an unlabelled metric in the proxy's exposition (absent: nan)."""
    _, _, raw = http("GET", proxy.url + "/metrics")
    for line in raw.decode().splitlines():
        if line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    return float("nan")


def status_json(proxy: Any) -> dict[str, Any]:
    status, _, raw = http("GET", proxy.url + "/status.json")
    assert status == 200
    return json.loads(raw)


class TestProxySessions:
    def test_a_session_keeps_its_engine_and_sessions_spread(self, servers: Servers) -> None:
        """Six turns of each session go to one engine, and 24 sessions use at least 3 of 4 engines."""
        proxy = servers.proxy(servers.emulators(4), strategy="bounded-load")
        homes: dict[str, set[str]] = {}
        for turn in range(1, 7):
            for s in range(24):
                name = f"sess-{s}"
                homes.setdefault(name, set()).add(send(proxy, turn_body(turn, name), **{"x-session-id": name}))
        assert all(len(engines) == 1 for engines in homes.values()), homes
        assert len({next(iter(e)) for e in homes.values()}) >= 3
        sessions = status_json(proxy)["sessions"]
        assert sessions["bound"]["session"] == 24
        assert sessions["requests"] == {"session/new": 24, "session/stayed": 120}

    @pytest.mark.parametrize(
        ("headers", "extra"),
        [
            ({"x-kvroute-affinity": "A"}, {}),
            ({}, {"prompt_cache_key": "A"}),
            ({"x-dynamo-session-id": "A"}, {}),
            ({"x-claude-code-session-id": "A"}, {}),
            ({"session_id": "A"}, {}),
            ({"session-id": "A"}, {}),
            ({}, {"metadata": {"session_id": "A"}}),
        ],
    )
    def test_every_default_source_names_the_same_session(
        self, servers: Servers, headers: dict[str, str], extra: dict[str, Any]
    ) -> None:
        """The same id from any default source reaches the engine an x-session-id of that id reaches."""
        proxy = servers.proxy(servers.emulators(4), strategy="bounded-load")
        reference = send(proxy, turn_body(1, "ref"), **{"x-session-id": "A"})
        assert send(proxy, turn_body(2, "other", **extra), **headers) == reference
        assert status_json(proxy)["sessions"]["requests"] == {"session/new": 1, "session/stayed": 1}

    def test_openai_sdk_prompt_cache_key_and_session_header(self, servers: Servers) -> None:
        """The openai SDK's prompt_cache_key, and a session header it sends, keep a conversation on one engine."""
        proxy = servers.proxy(servers.emulators(4), strategy="bounded-load")
        client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="k", max_retries=0, timeout=30)
        engines: dict[str, set[str]] = {}
        for turn in range(1, 5):
            for name in ("one", "two", "three"):
                body = turn_body(turn, name)
                reply = client.chat.completions.with_raw_response.create(
                    model=MODEL, messages=body["messages"], max_tokens=2, prompt_cache_key=f"pck-{name}"
                )
                engines.setdefault(f"pck-{name}", set()).add(reply.headers["x-kvroute-backend"])
                reply = client.chat.completions.with_raw_response.create(
                    model=MODEL, messages=body["messages"], max_tokens=2, extra_headers={"x-session-id": f"h-{name}"}
                )
                engines.setdefault(f"h-{name}", set()).add(reply.headers["x-kvroute-backend"])
        assert all(len(found) == 1 for found in engines.values()), engines
        assert status_json(proxy)["sessions"]["requests"] == {"session/new": 6, "session/stayed": 18}

    def test_bad_session_ids_are_ignored_and_counted(self, servers: Servers) -> None:
        """Too long, wrong type and non-UTF-8 session ids answer 200 and are counted by reason."""
        proxy = servers.proxy(servers.emulators(2), strategy="bounded-load")
        send(proxy, turn_body(1, "a"), **{"x-session-id": "x" * 300})
        send(proxy, turn_body(1, "b", prompt_cache_key=12))
        status, _, raw = http(
            "POST",
            proxy.url + "/v1/chat/completions",
            raw=json.dumps(turn_body(1, "c")).encode(),
            headers={"x-session-id": "\xff"},  # sent as the single byte 0xff: not UTF-8
        )
        assert status == 200, raw
        sessions = status_json(proxy)["sessions"]
        assert sessions["ignored_ids"] == {"not_utf8": 1, "too_long": 1, "wrong_type": 1}
        _, _, metrics = http("GET", proxy.url + "/metrics")
        assert b'kvroute_session_ids_ignored_total{reason="too_long"} 1.0' in metrics

    def test_moves_once_when_its_engine_drains(self, servers: Servers) -> None:
        """Draining a session's engine moves it once; it stays at the new engine after the drain ends."""
        proxy = servers.proxy(servers.emulators(3), strategy="bounded-load")
        app = proxy.app
        assert isinstance(app, ProxyApp)
        first = send(proxy, turn_body(1, "m"), **{"x-session-id": "m"})
        in_loop(proxy, app.fleet.drain, first)
        moved = send(proxy, turn_body(2, "m"), **{"x-session-id": "m"})
        in_loop(proxy, app.fleet.drain, first, False)
        later = [send(proxy, turn_body(t, "m"), **{"x-session-id": "m"}) for t in (3, 4)]
        assert moved != first and later == [moved, moved]
        sessions = status_json(proxy)["sessions"]
        assert sessions["moved"] == {"unroutable": 1}
        assert sessions["requests"] == {"session/moved": 1, "session/new": 1, "session/stayed": 2}

    def test_off_reads_no_session_but_keeps_the_affinity_header(self, servers: Servers) -> None:
        """With sessions off nothing is bound and /status.json says so; x-kvroute-affinity still pins by hash."""
        proxy = servers.proxy(servers.emulators(4), strategy="bounded-load", sessions=SessionConfig(enabled=False))
        pinned = {send(proxy, turn_body(t, f"c{t}"), **{"x-kvroute-affinity": "pin"}) for t in range(1, 6)}
        assert len(pinned) == 1
        assert status_json(proxy)["sessions"] is None
        _, _, metrics = http("GET", proxy.url + "/metrics")
        assert b"kvroute_session_routes_total{" not in metrics


class TestReplicasWithoutPeers:
    @pytest.mark.parametrize(("agree", "split"), [("on", False), ("off", True)])
    def test_two_replicas_agree_on_each_conversation(self, servers: Servers, agree: str, split: bool) -> None:
        """Two proxies without peers, turns alternating between them: with ``agree=on`` every conversation keeps
        one engine; with ``off`` each proxy places the turns it never saw by its own state, and some split."""
        engines = servers.emulators(4)
        proxies = [
            servers.proxy(engines, strategy="bounded-load", sessions=SessionConfig(agree=agree)) for _ in range(2)
        ]
        homes: dict[str, set[str]] = {}
        for turn in range(1, 5):
            for c in range(12):
                name = f"conv-{c}"
                homes.setdefault(name, set()).add(send(proxies[(c + turn) % 2], turn_body(turn, name)))
        assert any(len(engines) > 1 for engines in homes.values()) is split, homes
        for proxy in proxies:
            sessions = status_json(proxy)["sessions"]
            assert (sessions["agree"], sessions["agreeing"]) == (agree, agree == "on"), sessions
            assert metric_value(proxy, "kvroute_sessions_agreeing") == (1.0 if agree == "on" else 0.0)

    def test_auto_shows_when_it_agrees(self, servers: Servers) -> None:
        """``auto``: a replica whose new conversations arrive with a history says it agrees (status and metric);
        one that sees every conversation from its first turn does not."""
        engines = servers.emulators(3)
        pair = [servers.proxy(engines, strategy="bounded-load") for _ in range(2)]
        alone = servers.proxy(engines, strategy="bounded-load")
        for turn in range(1, 4):
            for c in range(8):
                send(pair[(c + turn) % 2], turn_body(turn, f"pair-{c}"))
                send(alone, turn_body(turn, f"alone-{c}"))
        for proxy in pair:
            sessions = status_json(proxy)["sessions"]
            assert sessions["agreeing"] is True and sessions["with_history"] > 0, sessions
            assert metric_value(proxy, "kvroute_sessions_agreeing") == 1.0
        sessions = status_json(alone)["sessions"]
        assert (sessions["agreeing"], sessions["with_history"], sessions["new_conversations"]) == (False, 0, 8)
        assert metric_value(alone, "kvroute_sessions_agreeing") == 0.0

    def test_settings_reach_the_session_table(self) -> None:
        """Every ``[sessions]`` setting is the router's: TTL, size, conversations and agreement."""
        config = SessionConfig(ttl=42.0, max_sessions=7, conversations=False, agree="on")
        app = ProxyApp(ServerConfig(backends=(BackendConfig(id="e0", url="http://127.0.0.1:9"),), sessions=config))
        sessions = app.router.sessions
        assert sessions is not None
        assert (sessions.ttl_s, sessions.max_sessions, sessions.conversations, sessions.agree) == (42.0, 7, False, "on")
        assert not sessions.shared
