"""Discovery in `kvroute serve`: its configuration, the ``file`` provider, and a real proxy following a watched file."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any

import anyio
import pytest
from click.testing import CliRunner

from kvroute.discovery import DiscoveredBackend, Snapshot
from kvroute.errors import ConfigError
from kvroute_server import ProxyApp
from kvroute_server.cli import build_config, serve
from kvroute_server.config import DiscoveryConfig, DiscoveryPolicy, load_toml, parse_discovery_flag
from kvroute_server.fleet.providers.file import FileDiscovery
from kvroute_server.http.runner import ServerThread
from tests.server.harness import Servers, chat_body, http

#: Every wait on the proxy is bounded by this many seconds.
WAIT = 10.0


def write(path: Path, entries: list[dict[str, Any]] | str) -> None:
    """Replace the backend list atomically (write, then rename), as an operator's tooling should."""
    text = entries if isinstance(entries, str) else json.dumps({"backends": entries})
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def wait_for(check: Any, what: str) -> None:
    deadline = time.monotonic() + WAIT
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def app_of(proxy: ServerThread) -> ProxyApp:
    app = proxy.app
    assert isinstance(app, ProxyApp)
    return app


def ids(proxy: ServerThread) -> list[str]:
    return sorted(s.id for s in app_of(proxy).fleet)


class TestDiscoveryConfig:
    """``--discovery``, ``[[discovery]]`` and ``[discovery_policy]``."""

    @pytest.mark.parametrize(
        ("flag", "kind", "target"),
        [
            ("dns:vllm.default.svc:8000", "dns", "vllm.default.svc:8000"),
            ("dns:_http._tcp.vllm", "dns", "_http._tcp.vllm"),
            ("file:/etc/kvroute/fleet.toml", "file", "/etc/kvroute/fleet.toml"),
            ("kubernetes:ns/vllm:8000", "kubernetes", "ns/vllm:8000"),
        ],
    )
    def test_flag(self, flag: str, kind: str, target: str) -> None:
        """``KIND:TARGET`` splits at the first colon; the factory gets ``target``."""
        assert parse_discovery_flag(flag) == DiscoveryConfig(kind, {"target": target})

    def test_backend_kind_reaches_the_provider_as_kind(self) -> None:
        """In a [[discovery]] table `kind` is the discovery kind; `backend_kind` becomes the provider's `kind`."""
        table = {"kind": "dns", "target": "vllm:8000", "backend_kind": "vllm"}
        assert DiscoveryConfig.from_mapping(table) == DiscoveryConfig("dns", {"target": "vllm:8000", "kind": "vllm"})
        with pytest.raises(ConfigError, match="'backend_kind' must be a non-empty string"):
            DiscoveryConfig.from_mapping({"kind": "dns", "target": "x:1", "backend_kind": ""})

    @pytest.mark.parametrize("flag", ["dns", "dns:", ":x", ""])
    def test_bad_flag(self, flag: str) -> None:
        """A flag without a kind or a target is a ConfigError showing the expected shape."""
        with pytest.raises(ConfigError, match=r"--discovery must be KIND:TARGET .*got"):
            parse_discovery_flag(flag)

    def test_toml(self, tmp_path: Path) -> None:
        """[[discovery]] tables keep their options in order; api_key is the host's; [discovery_policy] is read."""
        path = tmp_path / "kvroute.toml"
        path.write_text(
            '[[discovery]]\nkind = "dns"\ntarget = "vllm:8000"\nmin_interval = 2.0\napi_key = "sk-x"\n'
            '[[discovery]]\nkind = "file"\ntarget = "fleet.json"\n'
            '[discovery_policy]\nmax_removal_share = 0.25\nremoval_interval = 3\non_mass_removal = "hold"\n'
            "stale_after = 60\n",
            encoding="utf-8",
        )
        config = load_toml(path)
        assert config.discovery == (
            DiscoveryConfig("dns", {"target": "vllm:8000", "min_interval": 2.0}, api_key="sk-x"),
            DiscoveryConfig("file", {"target": "fleet.json"}),
        )
        assert config.discovery_policy == DiscoveryPolicy(0.25, 3.0, "hold", 60.0)

    @pytest.mark.parametrize(
        ("toml", "message"),
        [
            ("[discovery_policy]\nmax_removal_share = 1.5\n", r"'max_removal_share' must be a number in \(0, 1\]"),
            ("[discovery_policy]\non_mass_removal = 'drop'\n", r"'on_mass_removal' must be one of gradual, hold"),
            ("[discovery_policy]\nremoval_interval = 0\n", r"'removal_interval' must be a number > 0 \(got 0"),
            ("[discovery_policy]\nstale = 3\n", r"\[discovery_policy\]: unknown key\(s\) 'stale'"),
            ("[[discovery]]\ntarget = 'x'\n", r"\[\[discovery\]\] #1: 'kind' must be a non-empty string"),
            ("discovery = 'dns:x:1'\n", r"'discovery' must be an array of tables"),
        ],
    )
    def test_toml_errors(self, tmp_path: Path, toml: str, message: str) -> None:
        """Bad discovery settings are ConfigErrors naming the key, the expectation and the value."""
        path = tmp_path / "kvroute.toml"
        path.write_text(toml, encoding="utf-8")
        with pytest.raises(ConfigError, match=message):
            load_toml(path)

    def test_flags(self) -> None:
        """--discovery is repeatable and the policy flags override the defaults."""
        config = build_config(
            discovery=("file:a.toml", "dns:vllm:8000"),
            max_removal_share=0.3,
            removal_interval=2.0,
            on_mass_removal="hold",
            discovery_stale_after=30.0,
        )
        assert [d.kind for d in config.discovery] == ["file", "dns"]
        assert config.discovery_policy == DiscoveryPolicy(0.3, 2.0, "hold", 30.0)

    def test_check_reports_unknown_kind(self) -> None:
        """serve --check refuses an unknown kind and lists the installed ones."""
        result = CliRunner().invoke(serve, ["--discovery", "consul:vllm", "--strategy", "random", "--check"])
        assert result.exit_code != 0
        assert "discovery kind 'consul' is not installed (installed kinds: " in result.output
        assert "dns" in result.output and "file" in result.output

    def test_check_prints_sources_with_keys_masked(self, tmp_path: Path) -> None:
        """serve --check shows the discovery sources and policy, never a source's api_key."""
        fleet = tmp_path / "fleet.json"
        write(fleet, [{"url": "http://127.0.0.1:9"}])
        config = tmp_path / "kvroute.toml"
        config.write_text(
            f'[[discovery]]\nkind = "file"\ntarget = "{fleet}"\napi_key = "sk-secret"\n', encoding="utf-8"
        )
        result = CliRunner().invoke(serve, ["--config", str(config), "--strategy", "random", "--check"])
        assert result.exit_code == 0, result.output
        described = json.loads(result.output)
        assert described["discovery"] == [{"kind": "file", "options": {"target": str(fleet)}, "api_key": "***"}]
        assert described["discovery_policy"]["on_mass_removal"] == "gradual"
        assert "sk-secret" not in result.output


class TestFileDiscovery:
    """`FileDiscovery`: the backend list's formats and the factory's options."""

    def test_toml_and_json_shapes(self, tmp_path: Path) -> None:
        """TOML [[backends]], a JSON list and a JSON {"backends": [...]} read the same; defaults fill the gaps."""
        toml = FileDiscovery.create(target=str(tmp_path / "f.toml"), kind="openai", models=["m"])
        parsed = toml.parse(
            b'[[backends]]\nid = "a"\nurl = "http://10.0.0.1:8000"\nweight = 2\nlabels = { zone = "z" }\n'
            b'[[backends]]\nurl = "http://10.0.0.2:8000"\nmodels = ["n"]\ndraining = true\n'
        )
        assert parsed.source == f"file:{tmp_path / 'f.toml'}"
        assert parsed.backends == (
            DiscoveredBackend(
                id="a", url="http://10.0.0.1:8000", weight=2, models=frozenset({"m"}), labels={"zone": "z"}
            ),
            DiscoveredBackend(id="10.0.0.2:8000", url="http://10.0.0.2:8000", models=frozenset({"n"}), draining=True),
        )
        entries = [{"id": "a", "url": "http://10.0.0.1:8000"}]
        as_json = FileDiscovery.create(target=str(tmp_path / "f.json"))
        assert as_json.parse(json.dumps(entries).encode()) == as_json.parse(json.dumps({"backends": entries}).encode())

    @pytest.mark.parametrize(
        ("text", "message"),
        [
            (b"[[backends]]\nurl = 'ftp://x'\n", r"'url' must be an http:// or https:// URL"),
            (b"[[backends]]\nurl = 'http://x'\napi_key = 'k'\n", r"'api_key' is not read from a discovery file"),
            (b"[[backends]]\nurl = 'http://x'\n[[backends]]\nurl = 'http://x'\n", r"names backend ids more than once"),
            (b"backends = 3\n", r"expected a list of backends \(got int\)"),
            (b"[[servers]]\n", r"unknown key\(s\) 'servers'"),
            (b"url = \n", r"is not valid TOML"),
            (b"[[backends]]\nurl = 'http://x'\ndraining = 'yes'\n", r"'draining' must be true or false"),
        ],
    )
    def test_invalid_lists(self, tmp_path: Path, text: bytes, message: str) -> None:
        """An invalid list is a ValueError saying what is wrong (the provider reports it as a failure)."""
        with pytest.raises(ValueError, match=message):
            FileDiscovery.create(target=str(tmp_path / "f.toml")).parse(text)

    @pytest.mark.parametrize(
        ("options", "message"),
        [
            ({"target": ""}, r"'target' must be the path"),
            ({"target": "f", "interval": 0}, r"'interval' must be a number of seconds > 0"),
            ({"target": "f", "models": [1]}, r"'models' must be a list of model names"),
            ({"target": "f", "scheme": "ftp"}, r"'scheme' must be 'http' or 'https'"),
        ],
    )
    def test_bad_options(self, options: dict[str, Any], message: str) -> None:
        """The factory refuses bad options with a ValueError (a ConfigError at startup)."""
        with pytest.raises(ValueError, match=message):
            FileDiscovery.create(**options)


@pytest.mark.anyio
class TestFileDiscoveryRun:
    """`FileDiscovery.run`: what it reports as the file comes and goes."""

    @pytest.fixture
    def anyio_backend(self) -> str:
        return "asyncio"

    async def test_missing_file_fails_then_publishes(self, tmp_path: Path) -> None:
        """A missing file is a failure naming it; once written, the next read publishes it (started told once)."""
        path = tmp_path / "fleet.json"
        reports: list[object] = []

        class Sink:
            def publish(self, snapshot: Snapshot) -> None:
                reports.append(snapshot)

            def failed(self, source: str, reason: str) -> None:
                reports.append(reason)

        provider = FileDiscovery.create(target=str(path), interval=0.02)
        async with anyio.create_task_group() as tg:
            await tg.start(provider.run, Sink())
            assert isinstance(reports[0], str) and f"cannot read {path}" in reports[0]
            write(path, [{"id": "a", "url": "http://127.0.0.1:9"}])
            with anyio.fail_after(WAIT):
                while True:
                    if any(isinstance(r, Snapshot) for r in reports):
                        break
                    await anyio.sleep(0.01)
            tg.cancel_scope.cancel()
        snapshot = next(r for r in reports if isinstance(r, Snapshot))
        assert [b.id for b in snapshot.backends] == ["a"]


def file_proxy(servers: Servers, path: Path, **config: Any) -> ServerThread:
    """A proxy whose only backends come from ``path``, read every 50 ms."""
    source = DiscoveryConfig("file", {"target": str(path), "interval": 0.05})
    return servers.proxy(discovery=(source,), **config)


def entry(backend_id: str, server: ServerThread, **fields: Any) -> dict[str, Any]:
    return {"id": backend_id, "url": server.url, **fields}


def long_stream(proxy: ServerThread, results: list[tuple[str, bytes]]) -> threading.Thread:
    """Start a 400-token stream through ``proxy`` (about 1.2 s on emulators with time_scale=0.2)."""

    def run() -> None:
        _, headers, body = http(
            "POST", proxy.url + "/v1/chat/completions", chat_body("long", max_tokens=400, stream=True)
        )
        results.append((headers.get("x-kvroute-backend", ""), body))

    thread = threading.Thread(target=run)
    thread.start()
    wait_for(lambda: any(s.in_flight for s in app_of(proxy).fleet), "the stream to start")
    return thread


class TestFileDiscoveryProxy:
    """A real proxy following a watched backend list, in front of emulators on loopback."""

    def test_edits_apply_the_difference(self, servers: Servers, tmp_path: Path) -> None:
        """An edit adds, removes and re-weights; unchanged members keep their state; a removed one finishes."""
        engines = servers.emulators(4, time_scale=0.2)
        path = tmp_path / "fleet.json"
        write(path, [entry(f"e{i}", engines[i]) for i in range(3)])
        proxy = file_proxy(servers, path)
        assert ids(proxy) == ["e0", "e1", "e2"]
        results: list[tuple[str, bytes]] = []
        thread = long_stream(proxy, results)
        fleet = app_of(proxy).fleet
        busy = next(s.id for s in fleet if s.in_flight)
        kept, reweighted = (i for i in ("e0", "e1", "e2") if i != busy)
        states = {s.id: s for s in fleet}
        write(
            path,
            [
                entry(kept, engines[int(kept[1])]),
                entry(reweighted, engines[int(reweighted[1])], weight=3),
                entry("e3", engines[3]),
            ],
        )
        wait_for(lambda: "e3" in fleet, "e3 to be added")
        assert fleet.get(kept) is states[kept] and fleet.get(reweighted) is states[reweighted]
        assert states[reweighted].backend.weight == 3
        assert busy in fleet and states[busy].draining and states[busy].in_flight == 1
        for i in range(6):
            assert http("POST", proxy.url + "/v1/chat/completions", chat_body(f"q{i}"))[1]["x-kvroute-backend"] != busy
        thread.join(timeout=60)
        assert results and results[0][0] == busy and results[0][1].endswith(b"data: [DONE]\n\n")
        wait_for(lambda: busy not in fleet, f"{busy} to be removed once idle")
        assert ids(proxy) == sorted([kept, reweighted, "e3"])

    def test_invalid_file_keeps_the_fleet_and_says_stale(self, servers: Servers, tmp_path: Path) -> None:
        """A file that turns invalid keeps the last good fleet, marked stale in /health and /metrics, until fixed."""
        engines = servers.emulators(2)
        path = tmp_path / "fleet.json"
        good = [entry("e0", engines[0]), entry("e1", engines[1])]
        write(path, good)
        proxy = file_proxy(servers, path)
        source = f"file:{path}"

        def discovery() -> dict[str, Any]:
            (found,) = json.loads(http("GET", proxy.url + "/health")[2])["discovery"]
            assert found["source"] == source
            return dict(found)

        assert discovery()["stale"] is False and discovery()["backends"] == 2
        write(path, '{"backends": [')
        wait_for(lambda: discovery()["stale"], "the source to turn stale")
        assert "is not valid JSON" in discovery()["last_error"]
        assert ids(proxy) == ["e0", "e1"] and not any(s.draining for s in app_of(proxy).fleet)
        assert http("POST", proxy.url + "/v1/chat/completions", chat_body("still served"))[0] == 200
        metrics = http("GET", proxy.url + "/metrics")[2].decode()
        assert f'kvroute_discovery_stale{{source="{source}"}} 1.0' in metrics
        write(path, good)
        wait_for(lambda: not discovery()["stale"], "the source to recover")
        assert f'kvroute_discovery_stale{{source="{source}"}} 0.0' in http("GET", proxy.url + "/metrics")[2].decode()

    def test_empty_list_keeps_the_fleet(self, servers: Servers, tmp_path: Path) -> None:
        """A list emptied by mistake is not an empty fleet: the last good set is kept and the source is stale."""
        engines = servers.emulators(2)
        path = tmp_path / "fleet.json"
        write(path, [entry("e0", engines[0]), entry("e1", engines[1])])
        proxy = file_proxy(servers, path)
        write(path, [])
        wait_for(lambda: json.loads(http("GET", proxy.url + "/health")[2])["discovery"][0]["stale"], "stale")
        time.sleep(0.2)
        assert ids(proxy) == ["e0", "e1"] and not any(s.draining for s in app_of(proxy).fleet)

    def test_draining_entry_finishes_its_request_and_stays(self, servers: Servers, tmp_path: Path) -> None:
        """``draining = true`` stops new requests to a backend, lets its stream finish, and keeps it a member."""
        engines = servers.emulators(2, time_scale=0.2)
        path = tmp_path / "fleet.json"
        write(path, [entry("e0", engines[0]), entry("e1", engines[1])])
        proxy = file_proxy(servers, path)
        results: list[tuple[str, bytes]] = []
        thread = long_stream(proxy, results)
        fleet = app_of(proxy).fleet
        busy = next(s.id for s in fleet if s.in_flight)
        write(path, [entry(i, engines[int(i[1])], draining=i == busy) for i in ("e0", "e1")])
        wait_for(lambda: fleet.get(busy).draining, f"{busy} to drain")
        for i in range(4):
            assert http("POST", proxy.url + "/v1/chat/completions", chat_body(f"q{i}"))[1]["x-kvroute-backend"] != busy
        thread.join(timeout=60)
        assert results[0][1].endswith(b"data: [DONE]\n\n")
        time.sleep(0.2)
        assert ids(proxy) == ["e0", "e1"] and fleet.get(busy).draining

    def test_replicas_on_the_same_file_agree_on_every_home(self, servers: Servers, tmp_path: Path) -> None:
        """Two proxies (replicas, or workers) reading the same list send every prefix to the same home, before and
        after an edit, whatever order the entries come in."""
        engines = servers.emulators(4)
        path = tmp_path / "fleet.json"
        write(path, [entry(f"e{i}", engines[i]) for i in range(3)])
        options = {"strategy": "consistent-hash", "options": {"prefix_length": 1024}}
        replicas = [file_proxy(servers, path, **options), file_proxy(servers, path, **options)]

        def homes(proxy: ServerThread) -> list[str]:
            return [
                http("POST", proxy.url + "/v1/chat/completions", chat_body(f"doc {i} " * 300))[1]["x-kvroute-backend"]
                for i in range(16)
            ]

        before = homes(replicas[0])
        assert homes(replicas[1]) == before and len(set(before)) > 1
        write(path, [entry(f"e{i}", engines[i]) for i in (3, 2, 1, 0)])
        for proxy in replicas:
            wait_for(lambda proxy=proxy: "e3" in ids(proxy), "e3 in every replica")
        after = homes(replicas[0])
        assert homes(replicas[1]) == after and "e3" in after
        assert all(a == b for a, b in zip(before, after, strict=True) if a != "e3" and b != "e3")
