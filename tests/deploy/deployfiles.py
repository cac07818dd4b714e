"""Reading contrib/deploy offline: the kustomizations, their resources, a render, and the Dockerfile.

Shared by the tests in this folder. Nothing here talks to a cluster or a registry: manifests are
checked against the Kubernetes OpenAPI schemas bundled in kubernetes-validate, a render uses the
kustomize built into ``kubectl`` (``kubectl kustomize`` reads local files only), and the Dockerfile is
read as text.
"""

from __future__ import annotations

import json
import shlex
import shutil
import subprocess
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import attrs
import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "contrib" / "deploy"
KUBERNETES = DEPLOY / "kubernetes"
BASE = KUBERNETES / "base"
OVERLAY = KUBERNETES / "overlays" / "example"
KUSTOMIZATIONS = (BASE, OVERLAY)
DOCKERFILE = DEPLOY / "Dockerfile"
DOCKERIGNORE = DEPLOY / "Dockerfile.dockerignore"
IMAGE_CONFIG = DEPLOY / "kvroute.toml"

#: The Kubernetes minor versions every manifest is validated against (docs/deploy.md states them):
#: the releases whose schemas kubernetes-validate 1.37 bundles, from 1.30 (the oldest release with
#: every field these manifests use; PodDisruptionBudget's unhealthyPodEvictionPolicy is GA in 1.31,
#: beta and on by default in 1.30) to 1.37.
KUBERNETES_VERSIONS = tuple(f"1.{minor}" for minor in range(30, 38))

#: Kinds that live in a namespace (everything these manifests use except Namespace itself).
CLUSTER_SCOPED = frozenset({"Namespace"})


def yaml_documents(path: Path) -> list[dict[str, Any]]:
    """The non-empty YAML documents of a file, each checked to be a mapping."""
    docs = [doc for doc in yaml.safe_load_all(path.read_text(encoding="utf-8")) if doc is not None]
    for doc in docs:
        assert isinstance(doc, dict), f"{path}: expected every YAML document to be a mapping, got {type(doc).__name__}"
    return docs


def resource_id(doc: Mapping[str, Any]) -> tuple[str, str]:
    """(kind, name) of a Kubernetes object."""
    return str(doc["kind"]), str(doc["metadata"]["name"])


@attrs.frozen
class Kustomization:
    """A kustomization.yaml and the files it names, resolved against its folder."""

    directory: Path
    data: Mapping[str, Any]

    @classmethod
    def load(cls, directory: Path) -> Kustomization:
        docs = yaml_documents(directory / "kustomization.yaml")
        assert len(docs) == 1, f"{directory}/kustomization.yaml: expected one document, got {len(docs)}"
        return cls(directory, docs[0])

    @property
    def resources(self) -> list[Path]:
        return [(self.directory / entry).resolve() for entry in self.data.get("resources", [])]

    @property
    def resource_files(self) -> list[Path]:
        """Listed resources that are files (the others are kustomizations: folders)."""
        return [path for path in self.resources if not path.is_dir()]

    @property
    def bases(self) -> list[Kustomization]:
        return [Kustomization.load(path) for path in self.resources if path.is_dir()]

    @property
    def patch_files(self) -> list[Path]:
        return [(self.directory / patch["path"]).resolve() for patch in self.data.get("patches", []) if "path" in patch]

    @property
    def generator_files(self) -> list[Path]:
        files = []
        for generator in self.data.get("configMapGenerator", []) + self.data.get("secretGenerator", []):
            for entry in generator.get("files", []):
                files.append((self.directory / entry.rpartition("=")[2]).resolve())
        return files

    def own_objects(self) -> list[dict[str, Any]]:
        """The objects of this folder's own resource files (not its bases')."""
        return [doc for path in self.resource_files for doc in yaml_documents(path)]

    def all_objects(self) -> list[dict[str, Any]]:
        """The objects of this folder's and its bases' resource files, unrendered."""
        return [doc for base in self.bases for doc in base.all_objects()] + self.own_objects()

    def generated_names(self) -> set[tuple[str, str]]:
        """(kind, name) of the ConfigMaps and Secrets its generators (and its bases') make."""
        names = {("ConfigMap", g["name"]) for g in self.data.get("configMapGenerator", [])}
        names |= {("Secret", g["name"]) for g in self.data.get("secretGenerator", [])}
        for base in self.bases:
            names |= base.generated_names()
        return names


def kubectl() -> str | None:
    """The kubectl binary, whose built-in kustomize renders offline, or None."""
    return shutil.which("kubectl")


def render(directory: Path) -> list[dict[str, Any]]:
    """``kubectl kustomize DIRECTORY``: the objects kubectl apply -k would send."""
    binary = kubectl()
    assert binary is not None, "kubectl is not installed (callers skip first)"
    done = subprocess.run(
        [binary, "kustomize", str(directory)], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, f"kubectl kustomize {directory} failed ({done.returncode}): {done.stderr}"
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc is not None]


def find(objects: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    """The one object of that kind whose name is ``name`` (a generated one may carry a hash suffix; an exact name
    wins, so ``kvroute`` is not confused with ``kvroute-peers``)."""
    of_kind = [doc for doc in objects if doc["kind"] == kind]
    found = [doc for doc in of_kind if doc["metadata"]["name"] == name] or [
        doc for doc in of_kind if doc["metadata"]["name"].startswith(name + "-")
    ]
    assert len(found) == 1, f"expected one {kind} named {name!r}, got {[d['metadata']['name'] for d in found]}"
    return found[0]


def container(deployment: Mapping[str, Any], name: str) -> dict[str, Any]:
    """A Deployment's container by name."""
    containers = {c["name"]: c for c in deployment["spec"]["template"]["spec"]["containers"]}
    assert name in containers, (
        f"expected a container {name!r} in {deployment['metadata']['name']}, got {sorted(containers)}"
    )
    return containers[name]


# -- the Dockerfile --------------------------------------------------------------------


@attrs.frozen
class Instruction:
    """One Dockerfile instruction: its keyword (upper case) and its arguments, continuation lines joined."""

    keyword: str
    args: str
    line: int

    def exec_form(self) -> list[str] | None:
        """The JSON array of an exec-form instruction (ENTRYPOINT, CMD, HEALTHCHECK's CMD), else None."""
        text = self.args
        if self.keyword == "HEALTHCHECK":
            text = f" {text}".partition(" CMD ")[2].strip()
        if not text.startswith("["):
            return None
        value = json.loads(text)
        assert isinstance(value, list), f"line {self.line}: expected a JSON array, got {text!r}"
        return [str(item) for item in value]


def instructions(text: str) -> list[Instruction]:
    """The instructions of a Dockerfile (comments and blank lines dropped, ``\\`` continuations joined)."""
    out: list[Instruction] = []
    pending = ""
    start = 0
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if pending and line.startswith("#"):
            continue
        if not pending:
            start = number
        if line.endswith("\\"):
            pending += line[:-1].strip() + " "
            continue
        full = (pending + line).strip()
        pending = ""
        keyword, _, args = full.partition(" ")
        out.append(Instruction(keyword.upper(), args.strip(), start))
    return out


def stages(text: str) -> list[list[Instruction]]:
    """The Dockerfile's build stages, each from its FROM on (instructions before the first FROM dropped)."""
    result: list[list[Instruction]] = []
    for item in instructions(text):
        if item.keyword == "FROM":
            result.append([])
        if result:
            result[-1].append(item)
    return result


def build_args(text: str) -> dict[str, str]:
    """Default values of the ARGs declared before the first FROM."""
    values: dict[str, str] = {}
    for item in instructions(text):
        if item.keyword == "FROM":
            break
        if item.keyword == "ARG":
            name, _, default = item.args.partition("=")
            values[name.strip()] = default.strip()
    return values


def copy_sources(text: str) -> Iterator[str]:
    """The build-context paths the Dockerfile COPYs (not ``COPY --from=stage``)."""
    for item in instructions(text):
        if item.keyword != "COPY":
            continue
        words = shlex.split(item.args)
        if any(word.startswith("--from=") for word in words):
            continue
        paths = [word for word in words if not word.startswith("--")]
        yield from paths[:-1]


def lint_dockerfile(text: str) -> list[str]:
    """What is wrong with a Dockerfile for kvroute's image; an empty list when nothing is.

    The final stage must: run as a numeric non-root USER, have ``kvroute serve --config
    /etc/kvroute/kvroute.toml`` as its exec-form ENTRYPOINT, EXPOSE one port, and have a HEALTHCHECK
    that asks ``/health`` on that port. Every stage starts from the python:3.11-slim image.
    """
    problems: list[str] = []
    all_stages = stages(text)
    if len(all_stages) < 2:
        problems.append(f"expected a multi-stage build (at least 2 FROM), got {len(all_stages)}")
    if not all_stages:
        return problems
    args = build_args(text)
    for stage in all_stages:
        image = stage[0].args.split()[0]
        for name, value in args.items():
            image = image.replace(f"${{{name}}}", value).replace(f"${name}", value)
        if image != "python:3.11-slim":
            problems.append(f"line {stage[0].line}: expected FROM python:3.11-slim, got {image!r}")
    final = all_stages[-1]
    users = [item for item in final if item.keyword == "USER"]
    if not users:
        problems.append("the final stage has no USER: the image would run as root")
    else:
        user, _, group = users[-1].args.partition(":")
        if not user.isdigit() or int(user) == 0 or (group and (not group.isdigit() or int(group) == 0)):
            problems.append(
                f"line {users[-1].line}: expected a numeric non-root USER uid[:gid], got {users[-1].args!r}"
            )
    entrypoints = [item for item in final if item.keyword == "ENTRYPOINT"]
    expected = ["kvroute", "serve", "--config", "/etc/kvroute/kvroute.toml"]
    if not entrypoints or entrypoints[-1].exec_form() != expected:
        got = entrypoints[-1].args if entrypoints else None
        problems.append(f"expected ENTRYPOINT {json.dumps(expected)} (exec form), got {got!r}")
    exposed = [port for item in final if item.keyword == "EXPOSE" for port in item.args.split()]
    if len(exposed) != 1:
        problems.append(f"expected the final stage to EXPOSE one port, got {exposed}")
    checks = [item for item in final if item.keyword == "HEALTHCHECK"]
    if not checks or checks[-1].args.upper() == "NONE":
        problems.append("expected a HEALTHCHECK in the final stage, got none")
    elif exposed and f":{exposed[0].partition('/')[0]}/health" not in checks[-1].args:
        problems.append(f"expected the HEALTHCHECK to ask /health on port {exposed[0]}, got {checks[-1].args!r}")
    return problems
