"""The Kubernetes manifests in contrib/deploy/kubernetes: schemas, kustomize wiring, and the settings they promise."""

from __future__ import annotations

import copy
import tomllib
from pathlib import Path
from typing import Any

import pytest

from tests.deploy.deployfiles import (
    BASE,
    CLUSTER_SCOPED,
    KUBERNETES_VERSIONS,
    KUSTOMIZATIONS,
    OVERLAY,
    Kustomization,
    container,
    find,
    kubectl,
    render,
    resource_id,
    yaml_documents,
)

kubernetes_validate = pytest.importorskip(
    "kubernetes_validate", reason="kubernetes-validate is not installed: pip install kubernetes-validate==1.37.0"
)

NO_KUBECTL = (
    "kubectl is not installed here, so `kubectl kustomize` cannot render base/overlay (the file checks still ran)"
)


def validate(doc: dict[str, Any], version: str) -> None:
    """Validate one object strictly (unknown fields rejected); a kind without a schema is a failure too."""
    try:
        kubernetes_validate.validate(doc, version, strict=True)
    except kubernetes_validate.ValidationError as exc:
        where = ".".join(str(part) for part in exc.path)
        pytest.fail(
            f"{doc['kind']}/{doc['metadata']['name']} is not valid Kubernetes {version}: {where}: {exc.message}"
        )
    except kubernetes_validate.SchemaNotFoundError as exc:
        pytest.fail(f"no schema to check {doc['kind']}/{doc['metadata']['name']} against: {exc.message}")


def base() -> Kustomization:
    return Kustomization.load(BASE)


def overlay() -> Kustomization:
    return Kustomization.load(OVERLAY)


def kvroute_deployment() -> dict[str, Any]:
    return find(base().own_objects(), "Deployment", "kvroute")


class TestSchemas:
    """Every object, as written and as rendered, against the bundled Kubernetes schemas."""

    def test_versions_are_bundled(self) -> None:
        """Each stated Kubernetes version has its own bundled schemas (a missing one would silently use an older)."""
        bundled = {".".join(v.split(".")[:2]) for v in kubernetes_validate.utils.all_versions()}
        missing = sorted(set(KUBERNETES_VERSIONS) - bundled, key=lambda v: int(v.split(".")[1]))
        assert not missing, f"kubernetes-validate bundles {sorted(bundled)}; expected also {missing}"

    @pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
    def test_resource_files_validate(self, version: str) -> None:
        """Every resource file of the base and the overlay is a valid object for this Kubernetes version."""
        docs = [doc for k in KUSTOMIZATIONS for doc in Kustomization.load(k).own_objects()]
        assert len(docs) >= 9, f"expected the base's and the overlay's objects, got {len(docs)}"
        for doc in docs:
            validate(doc, version)

    @pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
    @pytest.mark.parametrize("directory", KUSTOMIZATIONS, ids=["base", "overlay"])
    def test_rendered_objects_validate(self, version: str, directory: Path) -> None:
        """What `kubectl apply -k` would send (patches applied, ConfigMap generated) is valid for this version."""
        if kubectl() is None:
            pytest.skip(NO_KUBECTL)
        for doc in render(directory):
            validate(doc, version)

    def test_strict_validation_rejects_a_misspelled_field(self) -> None:
        """The check above can fail: a misspelled field in the Deployment is rejected."""
        doc = copy.deepcopy(kvroute_deployment())
        doc["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {"tcpSocket": {"port": "http"}}
        with pytest.raises(kubernetes_validate.ValidationError):
            kubernetes_validate.validate(doc, KUBERNETES_VERSIONS[0], strict=True)


class TestKustomizations:
    """The kustomization files name what is there, and the overlay changes only what the base has."""

    @pytest.mark.parametrize("directory", KUSTOMIZATIONS, ids=["base", "overlay"])
    def test_resources_list_exactly_the_manifests_present(self, directory: Path) -> None:
        """Each YAML file in the folder is a listed resource or a patch, and each listed resource exists."""
        k = Kustomization.load(directory)
        present = {p.resolve() for p in directory.glob("*.yaml")} - {(directory / "kustomization.yaml").resolve()}
        listed = set(k.resource_files) | set(k.patch_files)
        assert present == listed, f"unlisted: {sorted(present - listed)}; listed but absent: {sorted(listed - present)}"
        for path in k.resources + k.patch_files + k.generator_files:
            assert path.exists(), f"{directory}/kustomization.yaml names {path}, which does not exist"

    def test_overlay_builds_on_the_base(self) -> None:
        """The overlay's only kustomization resource is the base."""
        assert [b.directory for b in overlay().bases] == [BASE.resolve()]

    def test_patches_target_existing_objects(self) -> None:
        """Every overlay patch names an object of the base, and the patch body is that object."""
        known = {resource_id(doc) for doc in base().all_objects()}
        patches = overlay().data.get("patches", [])
        assert patches, "expected the overlay to patch the base"
        for patch in patches:
            target = (patch["target"]["kind"], patch["target"]["name"])
            assert target in known, f"patch {patch['path']} targets {target}, not among the base's {sorted(known)}"
            (body,) = yaml_documents(OVERLAY / patch["path"])
            assert resource_id(body) == target, f"patch {patch['path']} is for {resource_id(body)}, targets {target}"

    def test_replicas_and_images_name_existing_objects(self) -> None:
        """The overlay's replica counts name Deployments and its image rewrite names an image the base uses."""
        objects = overlay().all_objects()
        deployments = {doc["metadata"]["name"] for doc in objects if doc["kind"] == "Deployment"}
        for entry in overlay().data["replicas"]:
            assert entry["name"] in deployments, f"replicas names {entry['name']!r}, expected one of {deployments}"
        images = {
            c["image"].rpartition(":")[0]
            for doc in objects
            if doc["kind"] == "Deployment"
            for c in doc["spec"]["template"]["spec"]["containers"]
        }
        for entry in overlay().data["images"]:
            assert entry["name"] in images, f"images names {entry['name']!r}, expected one of {images}"

    def test_configmap_generators_line_up(self) -> None:
        """The Deployment mounts the generated ConfigMap, and the overlay replaces that generator (not a new one)."""
        volumes = {v["name"]: v for v in kvroute_deployment()["spec"]["template"]["spec"]["volumes"]}
        assert ("ConfigMap", volumes["config"]["configMap"]["name"]) in base().generated_names()
        for generator in overlay().data["configMapGenerator"]:
            assert generator.get("behavior") == "replace", f"expected behavior: replace, got {generator}"
            assert ("ConfigMap", generator["name"]) in base().generated_names()


class TestObjects:
    """How the objects refer to each other, and what the kvroute Deployment promises."""

    def test_rbac_allows_reading_endpointslices_only(self) -> None:
        """The Role grants get/list/watch on EndpointSlices, bound to the ServiceAccount the pods run as."""
        objects = base().own_objects()
        role = find(objects, "Role", "kvroute-discovery")
        assert role["rules"] == [
            {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": ["get", "list", "watch"]}
        ]
        binding = find(objects, "RoleBinding", "kvroute-discovery")
        account = kvroute_deployment()["spec"]["template"]["spec"]["serviceAccountName"]
        find(objects, "ServiceAccount", account)
        assert binding["roleRef"] == {
            "apiGroup": "rbac.authorization.k8s.io",
            "kind": "Role",
            "name": "kvroute-discovery",
        }
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account}]

    @pytest.mark.parametrize(
        ("kind", "name"),
        [("Service", "kvroute"), ("Service", "kvroute-peers"), ("PodDisruptionBudget", "kvroute")],
    )
    def test_selectors_match_the_router_pods(self, kind: str, name: str) -> None:
        """The Service and the PodDisruptionBudget select the kvroute pods, and only by labels the pods carry."""
        deployment = kvroute_deployment()
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        doc = find(base().own_objects(), kind, name)
        selector = doc["spec"]["selector"]
        selector = selector.get("matchLabels", selector) if kind == "PodDisruptionBudget" else selector
        assert selector and selector.items() <= labels.items(), f"{kind} selects {selector}, pods carry {labels}"
        assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()

    def test_engine_service_selects_the_engine_pods(self) -> None:
        """The example's headless vllm Service selects the vllm pods on their named port."""
        objects = overlay().own_objects()
        service = find(objects, "Service", "vllm")
        engines = find(objects, "Deployment", "vllm")
        assert service["spec"]["clusterIP"] == "None"
        assert service["spec"]["selector"].items() <= engines["spec"]["template"]["metadata"]["labels"].items()
        ports = {p["name"] for p in container(engines, "vllm")["ports"]}
        assert {p["targetPort"] for p in service["spec"]["ports"]} <= ports

    def test_ports_line_up(self) -> None:
        """The config's port is the container port the probes, the Service and the scrape annotation use."""
        deployment = kvroute_deployment()
        pod = deployment["spec"]["template"]
        main = container(deployment, "kvroute")
        port = tomllib.loads((BASE / "kvroute.toml").read_text(encoding="utf-8"))["server"]["port"]
        assert main["ports"] == [{"name": "http", "containerPort": port, "protocol": "TCP"}]
        for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
            action = next(v for k, v in main[probe].items() if k in ("httpGet", "tcpSocket"))
            assert action["port"] == "http", f"{probe} asks port {action['port']!r}, expected 'http'"
        assert pod["metadata"]["annotations"]["prometheus.io/port"] == str(port)
        service = find(base().own_objects(), "Service", "kvroute")
        assert [(p["port"], p["targetPort"]) for p in service["spec"]["ports"]] == [(port, "http")]

    def test_probes(self) -> None:
        """Readiness asks /health (503 with no routable engine); liveness is a TCP check that engines cannot fail."""
        main = container(kvroute_deployment(), "kvroute")
        assert main["readinessProbe"]["httpGet"]["path"] == "/health"
        assert set(main["livenessProbe"]) & {"httpGet", "exec", "grpc"} == set()
        assert "tcpSocket" in main["livenessProbe"]
        assert "tcpSocket" in main["startupProbe"] or "httpGet" in main["startupProbe"]

    def test_prometheus_scrape_annotations(self) -> None:
        """The pods carry the scrape annotations for /metrics."""
        annotations = kvroute_deployment()["spec"]["template"]["metadata"]["annotations"]
        assert annotations["prometheus.io/scrape"] == "true"
        assert annotations["prometheus.io/path"] == "/metrics"

    def test_security_context(self) -> None:
        """Non-root, no privilege escalation, no capabilities, a read-only root with a writable /tmp."""
        pod = kvroute_deployment()["spec"]["template"]["spec"]
        main = container(kvroute_deployment(), "kvroute")
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["runAsUser"] > 0
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        context = main["securityContext"]
        assert context["readOnlyRootFilesystem"] is True
        assert context["allowPrivilegeEscalation"] is False
        assert context["capabilities"]["drop"] == ["ALL"]
        mounts = {m["mountPath"]: m for m in main["volumeMounts"]}
        assert mounts["/etc/kvroute"]["readOnly"] is True
        assert "/tmp" in mounts and not mounts["/tmp"].get("readOnly", False)

    def test_resources(self) -> None:
        """CPU and memory are requested and memory is limited."""
        resources = container(kvroute_deployment(), "kvroute")["resources"]
        assert {"cpu", "memory"} <= set(resources["requests"])
        assert "memory" in resources["limits"]

    def test_admin_token_comes_from_a_secret(self) -> None:
        """KVROUTE_ADMIN_TOKEN, the variable `kvroute serve` reads, comes from the kvroute-admin Secret."""
        from kvroute_server.cli import serve

        (option,) = [p for p in serve.params if p.name == "admin_token"]
        env = {e["name"]: e for e in container(kvroute_deployment(), "kvroute")["env"]}
        assert option.envvar in env, f"kvroute serve reads {option.envvar}; the container sets {sorted(env)}"
        ref = env[option.envvar]["valueFrom"]["secretKeyRef"]
        assert (ref["name"], ref["key"]) == ("kvroute-admin", "token")

    def test_peer_service_is_headless(self) -> None:
        """kvroute-peers answers one address per router pod (headless), ready or not, on the pods' named port."""
        spec = find(base().own_objects(), "Service", "kvroute-peers")["spec"]
        assert spec["clusterIP"] == "None"
        assert spec["publishNotReadyAddresses"] is True
        ports = {p["name"] for p in container(kvroute_deployment(), "kvroute")["ports"]}
        assert {p["targetPort"] for p in spec["ports"]} <= ports

    def test_peer_token_comes_from_a_secret(self) -> None:
        """KVROUTE_PEER_TOKEN, the variable `kvroute serve` reads, comes from the kvroute-peer Secret (required)."""
        from kvroute_server.cli import serve

        (option,) = [p for p in serve.params if p.name == "peer_token"]
        env = {e["name"]: e for e in container(kvroute_deployment(), "kvroute")["env"]}
        assert option.envvar in env, f"kvroute serve reads {option.envvar}; the container sets {sorted(env)}"
        ref = env[option.envvar]["valueFrom"]["secretKeyRef"]
        assert (ref["name"], ref["key"]) == ("kvroute-peer", "token")
        assert not ref.get("optional", False), "peers are configured: without the token kvroute serve refuses to start"

    def test_termination_outlasts_the_drain(self) -> None:
        """The grace period covers the preStop pause plus kvroute's own shutdown_timeout for requests in flight."""
        pod = kvroute_deployment()["spec"]["template"]["spec"]
        command = container(kvroute_deployment(), "kvroute")["lifecycle"]["preStop"]["exec"]["command"]
        assert command[0] == "sleep"
        for directory in KUSTOMIZATIONS:
            server = tomllib.loads((directory / "kvroute.toml").read_text(encoding="utf-8"))["server"]
            needed = float(command[1]) + server["shutdown_timeout"]
            assert pod["terminationGracePeriodSeconds"] > needed, f"{directory}: grace must exceed {needed} s"

    def test_disruption_budget(self) -> None:
        """At most one replica is evicted at a time, and unready replicas (engines down) do not block drains."""
        spec = find(base().own_objects(), "PodDisruptionBudget", "kvroute")["spec"]
        assert spec["maxUnavailable"] == 1
        assert spec["unhealthyPodEvictionPolicy"] == "AlwaysAllow"
        assert kvroute_deployment()["spec"]["replicas"] >= 2


@pytest.fixture(scope="module")
def objects() -> list[dict[str, Any]]:
    """The example overlay rendered by `kubectl kustomize` (skipped, saying why, without kubectl)."""
    if kubectl() is None:
        pytest.skip(NO_KUBECTL)
    return render(OVERLAY)


class TestRenderedOverlay:
    """The example overlay as `kubectl kustomize` renders it (the kustomize built into kubectl, offline)."""

    def test_everything_lands_in_the_namespace(self, objects: list[dict[str, Any]]) -> None:
        """Every namespaced object is in the overlay's namespace, which the overlay creates."""
        namespace = overlay().data["namespace"]
        find(objects, "Namespace", namespace)
        for doc in objects:
            if doc["kind"] not in CLUSTER_SCOPED:
                assert doc["metadata"].get("namespace") == namespace, f"{resource_id(doc)} is not in {namespace}"

    def test_overlay_settings_are_applied(self, objects: list[dict[str, Any]]) -> None:
        """Replicas, image and the resources patch reach the rendered Deployment."""
        deployment = find(objects, "Deployment", "kvroute")
        main = container(deployment, "kvroute")
        (image,) = overlay().data["images"]
        assert main["image"] == f"{image['newName']}:{image['newTag']}"
        assert deployment["spec"]["replicas"] == 3
        assert main["resources"]["requests"]["cpu"] == "1"
        assert main["securityContext"]["readOnlyRootFilesystem"] is True, "the patch must merge, not replace"

    def test_configmap_holds_the_overlay_config(self, objects: list[dict[str, Any]]) -> None:
        """The mounted ConfigMap (hash-suffixed name) holds the overlay's kvroute.toml, byte for byte."""
        deployment = find(objects, "Deployment", "kvroute")
        volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
        name = volumes["config"]["configMap"]["name"]
        (configmap,) = [d for d in objects if d["kind"] == "ConfigMap" and d["metadata"]["name"] == name]
        assert name != "kvroute-config", "expected the generator's content hash in the name (rollout on change)"
        assert configmap["data"]["kvroute.toml"] == (OVERLAY / "kvroute.toml").read_text(encoding="utf-8")
