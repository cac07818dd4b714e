"""Shadow strategies in ``kvroute serve``: configuration, metrics, and that shadows never change live routing."""

from __future__ import annotations

from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvroute.errors import ConfigError, KvrouteError
from kvroute_server import ProxyApp, ServerConfig, ServerThread
from kvroute_server.cli import build_config
from kvroute_server.config import config_from_mapping
from kvroute_server.ops.shadow import NoShadows
from tests.server.harness import Servers, chat_body, http

SHADOW_FAMILIES = (
    "kvroute_strategy_decisions",
    "kvroute_predicted_reused_tokens",
    "kvroute_reusable_tokens",
    "kvroute_shadow_agreements",
    "kvroute_shadow_errors",
    "kvroute_cache_view_prompt_tokens",
)


def samples(proxy: ServerThread) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    code, _, body = http("GET", proxy.url + "/metrics")
    assert code == 200
    out = {}
    for family in text_string_to_metric_families(body.decode()):
        for sample in family.samples:
            out[sample.name, tuple(sorted(sample.labels.items()))] = sample.value
    return out


def shared_prefix_texts(count: int, groups: int = 3, prefix_words: int = 120) -> list[str]:
    prefixes = [" ".join(f"g{g}w{i}" for i in range(prefix_words)) for g in range(groups)]
    return [f"{prefixes[n % groups]} question {n} " + " ".join(f"q{n}w{i}" for i in range(20)) for n in range(count)]


class TestShadowConfig:
    def test_toml(self) -> None:
        """[routing] shadow, shadow_options tables and cache_view are read from TOML."""
        config = config_from_mapping(
            {
                "routing": {
                    "strategy": "least-outstanding",
                    "shadow": ["random", "consistent-hash"],
                    "shadow_options": {"consistent-hash": {"prefix_length": 1024}},
                    "cache_view": {"units": "words", "block_size": 32},
                }
            }
        )
        assert config.shadow == ("random", "consistent-hash")
        assert config.shadow_options == {"consistent-hash": {"prefix_length": 1024}}
        assert config.cache_view == {"units": "words", "block_size": 32}

    def test_flags(self) -> None:
        """--shadow takes comma lists (repeatable), --shadow-option NAME.KEY=VALUE and --cache-view KEY=VALUE."""
        config = build_config(
            strategy="least-outstanding",
            shadow=("random,consistent-hash", "bounded-load"),
            shadow_options=("consistent-hash.prefix-length=2048", "bounded-load.load_factor=1.5"),
            cache_view=("units=words", "block_size=16"),
        )
        assert config.shadow == ("random", "consistent-hash", "bounded-load")
        assert config.shadow_options == {
            "consistent-hash": {"prefix_length": "2048"},
            "bounded-load": {"load_factor": "1.5"},
        }
        assert config.cache_view == {"units": "words", "block_size": 16}

    @pytest.mark.parametrize(
        ("changes", "message"),
        [
            ({"shadow": ("random", "random")}, "names each strategy once"),
            ({"strategy": "random", "shadow": ("random",)}, "must not name the live strategy 'random'"),
            ({"shadow": ("random",), "shadow_options": {"bounded-load": {}}}, "'bounded-load', which is not a shadow"),
            (
                {"shadow": ("random",), "cache_view": {"blocks": 3}},
                r"\[routing.cache_view\]: unknown key\(s\) 'blocks'",
            ),
            ({"shadow": ("random",), "cache_view": {"block_size": "x"}}, "'block_size' must be int"),
        ],
    )
    def test_refused(self, changes: dict[str, Any], message: str) -> None:
        """Duplicate shadows, the live strategy as a shadow, stray options and bad cache view keys are refused."""
        with pytest.raises(ConfigError, match=message):
            ServerConfig(**changes)

    def test_bad_flag(self) -> None:
        """A --shadow-option without NAME. is refused with the expected shape."""
        with pytest.raises(ConfigError, match=r"must be NAME.KEY=VALUE"):
            build_config(shadow=("random",), shadow_options=("seed=1",))
        with pytest.raises(KvrouteError, match="--cache-view block_size= must be an integer"):
            build_config(shadow=("random",), cache_view=("block_size=big",))

    def test_unknown_shadow_strategy(self) -> None:
        """A shadow that is not an installed strategy fails at startup, naming it."""
        with pytest.raises(ConfigError, match="unknown strategy 'no-such'"):
            ProxyApp(ServerConfig(shadow=("no-such",)))

    def test_bad_cache_view_value(self) -> None:
        """A cache view setting the view refuses fails at startup, naming the table."""
        with pytest.raises(ConfigError, match=r"\[routing.cache_view\]: 'units' must be 'chars' or 'words'"):
            ProxyApp(ServerConfig(strategy="random", shadow=("least-outstanding",), cache_view={"units": "bytes"}))


class TestShadowProxy:
    def test_off_by_default(self, servers: Servers) -> None:
        """Without shadows the proxy builds no shadow set and exports no shadow metric."""
        proxy = servers.proxy(servers.emulators(1))
        app = proxy.app
        assert isinstance(app, ProxyApp)
        assert isinstance(app.shadows, NoShadows) and app.forwarder.shadows is app.shadows
        http("POST", proxy.url + "/v1/chat/completions", chat_body("hello there"))
        names = {name for name, _ in samples(proxy)}
        assert not any(name.startswith(SHADOW_FAMILIES) for name in names)

    def test_series_exist_at_zero(self, servers: Servers) -> None:
        """With shadows configured every per-strategy series is exported at 0 before any request."""
        proxy = servers.proxy(servers.emulators(2), shadow=("random", "consistent-hash"))
        found = samples(proxy)
        for strategy, role in (("least-outstanding", "live"), ("random", "shadow"), ("consistent-hash", "shadow")):
            labels = (("role", role), ("strategy", strategy))
            for name in ("kvroute_strategy_decisions_total", "kvroute_predicted_reused_tokens_total"):
                assert found[name, labels] == 0.0
        for strategy in ("random", "consistent-hash"):
            assert found["kvroute_shadow_agreements_total", (("strategy", strategy),)] == 0.0

    def test_shadows_do_not_change_live_routing(self, servers: Servers) -> None:
        """The same seeded traffic goes to the same backends with and without shadows, and nothing stays in flight."""
        texts = shared_prefix_texts(12)
        placements = []
        for shadow in ((), ("least-outstanding", "consistent-hash")):
            proxy = servers.proxy(servers.emulators(3), strategy="random", shadow=shadow)
            sent = []
            for text in texts:
                code, headers, body = http("POST", proxy.url + "/v1/chat/completions", chat_body(text))
                assert code == 200, body
                sent.append(headers["x-kvroute-backend"])
            placements.append(sent)
            app = proxy.app
            assert isinstance(app, ProxyApp)
            assert all(state.in_flight == 0 for state in app.fleet)
        assert placements[0] == placements[1]

    def test_counts_and_agreement(self, servers: Servers) -> None:
        """Each request is decided once per strategy; a shadow agreeing on every request counts every one."""
        # least-outstanding with one backend always agrees with the live random strategy.
        proxy = servers.proxy(servers.emulators(1), strategy="random", shadow=("least-outstanding",))
        for text in shared_prefix_texts(5):
            assert http("POST", proxy.url + "/v1/chat/completions", chat_body(text))[0] == 200
        found = samples(proxy)
        shadow = (("role", "shadow"), ("strategy", "least-outstanding"))
        assert found["kvroute_strategy_decisions_total", (("role", "live"), ("strategy", "random"))] == 5
        assert found["kvroute_strategy_decisions_total", shadow] == 5
        assert found["kvroute_shadow_agreements_total", (("strategy", "least-outstanding"),)] == 5
        assert found["kvroute_predicted_reused_tokens_total", shadow] > 0
        assert found["kvroute_cache_view_prompt_tokens_total", ()] > 0

    def test_failing_shadow_is_counted_not_fatal(self, servers: Servers) -> None:
        """A shadow whose pick raises is counted in kvroute_shadow_errors; the request is answered."""
        proxy = servers.proxy(servers.emulators(2), strategy="random", shadow=("least-outstanding",))
        app = proxy.app
        assert isinstance(app, ProxyApp) and app.shadows is not None

        def broken(request: object, candidates: object) -> object:
            raise RuntimeError("shadow bug")

        app.shadows.set.shadows[0].strategy.pick = broken  # type: ignore[method-assign]
        assert http("POST", proxy.url + "/v1/chat/completions", chat_body("hello there"))[0] == 200
        found = samples(proxy)
        assert found["kvroute_shadow_errors_total", (("strategy", "least-outstanding"),)] == 1
        assert found["kvroute_strategy_decisions_total", (("role", "shadow"), ("strategy", "least-outstanding"))] == 0
