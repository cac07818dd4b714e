"""The provider's pure parts: target parsing, endpoint conditions, slices to backends, options."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from types import SimpleNamespace
from typing import Any

import pytest
from kubernetes_asyncio.client import ApiClient, Configuration
from kvroute_kubernetes import Defaults, KubernetesDiscovery, KubernetesTarget, SliceState, endpoint_state

from kvroute.plugins import PluginManager
from tests.contrib.kubernetes.k8s_fakes import endpoint, endpoint_slice

TARGET = KubernetesTarget("inference", "vllm", "http")


Decode = Callable[..., Any]


@pytest.fixture
async def model() -> AsyncIterator[Decode]:
    """``model(json, kind="V1EndpointSlice")``: a typed model decoded the way the provider decodes watch events."""
    configuration = Configuration()
    configuration.client_side_validation = False
    async with ApiClient(configuration) as client:

        def decode(obj: dict[str, Any], kind: str = "V1EndpointSlice") -> Any:
            return client.deserialize(SimpleNamespace(data=json.dumps(obj)), kind)

        yield decode


class TestKubernetesTarget:
    @pytest.mark.parametrize(
        ("text", "expected"),
        [
            ("inference/vllm:8000", KubernetesTarget("inference", "vllm", 8000)),
            ("default/my-engine:http", KubernetesTarget("default", "my-engine", "http")),
        ],
    )
    def test_parses_namespace_service_and_port(self, text: str, expected: KubernetesTarget) -> None:
        """A numeric port becomes an int, a named one stays a name; str() gives the text back."""
        assert KubernetesTarget.parse(text) == expected
        assert str(expected) == text

    @pytest.mark.parametrize(
        ("text", "message"),
        [
            ("vllm:8000", "must be 'NAMESPACE/SERVICE:PORT'"),
            ("inference/vllm", "must be 'NAMESPACE/SERVICE:PORT'"),
            ("inference/:8000", "must be 'NAMESPACE/SERVICE:PORT'"),
            ("Inference/vllm:8000", "namespace must be a DNS-1123 label"),
            ("inference/vllm_x:8000", "service must be a DNS-1123 label"),
            ("inference/vllm:70000", "between 1 and 65535 (got 70000"),
            ("inference/vllm:HTTP", "a number or a port name"),
        ],
    )
    def test_refuses_malformed_targets_saying_what_was_expected(self, text: str, message: str) -> None:
        """Each malformed target is refused with a message naming the rule and the text given."""
        with pytest.raises(ValueError, match="kubernetes target") as info:
            KubernetesTarget.parse(text)
        assert message in str(info.value)
        assert repr(text) in str(info.value)

    @pytest.mark.anyio
    async def test_finds_the_port_by_number_or_by_name(self, model: Decode) -> None:
        """A number matches a listed port number, a name a listed port name; no match and null ports give None."""
        ports = model(endpoint_slice("s", [], ports=(("metrics", 9090), ("http", 8000)))).ports
        assert KubernetesTarget("n", "s", 8000).port_in(ports) == 8000
        assert KubernetesTarget("n", "s", "metrics").port_in(ports) == 9090
        assert KubernetesTarget("n", "s", 80).port_in(ports) is None
        assert KubernetesTarget("n", "s", "grpc").port_in(ports) is None
        assert KubernetesTarget("n", "s", "http").port_in(None) is None


class TestEndpointState:
    @pytest.mark.parametrize(
        ("values", "expected"),
        [
            ({}, "ready"),  # all conditions unset: ready
            ({"ready": True}, "ready"),
            ({"ready": False}, None),
            ({"ready": False, "serving": False}, None),
            ({"ready": False, "serving": True, "terminating": True}, "draining"),
            ({"ready": False, "serving": False, "terminating": True}, None),
            ({"ready": False, "terminating": True}, None),  # serving unset = ready = false
            ({"ready": True, "terminating": True}, "draining"),  # publishNotReadyAddresses keeps ready true
            ({"terminating": False}, "ready"),
        ],
    )
    @pytest.mark.anyio
    async def test_maps_conditions_to_ready_draining_or_absent(
        self, model: Decode, values: dict[str, bool], expected: str | None
    ) -> None:
        """Conditions follow the API's nil rules: ready -> present, terminating and serving -> draining, else absent."""
        assert endpoint_state(model(values, "V1EndpointConditions")) == expected

    def test_no_conditions_at_all_means_ready(self) -> None:
        """An endpoint without a conditions object counts as ready (every condition nil)."""
        assert endpoint_state(None) == "ready"


class TestSliceState:
    @pytest.mark.anyio
    async def test_ids_urls_and_labels_of_endpoints(self, model: Decode) -> None:
        """The pod name is the id (address:port without a targetRef); the URL uses the named port; zone kept."""
        state = SliceState(TARGET, Defaults(scheme="https"))
        slice_ = endpoint_slice(
            "vllm-a",
            [endpoint("vllm-0", "10.0.0.1", zone="z1"), endpoint(None, "10.0.0.2")],
            ports=(("metrics", 9090), ("http", 8000)),
        )
        state.replace([model(slice_)])
        first, second = state.backends()
        assert (first.id, first.url, second.id, second.url) == (
            "10.0.0.2:8000",
            "https://10.0.0.2:8000",
            "vllm-0",
            "https://10.0.0.1:8000",
        )
        assert second.labels["topology.kubernetes.io/zone"] == "z1"
        assert second.labels["kubernetes.io/service-name"] == "vllm"

    @pytest.mark.anyio
    async def test_ipv6_addresses_are_bracketed(self, model: Decode) -> None:
        """An IPv6 slice gives ``[addr]:port`` ids (without a targetRef) and URLs."""
        state = SliceState(TARGET)
        state.replace([model(endpoint_slice("v6", [endpoint(None, "fd00::5")], address_type="IPv6"))])
        [backend] = state.backends()
        assert (backend.id, backend.url) == ("[fd00::5]:8000", "http://[fd00::5]:8000")

    @pytest.mark.anyio
    async def test_a_pod_in_two_slices_appears_once_preferring_serving_then_ipv4(self, model: Decode) -> None:
        """Dual-stack and split slices name a pod twice: it appears once, serving over draining, IPv4 over IPv6."""
        state = SliceState(TARGET)
        v4 = endpoint_slice("v4", [endpoint("vllm-0", "10.0.0.1")])
        v6 = endpoint_slice("v6", [endpoint("vllm-0", "fd00::1")], address_type="IPv6")
        state.replace([model(v6), model(v4)])
        assert [b.url for b in state.backends()] == ["http://10.0.0.1:8000"]
        draining = endpoint("vllm-0", "10.0.0.9", ready=False, serving=True, terminating=True)
        state.apply("MODIFIED", model(endpoint_slice("v4", [draining])))
        [backend] = state.backends()
        assert (backend.url, backend.draining) == ("http://[fd00::1]:8000", False)

    @pytest.mark.anyio
    async def test_slices_without_the_port_or_with_fqdn_addresses_give_nothing(self, model: Decode) -> None:
        """A slice lacking the target's port, and an FQDN slice, contribute no backend."""
        state = SliceState(TARGET)
        state.replace(
            [
                model(endpoint_slice("other-port", [endpoint("a", "10.0.0.1")], ports=(("grpc", 9000),))),
                model(endpoint_slice("fqdn", [endpoint("b", "b.example")], address_type="FQDN")),
            ]
        )
        assert state.backends() == ()

    @pytest.mark.anyio
    async def test_annotations_win_over_labels_and_bad_weights_are_ignored(self, model: Decode) -> None:
        """kvroute.io/ annotations beat the same labels; a non-positive or non-numeric weight falls back to 1."""
        state = SliceState(TARGET, Defaults(kind="openai", models=["default-model"]))
        state.replace(
            [
                model(
                    endpoint_slice(
                        "a",
                        [endpoint("a-0", "10.0.0.1")],
                        labels={"kvroute.io/kind": "sglang", "kvroute.io/weight": "3"},
                        annotations={"kvroute.io/kind": "vllm", "kvroute.io/weight": "0.5"},
                    )
                ),
                model(endpoint_slice("b", [endpoint("b-0", "10.0.0.2")], labels={"kvroute.io/weight": "-2"})),
                model(endpoint_slice("c", [endpoint("c-0", "10.0.0.3")], annotations={"kvroute.io/weight": "lots"})),
            ]
        )
        a, b, c = state.backends()
        assert (a.kind, a.weight, b.kind, b.weight, c.weight) == ("vllm", 0.5, "openai", 1.0, 1.0)
        assert b.models == frozenset({"default-model"})

    @pytest.mark.anyio
    async def test_deleted_drops_a_slice_and_unknown_events_are_refused(self, model: Decode) -> None:
        """DELETED removes a slice's endpoints; an event type other than ADDED/MODIFIED/DELETED is an error."""
        state = SliceState(TARGET)
        slice_ = model(endpoint_slice("a", [endpoint("a-0", "10.0.0.1")]))
        state.apply("ADDED", slice_)
        state.apply("DELETED", slice_)
        assert state.backends() == ()
        with pytest.raises(ValueError, match="ADDED, MODIFIED or DELETED"):
            state.apply("BOOKMARK", slice_)


class TestCreate:
    def test_registered_as_the_kubernetes_discovery_kind(self) -> None:
        """The entry point registers kind ``kubernetes``; its factory builds a KubernetesDiscovery from the options."""
        registration = PluginManager().discovery_kinds["kubernetes"]
        assert registration.plugin.distribution == "kvroute-kubernetes"
        provider = registration.factory(target="inference/vllm:8000", kubeconfig="/tmp/kc")
        assert isinstance(provider, KubernetesDiscovery)
        assert provider.target == KubernetesDiscovery.create(target="inference/vllm:8000", kubeconfig="/tmp/kc").target

    def test_loading_the_entry_point_imports_no_client(self) -> None:
        """Loading the plugins (as every kvroute command does) imports neither kubernetes_asyncio nor aiohttp."""
        code = (
            "import sys\n"
            "from kvroute.plugins import PluginManager\n"
            "assert 'kubernetes' in PluginManager().discovery_kinds\n"
            "print([m for m in ('kubernetes_asyncio', 'aiohttp', 'kvroute_kubernetes.provider') if m in sys.modules])\n"
        )
        result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
        assert result.stdout == "[]\n", result.stdout

    def test_options_reach_the_provider(self) -> None:
        """Every documented option is taken: defaults for backends, timeouts and backoff."""
        provider = KubernetesDiscovery.create(
            target="inference/vllm:8000",
            kubeconfig="/tmp/kc",
            context="prod",
            kind="vllm",
            models=["m"],
            scheme="https",
            watch_timeout=120,
            request_timeout=10,
            backoff_initial=1,
            backoff_max=60,
            jitter=0.1,
            seed=3,
            interval=10,
        )
        assert provider.source == "kubernetes:inference/vllm:8000"
        assert (provider.kubeconfig, provider.context) == ("/tmp/kc", "prod")
        assert provider.defaults == Defaults(kind="vllm", models=["m"], scheme="https")
        assert (provider.watch_timeout, provider.request_timeout) == (120.0, 10.0)
        assert (provider.backoff.initial, provider.backoff.maximum, provider.backoff.jitter) == (1.0, 60.0, 0.1)
        assert provider.backoff.seed == 3

    @pytest.mark.parametrize(
        ("options", "message"),
        [
            ({}, "needs 'target'"),
            ({"target": "inference/vllm:8000", "poll": 5}, "(got unknown poll)"),
            ({"target": "inference/vllm:8000", "interval": -1}, "'interval' must be a positive number"),
            ({"target": "inference/vllm:8000", "scheme": "tcp"}, "'scheme' must be 'http' or 'https'"),
            ({"target": "inference/vllm:8000", "models": "m"}, "'models' must be a list"),
            ({"target": "inference/vllm:8000", "models": 3}, "'models' must be a list"),
            ({"target": "inference/vllm:8000", "watch_timeout": 0}, "'watch_timeout' must be a positive number"),
            ({"target": "inference/vllm:8000", "seed": "x"}, "'seed' must be an integer"),
            ({"target": "inference/vllm:8000", "backoff_initial": 0}, "'backoff_initial' must be a positive number"),
            ({"target": "inference/vllm:8000", "jitter": 1}, "'jitter' must be in [0, 1) (got 1.0)."),
            (
                {"target": "inference/vllm:8000", "backoff_initial": 2, "backoff_max": 1},
                "'backoff_max' must be at least 'backoff_initial' (got 1.0 < 2.0).",
            ),
            ({"target": "inference/vllm:8000", "kubeconfig": ""}, "'kubeconfig' must be a non-empty string"),
        ],
    )
    def test_bad_options_are_refused_by_name(self, options: dict[str, Any], message: str) -> None:
        """The factory refuses a bad or unknown option with a ValueError naming it and what was got."""
        with pytest.raises(ValueError) as info:
            KubernetesDiscovery.create(**options)
        assert message in str(info.value)
