"""Peer discovery's settings, its self-recognition and how answers change the peer set (in process, no DNS)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvroute.cli import main
from kvroute.discovery import DiscoveredBackend, Snapshot
from kvroute.errors import ConfigError
from kvroute_server import ProxyApp, ServerConfig
from kvroute_server.config import DiscoveryConfig, PeerConfig, load_toml
from kvroute_server.ops.peer_discovery import SelfAddress
from kvroute_server.ops.peers import PeerSync

TOKEN = "peer-token-0123456789"
SOURCE = "dns:routers.kvroute.test:8000"


def serve(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, ["serve", *args, "--check"])
    return result.exit_code, result.output


class TestSettings:
    def test_the_flag_and_the_table_give_the_same_sources(self, tmp_path: Path) -> None:
        """``--peer-discovery dns:NAME:PORT`` and ``[peers] discovery`` (string or table) build one source each."""
        code, out = serve("--peer-token", TOKEN, "--peer-discovery", "dns:routers.svc:8000")
        assert code == 0, out
        assert json.loads(out)["peers"]["discovery"] == [{"kind": "dns", "options": {"target": "routers.svc:8000"}}]
        path = tmp_path / "kvroute.toml"
        path.write_text(
            f'[peers]\ntoken = "{TOKEN}"\ndiscovery = ["dns:a.svc:8000"]\n'
            '[[peers.discovery]]\nkind = "dns"\ntarget = "b.svc:8000"\nnameserver = "127.0.0.1:53"\n'
        )
        with pytest.raises(ConfigError, match="is not valid TOML"):
            load_toml(path)  # a key and an array of tables of the same name: invalid TOML, said so
        path.write_text(
            f'[peers]\ntoken = "{TOKEN}"\n[[peers.discovery]]\nkind = "dns"\ntarget = "b.svc:8000"\n'
            'nameserver = "127.0.0.1:53"\n'
        )
        sources = load_toml(path).peers.discovery
        assert sources == (DiscoveryConfig("dns", {"target": "b.svc:8000", "nameserver": "127.0.0.1:53"}),)
        code, out = serve("--config", str(path), "--peer-discovery", "file:peers.toml")
        assert [s["kind"] for s in json.loads(out)["peers"]["discovery"]] == ["dns", "file"]  # the flag adds

    @pytest.mark.parametrize(
        ("spec", "expected", "got"),
        [
            ("dns", "--peer-discovery must be KIND:TARGET such as 'dns:vllm.default.svc:8000'", "(got 'dns')"),
            ("dns:routers", "peer discovery: discovery 'dns' rejected its options", "(got 'routers')"),
            ("carrier-pigeon:x", "discovery kind 'carrier-pigeon' is not installed", "(installed kinds: dns, file"),
        ],
    )
    def test_a_malformed_spec_is_one_line_naming_what_was_expected(self, spec: str, expected: str, got: str) -> None:
        """A bad source is refused at start with one line saying what was expected and what was got."""
        code, out = serve("--peer-token", TOKEN, "--peer-discovery", spec)
        assert code != 0
        assert out.startswith("Error: ") and out.count("\n") == 1 and "Traceback" not in out, out
        assert expected in out and got in out, out

    def test_the_file_names_the_peers_and_the_environment_gives_the_token(self, tmp_path: Path) -> None:
        """A file with ``[peers] discovery`` and no token loads; ``KVROUTE_PEER_TOKEN`` completes it (a Secret)."""
        path = tmp_path / "kvroute.toml"
        path.write_text(f'[peers]\ndiscovery = ["{SOURCE}"]\n')
        assert load_toml(path).peers.discovery[0].options == {"target": SOURCE.removeprefix("dns:")}
        result = CliRunner().invoke(
            main, ["serve", "--config", str(path), "--check"], env={"KVROUTE_PEER_TOKEN": TOKEN}
        )
        assert result.exit_code == 0, result.output
        result = CliRunner().invoke(main, ["serve", "--config", str(path), "--check"], env={"KVROUTE_PEER_TOKEN": ""})
        assert result.exit_code != 0 and "no peer token is set" in result.output

    def test_a_peer_source_needs_the_token(self) -> None:
        """Discovered peers need the shared token as listed ones do."""
        code, out = serve("--peer-discovery", SOURCE)
        assert code != 0 and "no peer token is set" in out, out

    @pytest.mark.parametrize(
        ("value", "expected"),
        [
            (3, "[peers] 'discovery' must be a list of 'KIND:TARGET' strings or tables with 'kind' (got 3)."),
            ([{"target": "x:1"}], "[peers] discovery #1: 'kind' must be a non-empty string"),
            ([{"kind": "dns", "target": "x:1", "api_key": "k"}], "'api_key' is for backends"),
            ([{"kind": "dns", "target": "x:1", "backend_kind": "vllm"}], "'backend_kind' is for backends"),
        ],
    )
    def test_bad_tables_are_refused(self, value: object, expected: str) -> None:
        """Each wrong shape of ``[peers] discovery`` is a `ConfigError` naming it."""
        with pytest.raises(ConfigError) as caught:
            PeerConfig(discovery=value, token=TOKEN)  # type: ignore[arg-type]
        assert expected in str(caught.value)


class TestSelfAddress:
    @pytest.mark.parametrize(
        ("host", "url", "itself"),
        [
            ("127.0.0.3", "http://127.0.0.3:8000", True),
            ("127.0.0.3", "http://127.0.0.2:8000", False),
            ("127.0.0.3", "http://127.0.0.3:8001", False),
            ("0.0.0.0", "http://127.0.0.1:8000", True),  # a local address on the listen port
            ("0.0.0.0", "http://192.0.2.7:8000", False),  # TEST-NET-1: no interface of this host has it
            ("0.0.0.0", "http://127.0.0.1:9", False),
            ("::1", "http://[::1]:8000", True),
            ("router-0.svc", "http://ROUTER-0.svc:8000", True),
            ("router-0.svc", "http://router-1.svc:8000", False),
            ("127.0.0.3", "http://127.0.0.3:notaport", False),
        ],
    )
    def test_matches(self, host: str, url: str, itself: bool) -> None:
        """A peer URL is this replica exactly when it names the listen port and the listen (or a local) address."""
        assert SelfAddress(host, 8000).matches(url) is itself


def sync(host: str = "127.0.0.3", port: int = 8000, urls: tuple[str, ...] = ()) -> PeerSync:
    config = ServerConfig(
        host=host,
        port=port,
        access_log=False,
        peers=PeerConfig(urls=urls, token=TOKEN, discovery=(DiscoveryConfig("dns", {"target": "routers.t:8000"}),)),
    )
    peers = ProxyApp(config).peers
    assert isinstance(peers, PeerSync)
    return peers


def answer(*addresses: str) -> Snapshot:
    found = [DiscoveredBackend(id=f"{a}:8000", url=f"http://{a}:8000") for a in addresses]
    return Snapshot("dns:routers.t:8000", found)


def changes(peers: PeerSync) -> dict[str, float]:
    return {
        s.labels["change"]: s.value
        for m in peers.peer_metrics.changes.collect()
        for s in m.samples
        if s.name.endswith("_total")
    }


class TestPeerSet:
    def test_answers_add_and_remove_peers_and_skip_itself(self) -> None:
        """New addresses become peers, gone ones stop being peers, this replica's own one never is."""
        peers = sync()
        peers.discovery.publish(answer("127.0.0.2", "127.0.0.3", "127.0.0.4"))
        assert sorted(peers.peers) == ["http://127.0.0.2:8000", "http://127.0.0.4:8000"]
        peers.peers["http://127.0.0.4:8000"].queue.extend([object()] * 3)  # type: ignore[list-item]
        peers.discovery.publish(answer("127.0.0.2", "127.0.0.3"))
        assert list(peers.peers) == ["http://127.0.0.2:8000"]
        assert changes(peers) == {"added": 2.0, "self": 1.0, "removed": 1.0}
        dropped = peers.peer_metrics.dropped.labels("http://127.0.0.4:8000", "peer_gone")._value.get()
        assert dropped == 3  # its waiting holds are counted, not silently lost

    def test_a_failure_or_an_empty_answer_keeps_the_last_peers(self) -> None:
        """DNS failing (or answering nothing) keeps the peers, counts the failure, marks the source stale."""
        peers = sync()
        peers.discovery.publish(answer("127.0.0.2", "127.0.0.4"))
        peers.discovery.failed("dns:routers.t:8000", "timeout: no answer")
        peers.discovery.publish(answer())
        assert sorted(peers.peers) == ["http://127.0.0.2:8000", "http://127.0.0.4:8000"]
        assert peers.peer_metrics.failures.labels("dns:routers.t:8000")._value.get() == 2
        assert peers.peer_metrics.stale.labels("dns:routers.t:8000")._value.get() == 1
        assert peers.discovery.describe()[0]["stale"] is True
        peers.discovery.publish(answer("127.0.0.2"))
        assert list(peers.peers) == ["http://127.0.0.2:8000"]
        assert peers.peer_metrics.stale.labels("dns:routers.t:8000")._value.get() == 0

    def test_a_static_peer_that_discovery_also_names_stays_when_discovery_drops_it(self) -> None:
        """``--peer`` URLs are never removed by discovery."""
        peers = sync(urls=("http://127.0.0.2:8000",))
        peers.discovery.publish(answer("127.0.0.2", "127.0.0.4"))
        peers.discovery.publish(answer("127.0.0.4"))
        assert sorted(peers.peers) == ["http://127.0.0.2:8000", "http://127.0.0.4:8000"]
        assert changes(peers) == {"added": 1.0}

    def test_a_listed_url_that_is_this_replica_gets_no_sender(self) -> None:
        """``--peer`` naming this replica's own listen address is known as itself at once, without a 409 round trip."""
        peers = sync(urls=("http://127.0.0.3:8000", "http://127.0.0.2:8000"))
        assert peers.peer_metrics.up.labels("http://127.0.0.3:8000")._value.get() == -1
        assert ("http://127.0.0.2:8000",) not in {k for k in peers.peer_metrics.up._metrics}
