"""Warm join in the proxy: options, what counts as a join, pre-fill and slow start, failures and shutdown."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from structlog.testing import capture_logs

from kvroute.errors import ConfigError, KvrouteError
from kvroute.fleet import Fleet
from kvroute.plugins import PluginManager
from kvroute_server import ServerThread
from kvroute_server.cli import build_config
from kvroute_server.config import BackendConfig, DiscoveryConfig, HealthConfig, WarmJoinConfig, load_toml
from kvroute_server.fleet.backends import BackendSet
from kvroute_server.ops.metrics import ProxyMetrics
from tests.server.harness import MODEL, Servers, http, in_loop

pytestmark = pytest.mark.e2e

TOKEN = "admin-token-0123456789"
AUTH = {"authorization": f"Bearer {TOKEN}"}
#: Sixteen system prompts (~300 tokens each), each sent twice before the join: all hot.
SYSTEMS = [f"System prompt {i}: " + " ".join(f"rule{i}x{j}" for j in range(300)) for i in range(16)]


def _chat(system: str, question: str) -> dict[str, Any]:
    messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
    return {"model": MODEL, "messages": messages, "max_tokens": 2}


def _warm_traffic(proxy: ServerThread) -> None:
    for round_ in range(2):
        for system in SYSTEMS:
            assert http("POST", proxy.url + "/v1/chat/completions", _chat(system, f"question {round_}"))[0] == 200


def _until(condition: Callable[[], bool], within: float = 15.0) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return condition()


def _state(proxy: ServerThread, backend_id: str) -> tuple[float, bool]:
    """The backend's (weight, draining) in the proxy's fleet."""
    state = in_loop(proxy, proxy.app.fleet.get, backend_id)
    return state.backend.weight, state.draining


def _warming(proxy: ServerThread) -> list[str]:
    return in_loop(proxy, lambda: proxy.app.warm_join.warming)


def _generation_requests(emulator: ServerThread) -> int:
    return int(json.loads(http("GET", emulator.url + "/emulator/stats")[2])["requests"])


def _task_names(proxy: ServerThread) -> set[str]:
    return in_loop(proxy, lambda: {task.get_name() for task in asyncio.all_tasks()})


def _closed_port() -> int:
    """A loopback port nothing listens on (connections are refused)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@contextlib.contextmanager
def _silent_server() -> Iterator[str]:
    """The URL of a server that accepts connections (the kernel's backlog) and never answers."""
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(16)
    try:
        yield f"http://127.0.0.1:{silent.getsockname()[1]}"
    finally:
        silent.close()


def _events(logs: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    return [e for e in logs if e["event"] == name]


def _proxy(servers: Servers, backends: list[ServerThread], warm: WarmJoinConfig, **config: Any) -> ServerThread:
    # A fixed key (the system prompt's first characters): each prefix has one home, known at the join.
    options = {"prefix": "fixed", "prefix_length": 1024}
    return servers.proxy(
        backends, strategy="consistent-hash", options=options, admin_token=TOKEN, warm_join=warm, **config
    )


@pytest.fixture
def logs() -> Iterator[list[dict[str, Any]]]:
    """Every structlog event of the test (the proxy's thread included)."""
    with capture_logs() as captured:
        yield captured


class TestWarmJoinConfig:
    """`WarmJoinConfig` from TOML and flags, and its errors."""

    def test_off_by_default(self) -> None:
        """With no option given, neither pre-fill nor slow start is on."""
        assert not build_config().warm_join.enabled

    def test_toml_and_flags(self, tmp_path: Path) -> None:
        """[warm_join] keys set the options, and flags override them one by one."""
        path = tmp_path / "k.toml"
        path.write_text("[warm_join]\nslow_start = 60\nprefill = 32\nprefill_timeout = 10\n", encoding="utf-8")
        assert load_toml(path).warm_join == WarmJoinConfig(slow_start=60, prefill=32, prefill_timeout=10)
        config = build_config(config_file=str(path), slow_start_steps=4, prefill_concurrency=3, slow_start_initial=0.5)
        assert config.warm_join == WarmJoinConfig(
            slow_start=60,
            slow_start_initial=0.5,
            slow_start_steps=4,
            prefill=32,
            prefill_concurrency=3,
            prefill_timeout=10,
        )

    @pytest.mark.parametrize(
        ("toml", "message"),
        [
            ("slow_start = -1", r"'slow_start' must be a number >= 0 \(got -1\)"),
            ("slow_start_initial = 0", r"'slow_start_initial' must be a fraction in \(0, 1\] .* \(got 0\)"),
            ("slow_start_steps = 0", r"'slow_start_steps' must be an integer >= 1 \(got 0\)"),
            ("prefill = -2", r"'prefill' must be an integer >= 0 \(got -2\)"),
            ("prefill = 1.5", r"\[warm_join\] 'prefill' must be int \(got float 1.5\)"),
            ("prefill_concurrency = 0", r"'prefill_concurrency' must be an integer >= 1 \(got 0\)"),
            ("prefill_timeout = 0", r"'prefill_timeout' must be a number > 0 \(got 0\)"),
            ("warm = 1", r"\[warm_join\]: unknown key\(s\) 'warm'"),
        ],
    )
    def test_toml_errors(self, tmp_path: Path, toml: str, message: str) -> None:
        """A bad [warm_join] value is a ConfigError naming the key, what it expects and what it got."""
        path = tmp_path / "k.toml"
        path.write_text(f"[warm_join]\n{toml}\n", encoding="utf-8")
        with pytest.raises(ConfigError, match=message):
            load_toml(path)

    def test_flag_error(self) -> None:
        """A bad flag value is reported like the TOML one."""
        with pytest.raises(KvrouteError, match=r"'slow_start_initial' must be a fraction in \(0, 1\]"):
            build_config(slow_start=5.0, slow_start_initial=1.5)


class TestBackendSetHold:
    """`BackendSet.hold`/`end_hold` keep the proxy's own drain apart from the operator's."""

    def _set(self) -> BackendSet:
        fleet = Fleet()
        health = HealthConfig(interval=0)
        backends = BackendSet(fleet, PluginManager(), health, ProxyMetrics(fleet, "random"), connect_timeout=1.0)
        backends.add(BackendConfig(id="a", url="http://127.0.0.1:9"))
        return backends

    def test_release_restores_the_operators_state(self) -> None:
        """A hold drains; its release undrains, unless the operator drained the backend during the hold."""
        backends = self._set()
        backends.hold("a")
        assert backends.fleet.get("a").draining
        backends.end_hold("a")
        assert not backends.fleet.get("a").draining
        backends.hold("a")
        backends.drain("a")
        backends.end_hold("a")
        assert backends.fleet.get("a").draining

    def test_operator_undrain_waits_for_the_release(self) -> None:
        """Undraining a held backend takes effect only when the hold ends."""
        backends = self._set()
        backends.drain("a")
        backends.hold("a")
        backends.drain("a", draining=False)
        assert backends.fleet.get("a").draining
        backends.end_hold("a")
        assert not backends.fleet.get("a").draining

    def test_watch_reports_adds_and_removes(self) -> None:
        """Watchers hear of each add and remove, not of the members given at construction."""
        backends = self._set()
        seen: list[tuple[str, bool]] = []
        unwatch = backends.watch(lambda backend_id, joined: seen.append((backend_id, joined)))
        backends.add(BackendConfig(id="b", url="http://127.0.0.1:9"))
        backends.remove("b")
        unwatch()
        backends.add(BackendConfig(id="c", url="http://127.0.0.1:9"))
        assert seen == [("b", True), ("b", False)]


class TestWarmJoin:
    """Joins through discovery and the admin API, against emulators on loopback."""

    def test_discovery_join_prefills_then_ramps_but_startup_does_not(
        self, servers: Servers, tmp_path: Path, logs: list[dict[str, Any]]
    ) -> None:
        """The discovered fleet at startup is left alone; a backend discovered later is pre-filled, then ramped."""
        a, b, c = servers.emulators(3)
        fleet_file = tmp_path / "fleet.toml"
        tables = "".join(f'[[backends]]\nid = "{n}"\nurl = "{e.url}"\n' for n, e in (("a", a), ("b", b)))
        fleet_file.write_text(tables, encoding="utf-8")
        warm = WarmJoinConfig(prefill=16, slow_start=1.0, slow_start_steps=4)
        source = DiscoveryConfig(kind="file", options={"target": str(fleet_file), "interval": 0.1})
        proxy = _proxy(servers, [], warm, discovery=(source,))
        _warm_traffic(proxy)
        assert not _events(logs, "warm_join_started")
        assert _state(proxy, "a") == (1.0, False) and _state(proxy, "b") == (1.0, False)

        fleet_file.write_text(tables + f'[[backends]]\nid = "c"\nurl = "{c.url}"\n', encoding="utf-8")
        assert _until(lambda: bool(_events(logs, "warm_join_started")))
        assert _until(lambda: not _warming(proxy))
        (prefilled,) = _events(logs, "warm_join_prefilled")
        assert prefilled["backend"] == "c" and prefilled["planned"] > 0
        assert prefilled["sent"] == prefilled["planned"] and prefilled["failed"] == 0
        assert _generation_requests(c) == prefilled["planned"]
        weights = [e for e in logs if e["event"] == "fleet_changed" and e["backend"] == "c" and e["change"] == "weight"]
        assert len(weights) == 5  # down to 10 %, then four steps back to full
        routing = {"added", "draining", "weight", "undrained"}
        changes = [e["change"] for e in logs if e["event"] == "fleet_changed" and e["backend"] == "c"]
        changes = [change for change in changes if change in routing]
        assert changes[:4] == ["added", "draining", "weight", "undrained"]  # lowered before it takes requests
        assert _state(proxy, "c") == (1.0, False)
        # The first live request of each prefix c now owns finds its prefix in c's cache.
        on_c = 0
        for system in SYSTEMS:
            _, headers, body = http("POST", proxy.url + "/v1/chat/completions", _chat(system, "a new question"))
            if headers["x-kvroute-backend"] == "c":
                on_c += 1
                assert json.loads(body)["usage"]["prompt_tokens_details"]["cached_tokens"] > 250
        assert on_c == prefilled["planned"]

    def test_admin_join_with_slow_start_only(self, servers: Servers, logs: list[dict[str, Any]]) -> None:
        """Without pre-fill, a backend added through the admin API starts at 10 % of its weight at once."""
        a, b, c = servers.emulators(3)
        proxy = _proxy(servers, [a, b], WarmJoinConfig(slow_start=60.0))
        status, _, _ = http("POST", proxy.url + "/admin/backends", {"id": "c", "url": c.url, "weight": 2}, headers=AUTH)
        assert status == 201
        assert _state(proxy, "c") == (pytest.approx(0.2), False)
        assert _warming(proxy) == ["c"]
        assert _generation_requests(c) == 0

    def test_operator_weight_ends_the_ramp(self, servers: Servers, logs: list[dict[str, Any]]) -> None:
        """A weight set through the admin API during the ramp stays: the ramp stops instead of overwriting it."""
        a, b, c = servers.emulators(3)
        proxy = _proxy(servers, [a, b], WarmJoinConfig(slow_start=2.0, slow_start_steps=10))
        assert http("POST", proxy.url + "/admin/backends", {"id": "c", "url": c.url}, headers=AUTH)[0] == 201
        assert http("PATCH", proxy.url + "/admin/backends/c", {"weight": 3}, headers=AUTH)[0] == 200
        assert _until(lambda: not _warming(proxy), within=5.0)
        assert _events(logs, "slow_start_overridden") and not _events(logs, "slow_start_done")
        assert _state(proxy, "c") == (3.0, False)

    def test_failing_prefill_is_logged_and_the_backend_serves(
        self, servers: Servers, logs: list[dict[str, Any]]
    ) -> None:
        """Pre-fill requests that fail are counted in the log; the backend is released and then takes traffic."""
        a, b, c = servers.emulators(3)
        assert http("POST", c.url + "/emulator/faults", {"error_next": -1})[0] == 200
        proxy = _proxy(servers, [a, b], WarmJoinConfig(prefill=16))
        _warm_traffic(proxy)
        assert http("POST", proxy.url + "/admin/backends", {"id": "c", "url": c.url}, headers=AUTH)[0] == 201
        assert _until(lambda: not _warming(proxy))
        (prefilled,) = _events(logs, "warm_join_prefilled")
        assert prefilled["planned"] > 0 and prefilled["failed"] == prefilled["planned"] and prefilled["sent"] == 0
        assert prefilled["error"] == "status 500"
        assert _state(proxy, "c") == (1.0, False)
        assert http("POST", c.url + "/emulator/faults", {"error_next": 0})[0] == 200
        backends = {
            http("POST", proxy.url + "/v1/chat/completions", _chat(s, "q"))[1]["x-kvroute-backend"] for s in SYSTEMS
        }
        assert backends == {"e0", "e1", "c"}

    def test_unreachable_backend_is_logged_and_released(self, servers: Servers, logs: list[dict[str, Any]]) -> None:
        """Pre-fill requests that cannot connect are counted in the log; the proxy goes on serving."""
        a, b = servers.emulators(2)
        proxy = _proxy(servers, [a, b], WarmJoinConfig(prefill=16))
        _warm_traffic(proxy)
        url = f"http://127.0.0.1:{_closed_port()}"
        assert http("POST", proxy.url + "/admin/backends", {"id": "c", "url": url}, headers=AUTH)[0] == 201
        assert _until(lambda: not _warming(proxy))
        (prefilled,) = _events(logs, "warm_join_prefilled")
        assert prefilled["planned"] > 0 and prefilled["failed"] == prefilled["planned"]
        assert "failed" in prefilled["error"]
        assert not _state(proxy, "c")[1]
        assert all(http("POST", proxy.url + "/v1/chat/completions", _chat(s, "q"))[0] == 200 for s in SYSTEMS[:4])

    def test_leaving_ends_the_warm_up(self, servers: Servers) -> None:
        """A backend removed while it is pre-filled (from a silent server) has no warm-up task left."""
        a, b = servers.emulators(2)
        with _silent_server() as url:
            proxy = _proxy(servers, [a, b], WarmJoinConfig(prefill=16, prefill_timeout=120.0, slow_start=60.0))
            _warm_traffic(proxy)
            assert http("POST", proxy.url + "/admin/backends", {"id": "c", "url": url}, headers=AUTH)[0] == 201
            assert _warming(proxy) == ["c"] and "warm join c" in _task_names(proxy)
            assert http("DELETE", proxy.url + "/admin/backends/c", headers=AUTH)[0] == 200
            assert _until(lambda: "warm join c" not in _task_names(proxy), within=5.0)
            assert not _warming(proxy)

    def test_shutdown_during_prefill_is_prompt(self, servers: Servers, logs: list[dict[str, Any]]) -> None:
        """Stopping the proxy while a pre-fill waits on a silent backend ends it at once, with no error logged."""
        a, b = servers.emulators(2)
        with _silent_server() as url:
            warm = WarmJoinConfig(prefill=16, prefill_timeout=120.0, slow_start=60.0)
            proxy = _proxy(servers, [a, b], warm)
            _warm_traffic(proxy)
            assert http("POST", proxy.url + "/admin/backends", {"id": "c", "url": url}, headers=AUTH)[0] == 201
            assert _warming(proxy) == ["c"] and _state(proxy, "c")[1]  # held while pre-filling
            started = time.monotonic()
            proxy.stop()
            assert time.monotonic() - started < 10.0
            assert not [e for e in logs if e.get("log_level") == "error"]
