"""The provider driving kubernetes_asyncio against a loopback server that plays the API's list and watch."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import pytest
from kvroute_kubernetes import KubernetesDiscovery

from tests.contrib.kubernetes.k8s_fakes import (
    CA_CERT,
    TOKEN,
    FakeApiServer,
    RecordingSink,
    endpoint,
    endpoint_slice,
    fake_api,
    go_bool,
    view,
    write_kubeconfig,
)

pytestmark = pytest.mark.anyio

SOURCE = "kubernetes:inference/vllm:http"


@asynccontextmanager
async def following(api: FakeApiServer, tmp_path: Path, **options: Any) -> AsyncIterator[RecordingSink]:
    """Run the provider (fast, jitter-free backoff) against ``api`` until the block ends; yield its sink."""
    settings: dict[str, Any] = {
        "target": "inference/vllm:http",
        "kubeconfig": str(write_kubeconfig(tmp_path / "kubeconfig", api.port)),
        "backoff_initial": 0.01,
        "backoff_max": 0.05,
        "jitter": 0,
        "request_timeout": 5,
        "watch_timeout": 60,
    }
    settings.update(options)
    provider = KubernetesDiscovery.create(**settings)
    sink = RecordingSink()
    async with anyio.create_task_group() as tg:
        with anyio.fail_after(5):
            await tg.start(provider.run, sink)
        yield sink
        tg.cancel_scope.cancel()


def two_pods() -> dict[str, Any]:
    return endpoint_slice("vllm-abc", [endpoint("vllm-1", "10.0.0.1"), endpoint("vllm-0", "10.0.0.2")])


class TestKubernetesDiscovery:
    async def test_lists_then_watches_from_the_lists_resource_version(self, tmp_path: Path) -> None:
        """The first snapshot is the list, sorted by pod name; the watch asks for bookmarks from the list's version."""
        async with fake_api() as api:
            api.put(two_pods(), endpoint_slice("other-x", [endpoint("x-0", "10.0.9.9")], service="other"))
            async with following(api, tmp_path) as sink:
                watch = await api.next_watch()
                assert [view(s) for s in sink.snapshots] == [
                    [("vllm-0", "http://10.0.0.2:8000", False), ("vllm-1", "http://10.0.0.1:8000", False)]
                ]
                assert sink.last.source == SOURCE
                [listed] = api.requests_of("list")
                assert listed["labelSelector"] == "kubernetes.io/service-name=vllm"
                assert go_bool(watch.query["watch"])
                assert watch.query["resourceVersion"] == str(api.version)
                assert go_bool(watch.query["allowWatchBookmarks"])
                assert watch.query["labelSelector"] == "kubernetes.io/service-name=vllm"
                assert watch.headers["Authorization"] == f"Bearer {TOKEN}"

    async def test_added_modified_deleted_update_the_snapshot(self, tmp_path: Path) -> None:
        """Each watch event changes its slice's endpoints and a whole new snapshot is published."""
        async with fake_api() as api:
            api.put(two_pods())
            async with following(api, tmp_path) as sink:
                watch = await api.next_watch()
                second = endpoint_slice("vllm-def", [endpoint("vllm-2", "10.0.0.3")])
                await watch.send(api.store("ADDED", second))
                await sink.wait_for(lambda s: len(s.snapshots) == 2)
                assert [b.id for b in sink.last.backends] == ["vllm-0", "vllm-1", "vllm-2"]
                grown = endpoint_slice("vllm-abc", [endpoint("vllm-1", "10.0.0.1"), endpoint("vllm-3", "10.0.0.4")])
                await watch.send(api.store("MODIFIED", grown))
                await sink.wait_for(lambda s: len(s.snapshots) == 3)
                assert [b.id for b in sink.last.backends] == ["vllm-1", "vllm-2", "vllm-3"]
                await watch.send(api.store("DELETED", second))
                await sink.wait_for(lambda s: len(s.snapshots) == 4)
                assert [b.id for b in sink.last.backends] == ["vllm-1", "vllm-3"]
                assert sink.failures == []

    async def test_a_modification_that_changes_no_backend_publishes_nothing(self, tmp_path: Path) -> None:
        """A MODIFIED event that leaves the backend set as it was (a new resourceVersion only) is not republished."""
        async with fake_api() as api:
            api.put(two_pods())
            async with following(api, tmp_path) as sink:
                watch = await api.next_watch()
                await watch.send(api.store("MODIFIED", two_pods()))
                await watch.send(api.store("ADDED", endpoint_slice("vllm-def", [endpoint("vllm-2", "10.0.0.3")])))
                await sink.wait_for(lambda s: len(s.snapshots) >= 2)
                assert [len(s.backends) for s in sink.snapshots] == [2, 3]

    async def test_a_bookmark_moves_the_resource_version_a_rewatch_starts_from(self, tmp_path: Path) -> None:
        """After a BOOKMARK and a server-side end of stream, the watch reopens from the bookmark, without a relist."""
        async with fake_api() as api:
            api.put(two_pods())
            async with following(api, tmp_path) as sink:
                watch = await api.next_watch()
                await watch.bookmark("5000")
                await watch.end()
                again = await api.next_watch()
                assert again.query["resourceVersion"] == "5000"
                assert len(api.requests_of("list")) == 1
                assert len(sink.snapshots) == 1
                assert sink.failures == []

    async def test_a_410_error_event_relists_and_takes_the_new_list(self, tmp_path: Path) -> None:
        """An ERROR event with code 410 makes the provider relist; the relist's content replaces what it held."""
        async with fake_api() as api:
            api.put(two_pods())
            async with following(api, tmp_path) as sink:
                watch = await api.next_watch()
                # While the watch lagged, vllm-abc shrank and a new slice appeared.
                api.put(
                    endpoint_slice("vllm-abc", [endpoint("vllm-0", "10.0.0.2")]),
                    endpoint_slice("vllm-def", [endpoint("vllm-7", "10.0.0.8")]),
                )
                await watch.gone(watch.query["resourceVersion"])
                again = await api.next_watch()
                assert len(api.requests_of("list")) == 2
                assert again.query["resourceVersion"] == str(api.version)
                assert [b.id for b in sink.last.backends] == ["vllm-0", "vllm-7"]
                assert sink.failures == []

    async def test_an_http_410_on_the_watch_request_relists(self, tmp_path: Path) -> None:
        """A watch request answered with HTTP 410 Gone (a Status body) leads to a relist, then a watch from it."""
        async with fake_api() as api:
            api.put(two_pods())
            api.watch_failures.append(410)
            async with following(api, tmp_path) as sink:
                watch = await api.next_watch()
                assert [k for k, _, _ in api.requests] == ["list", "watch", "list", "watch"]
                assert watch.query["resourceVersion"] == str(api.version)
                assert [b.id for b in sink.last.backends] == ["vllm-0", "vllm-1"]

    async def test_a_dropped_connection_resumes_from_the_last_resource_version(self, tmp_path: Path) -> None:
        """A connection cut mid-line is reported as a failure; the watch resumes from the last version, no relist."""
        async with fake_api() as api:
            api.put(two_pods())
            async with following(api, tmp_path) as sink:
                watch = await api.next_watch()
                event = api.store("ADDED", endpoint_slice("vllm-def", [endpoint("vllm-2", "10.0.0.3")]))
                await watch.send(event)
                await sink.wait_for(lambda s: len(s.snapshots) == 2)
                await watch.drop(partial=b'{"type": "MODIFIED", "object": {"kind": "Endpoi')
                again = await api.next_watch()
                assert again.query["resourceVersion"] == event["object"]["metadata"]["resourceVersion"]
                assert len(api.requests_of("list")) == 1
                await sink.wait_for(lambda s: len(s.snapshots) == 3)
                [(source, reason)] = sink.failures
                assert source == SOURCE
                assert reason.startswith("watch of EndpointSlices for inference/vllm:http failed")
                # The failure, then the same set again once the watch is back (the host clears "stale").
                assert sink.calls[-2] == (source, reason)
                assert sink.last.backends == sink.snapshots[1].backends
                await again.send(api.store("DELETED", event["object"]))
                await sink.wait_for(lambda s: [b.id for b in s.last.backends] == ["vllm-0", "vllm-1"])

    async def test_a_401_reloads_the_credentials_and_resumes(self, tmp_path: Path) -> None:
        """After a token rotation the 401 is reported, the kubeconfig re-read, and the watch resumes, new token."""
        async with fake_api() as api:
            api.put(two_pods())
            async with following(api, tmp_path) as sink:
                watch = await api.next_watch()
                await watch.bookmark("900")
                api.token = "rotated-token"
                write_kubeconfig(tmp_path / "kubeconfig", api.port, token="rotated-token")
                await watch.drop()
                again = await api.next_watch()
                assert again.headers["Authorization"] == "Bearer rotated-token"
                assert again.query["resourceVersion"] == "900"
                reasons = [r for _, r in sink.failures]
                assert any("HTTP 401" in r for r in reasons), reasons
                assert len(api.requests_of("list")) == 1

    async def test_a_slow_stream_delivers_events_split_across_chunks(self, tmp_path: Path) -> None:
        """An event whose line arrives in pieces over a second is applied once whole, with no failure or reconnect."""
        async with fake_api() as api:
            api.put(two_pods())
            async with following(api, tmp_path) as sink:
                watch = await api.next_watch()
                event = api.store("ADDED", endpoint_slice("vllm-def", [endpoint("vllm-2", "10.0.0.3")]))
                await watch.send_slowly(event, pieces=5, pause=0.25)
                await sink.wait_for(lambda s: len(s.snapshots) == 2)
                assert [b.id for b in sink.last.backends] == ["vllm-0", "vllm-1", "vllm-2"]
                assert sink.failures == []
                assert len(api.requests_of("watch")) == 1

    async def test_a_watch_silent_past_its_timeout_is_treated_as_dropped(self, tmp_path: Path) -> None:
        """A stream silent (not ended) past timeoutSeconds + request_timeout is left and the watch reopened."""
        async with fake_api() as api:
            api.put(two_pods())
            # request_timeout 2 s (not less): a list slowed by a busy CI machine must not time out too.
            async with following(api, tmp_path, watch_timeout=1, request_timeout=2) as sink:
                watch = await api.next_watch()
                assert watch.query["timeoutSeconds"] == "1"
                await watch.bookmark("4242")
                again = await api.next_watch()  # the bookmark, then 3 s of silence
                assert again.query["resourceVersion"] == "4242"
                [(_, reason)] = sink.failures
                assert reason.startswith("watch of EndpointSlices for inference/vllm:http failed: ")
                assert len(api.requests_of("list")) == 1

    async def test_a_terminating_serving_endpoint_drains_then_goes(self, tmp_path: Path) -> None:
        """Terminating but serving -> draining; then serving false -> absent; a not-ready pod is absent too."""
        async with fake_api() as api:
            api.put(two_pods())
            async with following(api, tmp_path) as sink:
                watch = await api.next_watch()
                terminating = endpoint("vllm-1", "10.0.0.1", ready=False, serving=True, terminating=True)
                pods = [terminating, endpoint("vllm-0", "10.0.0.2")]
                await watch.send(api.store("MODIFIED", endpoint_slice("vllm-abc", pods)))
                await sink.wait_for(lambda s: len(s.snapshots) == 2)
                assert view(sink.last) == [
                    ("vllm-0", "http://10.0.0.2:8000", False),
                    ("vllm-1", "http://10.0.0.1:8000", True),
                ]
                stopped = endpoint("vllm-1", "10.0.0.1", ready=False, serving=False, terminating=True)
                starting = endpoint("vllm-5", "10.0.0.6", ready=False)
                pods = [stopped, endpoint("vllm-0", "10.0.0.2"), starting]
                await watch.send(api.store("MODIFIED", endpoint_slice("vllm-abc", pods)))
                await sink.wait_for(lambda s: len(s.snapshots) == 3)
                assert view(sink.last) == [("vllm-0", "http://10.0.0.2:8000", False)]

    async def test_ready_false_removes_an_endpoint(self, tmp_path: Path) -> None:
        """An endpoint whose ready condition turns false (not terminating) leaves the snapshot."""
        async with fake_api() as api:
            api.put(two_pods())
            async with following(api, tmp_path) as sink:
                watch = await api.next_watch()
                pods = [endpoint("vllm-1", "10.0.0.1", ready=False), endpoint("vllm-0", "10.0.0.2")]
                await watch.send(api.store("MODIFIED", endpoint_slice("vllm-abc", pods)))
                await sink.wait_for(lambda s: len(s.snapshots) == 2)
                assert [b.id for b in sink.last.backends] == ["vllm-0"]

    async def test_an_api_outage_at_start_is_reported_and_retried(self, tmp_path: Path) -> None:
        """List failures are reported (started after the first), retried with backoff, then the list is published."""
        async with fake_api() as api:
            api.put(two_pods())
            api.list_failures.extend([503, 503, 403])
            async with following(api, tmp_path) as sink:
                assert len(sink.failures) >= 1
                await api.next_watch()
                reasons = [r for _, r in sink.failures]
                assert len(reasons) == 3
                assert all(
                    r.startswith("list of EndpointSlices for inference/vllm:http failed: HTTP ") for r in reasons
                )
                assert "HTTP 403" in reasons[2]
                assert [b.id for b in sink.last.backends] == ["vllm-0", "vllm-1"]
                assert len(api.requests_of("list")) == 4

    async def test_an_error_event_other_than_410_resumes_the_watch(self, tmp_path: Path) -> None:
        """An ERROR event with code 500 is a failure: the watch reopens from the last version without a relist."""
        async with fake_api() as api:
            api.put(two_pods())
            async with following(api, tmp_path) as sink:
                watch = await api.next_watch()
                await watch.bookmark("777")
                await watch.send(
                    {
                        "type": "ERROR",
                        "object": {"kind": "Status", "code": 500, "reason": "InternalError", "message": "etcd"},
                    }
                )
                again = await api.next_watch()
                assert again.query["resourceVersion"] == "777"
                assert len(api.requests_of("list")) == 1
                [(_, reason)] = sink.failures
                assert "HTTP 500" in reason

    async def test_an_empty_service_and_null_endpoints_publish_an_empty_snapshot(self, tmp_path: Path) -> None:
        """A slice with ``endpoints: null`` (the API's 'none') decodes to an empty snapshot without a failure."""
        async with fake_api() as api:
            api.put(endpoint_slice("vllm-abc", None))
            async with following(api, tmp_path) as sink:
                watch = await api.next_watch()
                assert sink.snapshots[0].backends == ()
                await watch.send(api.store("MODIFIED", two_pods()))
                await sink.wait_for(lambda s: len(s.snapshots) == 2)
                await watch.send(api.store("MODIFIED", endpoint_slice("vllm-abc", None)))
                await sink.wait_for(lambda s: len(s.snapshots) == 3)
                assert sink.last.backends == ()
                assert sink.failures == []

    async def test_models_weight_and_kind_come_from_slice_labels_and_annotations(self, tmp_path: Path) -> None:
        """Labels copied from the Service set kind and weight; annotations win; ``models`` is the default."""
        async with fake_api() as api:
            api.put(
                endpoint_slice(
                    "vllm-abc",
                    [endpoint("vllm-0", "10.0.0.2")],
                    labels={"kvroute.io/kind": "vllm", "kvroute.io/weight": "2", "kvroute.io/models": "llama-8b"},
                    annotations={"kvroute.io/models": "meta-llama/Llama-3.1-8B,qwen/Qwen3-8B"},
                )
            )
            async with following(api, tmp_path, models=["fallback"]) as sink:
                [backend] = sink.last.backends
                assert (backend.kind, backend.weight) == ("vllm", 2.0)
                assert backend.models == frozenset({"meta-llama/Llama-3.1-8B", "qwen/Qwen3-8B"})

    async def test_a_missing_kubeconfig_is_a_failure_not_an_exception(self, tmp_path: Path) -> None:
        """A kubeconfig path that does not exist is reported to the sink (run keeps going), naming the problem."""
        provider = KubernetesDiscovery.create(
            target="inference/vllm:8000", kubeconfig=str(tmp_path / "absent"), backoff_initial=0.01, jitter=0
        )
        sink = RecordingSink()
        async with anyio.create_task_group() as tg:
            with anyio.fail_after(5):
                await tg.start(provider.run, sink)
            await sink.wait_for(lambda s: len(s.failures) >= 2)
            tg.cancel_scope.cancel()
        assert sink.snapshots == []
        reason = sink.failures[0][1]
        assert reason.startswith("configuring the Kubernetes client for inference/vllm:8000 failed: ConfigException")
        assert f"{str(tmp_path / 'absent')!r} does not exist" in reason

    async def test_in_cluster_config_wins_over_the_default_kubeconfig(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """In a pod (service host/port set, token and CA mounted) the service account is used over ~/.kube/config."""
        from kubernetes_asyncio.config import incluster_config, kube_config

        async with fake_api(tls=True) as api, fake_api() as decoy:
            api.put(two_pods())
            api.token = "in-cluster-token"
            decoy.put(endpoint_slice("vllm-zzz", [endpoint("decoy-0", "10.9.9.9")]))
            token = tmp_path / "token"
            token.write_text("in-cluster-token", encoding="utf-8")
            monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "127.0.0.1")
            monkeypatch.setenv("KUBERNETES_SERVICE_PORT", str(api.port))
            monkeypatch.setattr(incluster_config, "SERVICE_TOKEN_FILENAME", str(token))
            monkeypatch.setattr(incluster_config, "SERVICE_CERT_FILENAME", str(CA_CERT))
            default = write_kubeconfig(tmp_path / "default-kubeconfig", decoy.port)
            monkeypatch.setattr(kube_config, "KUBE_CONFIG_DEFAULT_LOCATION", str(default))
            async with following(api, tmp_path, kubeconfig=None) as sink:
                watch = await api.next_watch()
                assert [b.id for b in sink.last.backends] == ["vllm-0", "vllm-1"]
                assert watch.headers["Authorization"] == "Bearer in-cluster-token"
            assert decoy.requests == []

    async def test_outside_a_pod_the_default_kubeconfig_is_used(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """Without ``kubeconfig`` and outside a pod (no service host), the default kubeconfig is used."""
        from kubernetes_asyncio.config import kube_config

        async with fake_api() as api:
            api.put(two_pods())
            monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
            path = write_kubeconfig(tmp_path / "default-kubeconfig", api.port)
            monkeypatch.setattr(kube_config, "KUBE_CONFIG_DEFAULT_LOCATION", str(path))
            async with following(api, tmp_path, kubeconfig=None) as sink:
                await api.next_watch()
                assert [b.id for b in sink.last.backends] == ["vllm-0", "vllm-1"]
