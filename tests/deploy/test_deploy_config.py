"""The kvroute.toml files the image and the manifests ship: they load, and they point at the engines."""

from __future__ import annotations

import json
import os
import tomllib
from pathlib import Path

import attrs
import pytest

from kvroute.plugins import PluginManager
from kvroute_server.config import ServerConfig, load_toml
from tests.deploy.deployfiles import BASE, IMAGE_CONFIG, OVERLAY, Kustomization, find
from tests.helpers import run_kvroute

CONFIGS = (IMAGE_CONFIG, BASE / "kvroute.toml", OVERLAY / "kvroute.toml")
CLUSTER_CONFIGS = (BASE, OVERLAY)
#: Where kvroute's kubernetes discovery reads a backend's kind on an EndpointSlice (copied from the
#: Service's labels by the EndpointSlice controller); kvroute_kubernetes.ANNOTATION_KIND.
KIND_LABEL = "kvroute.io/kind"


def has_discovery() -> bool:
    return "discovery" in attrs.fields_dict(ServerConfig)


class TestConfigFiles:
    """Each shipped configuration file, read as kvroute serve reads it."""

    @pytest.mark.parametrize("path", CONFIGS, ids=["image", "base", "overlay"])
    def test_loads(self, path: Path) -> None:
        """The file parses as TOML and loads with kvroute_server.config.load_toml, listening on every interface."""
        tomllib.loads(path.read_text(encoding="utf-8"))
        if not has_discovery() and "discovery" in tomllib.loads(path.read_text(encoding="utf-8")):
            pytest.skip("kvroute_server.config has no [[discovery]] yet: the file parsed as TOML only")
        config = load_toml(path)
        assert (config.host, config.port) == ("0.0.0.0", 8000)

    @pytest.mark.parametrize("path", CONFIGS, ids=["image", "base", "overlay"])
    def test_serve_check_accepts_it(self, path: Path) -> None:
        """`kvroute serve --check --config FILE` accepts the file (strategy and options included)."""
        if not has_discovery() and "discovery" in tomllib.loads(path.read_text(encoding="utf-8")):
            pytest.skip("kvroute_server.config has no [[discovery]] yet: kvroute serve would refuse the file")
        # The manifests' files name peers; the token comes from the Secret through KVROUTE_PEER_TOKEN.
        env = {**os.environ, "KVROUTE_PEER_TOKEN": "t" * 32}
        done = run_kvroute("serve", "--check", "--config", str(path), env=env)
        assert done.returncode == 0, f"kvroute serve --check --config {path} failed: {done.stderr}"
        assert json.loads(done.stdout)["host"] == "0.0.0.0"

    @pytest.mark.parametrize("directory", CLUSTER_CONFIGS, ids=["base", "overlay"])
    def test_discovery_follows_the_engine_service(self, directory: Path) -> None:
        """The config discovers the engines through kubernetes at NAMESPACE/vllm:8000, in the objects' namespace."""
        if not has_discovery():
            pytest.skip("kvroute_server.config has no [[discovery]] yet: the target is not checked")
        config = load_toml(directory / "kvroute.toml")
        (source,) = config.discovery
        namespace = Kustomization.load(directory).data.get("namespace", "default")
        assert source.kind == "kubernetes"
        assert source.options["target"] == f"{namespace}/vllm:8000"

    @pytest.mark.parametrize("directory", CLUSTER_CONFIGS, ids=["base", "overlay"])
    def test_peers_follow_the_headless_router_service(self, directory: Path) -> None:
        """The replicas find each other by DNS through kvroute-peers in the objects' namespace, on the server port."""
        config = load_toml(directory / "kvroute.toml")
        (source,) = config.peers.discovery
        namespace = Kustomization.load(directory).data.get("namespace", "default")
        assert source.kind == "dns"
        assert source.options["target"] == f"kvroute-peers.{namespace}.svc.cluster.local:{config.port}"
        service = find(Kustomization.load(BASE).own_objects(), "Service", "kvroute-peers")
        assert [p["port"] for p in service["spec"]["ports"]] == [config.port]

    def test_example_engine_service_matches_the_target(self) -> None:
        """The overlay's engine Service is the one the target names: name vllm, port 8000."""
        service = find(Kustomization.load(OVERLAY).own_objects(), "Service", "vllm")
        assert [p["port"] for p in service["spec"]["ports"]] == [8000]

    def test_engine_load_has_telemetry(self) -> None:
        """engine_load = true comes with a backend kind that reports engine load (the Service's kvroute.io/kind)."""
        config = load_toml(OVERLAY / "kvroute.toml") if has_discovery() else None
        options = tomllib.loads((OVERLAY / "kvroute.toml").read_text(encoding="utf-8"))["routing"]["options"]
        assert options["engine_load"] is True
        service = find(Kustomization.load(OVERLAY).own_objects(), "Service", "vllm")
        kind = service["metadata"]["labels"][KIND_LABEL]
        kinds = PluginManager().backend_kinds
        assert kind in kinds, f"the Service names backend kind {kind!r}; installed kinds: {sorted(kinds)}"
        factory = kinds[kind].factory
        adapter = getattr(factory, "__self__", factory)
        assert hasattr(adapter, "poll_load"), f"backend kind {kind!r} does not report engine load (no poll_load)"
        assert config is None or config.strategy == "bounded-load"

    def test_kind_label_is_the_one_discovery_reads(self) -> None:
        """The label name used above is the kubernetes discovery kind's own."""
        kvroute_kubernetes = pytest.importorskip(
            "kvroute_kubernetes", reason="kvroute-kubernetes is not installed: pip install -e contrib/kubernetes"
        )
        assert kvroute_kubernetes.ANNOTATION_KIND == KIND_LABEL
