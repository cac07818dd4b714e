"""contrib/deploy/Dockerfile: checked as text everywhere, built and run where a Docker daemon answers."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import uuid
from pathlib import Path

import pytest

from tests.deploy.deployfiles import (
    BASE,
    DOCKERFILE,
    DOCKERIGNORE,
    IMAGE_CONFIG,
    ROOT,
    Kustomization,
    container,
    copy_sources,
    find,
    instructions,
    lint_dockerfile,
    stages,
)


def dockerfile() -> str:
    return DOCKERFILE.read_text(encoding="utf-8")


def ignore_rules() -> list[tuple[bool, re.Pattern[str]]]:
    """Dockerfile.dockerignore as (excludes, regex) rules, in order (the last matching rule wins)."""
    rules = []
    for raw in DOCKERIGNORE.read_text(encoding="utf-8").splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        excludes = not line.startswith("!")
        pattern = line.lstrip("!").strip("/")
        regex = "".join(
            ".*" if part == "**" else "[^/]*" if part == "*" else "[^/]" if part == "?" else re.escape(part)
            for part in re.split(r"(\*\*|\*|\?)", pattern)
        )
        rules.append((excludes, re.compile(regex.replace(".*/", "(?:.*/)?"))))
    return rules


def ignored(path: str) -> bool:
    """Whether Docker leaves ``path`` (relative to the repository) out of the build context.

    As Docker does: a rule matches a path when it matches the path or one of its parent folders, and
    the last rule that matches decides.
    """
    parts = path.strip("/").split("/")
    prefixes = ["/".join(parts[:depth]) for depth in range(1, len(parts) + 1)]
    verdict = False
    for excludes, regex in ignore_rules():
        if any(regex.fullmatch(prefix) for prefix in prefixes):
            verdict = excludes
    return verdict


class TestDockerfile:
    """The image definition, read as text (no daemon needed)."""

    def test_lint(self) -> None:
        """Multi-stage from python:3.11-slim; numeric non-root USER, `kvroute serve` entry point, HEALTHCHECK."""
        assert lint_dockerfile(dockerfile()) == []

    @pytest.mark.parametrize(
        ("old", "new", "problem"),
        [
            ("USER 10001:10001", "USER root", "numeric non-root USER"),
            ("USER 10001:10001", "USER 0", "numeric non-root USER"),
            ("USER 10001:10001\n", "", "no USER"),
            (
                'ENTRYPOINT ["kvroute", "serve", "--config", "/etc/kvroute/kvroute.toml"]',
                "ENTRYPOINT kvroute serve",
                "ENTRYPOINT",
            ),
            ("HEALTHCHECK --interval", "# HEALTHCHECK --interval", "HEALTHCHECK"),
            ("127.0.0.1:8000/health", "127.0.0.1:8000/metrics", "/health"),
            ("ARG PYTHON_IMAGE=python:3.11-slim", "ARG PYTHON_IMAGE=python:3.12", "python:3.11-slim"),
        ],
    )
    def test_lint_catches(self, old: str, new: str, problem: str) -> None:
        """The lint fails on a root user, a shell-form entry point, a missing health check or another base image."""
        text = dockerfile()
        assert old in text, f"the Dockerfile no longer contains {old!r}: update this test"
        problems = lint_dockerfile(text.replace(old, new, 1))
        assert any(problem in p for p in problems), f"expected a problem about {problem!r}, got {problems}"

    def test_user_is_the_deployments_user(self) -> None:
        """The image's USER is the uid/gid the Deployment's runAsUser/runAsGroup (and runAsNonRoot) expect."""
        (user,) = [i.args for i in stages(dockerfile())[-1] if i.keyword == "USER"]
        deployment = find(Kustomization.load(BASE).own_objects(), "Deployment", "kvroute")
        context = deployment["spec"]["template"]["spec"]["securityContext"]
        assert user == f"{context['runAsUser']}:{context['runAsGroup']}"

    def test_port_and_config_path_match(self) -> None:
        """EXPOSE is the config's and the container's port; the entry point reads where the ConfigMap is mounted."""
        (exposed,) = [i.args for i in stages(dockerfile())[-1] if i.keyword == "EXPOSE"]
        deployment = find(Kustomization.load(BASE).own_objects(), "Deployment", "kvroute")
        main = container(deployment, "kvroute")
        assert exposed == str(main["ports"][0]["containerPort"])
        assert f"port = {exposed}" in IMAGE_CONFIG.read_text(encoding="utf-8")
        mounts = {m["name"]: m["mountPath"] for m in main["volumeMounts"]}
        assert f"{mounts['config']}/kvroute.toml" == "/etc/kvroute/kvroute.toml"
        copies = [i.args for i in stages(dockerfile())[-1] if i.keyword == "COPY"]
        assert "contrib/deploy/kvroute.toml /etc/kvroute/kvroute.toml" in copies

    def test_installs_every_distribution_it_copies(self) -> None:
        """The build stage installs the library, the server, every strategy plugin, vllm and kubernetes."""
        (install,) = [i.args for i in stages(dockerfile())[0] if i.keyword == "RUN" and "pip install" in i.args]
        installed = {word.removeprefix("/src/") for word in shlex.split(install) if word.startswith("/src/")}
        plugins = {f"plugins/{p.name}" for p in (ROOT / "plugins").iterdir() if (p / "pyproject.toml").exists()}
        expected = {"core", "contrib/server", "contrib/vllm", "contrib/kubernetes"} | plugins
        assert installed == expected, (
            f"missing: {sorted(expected - installed)}; unexpected: {sorted(installed - expected)}"
        )

    def test_copied_paths_exist_and_reach_the_context(self) -> None:
        """Every COPY source exists in the checkout and Dockerfile.dockerignore lets it (and its pyproject.toml) in."""
        sources = list(copy_sources(dockerfile()))
        assert "contrib/kubernetes" in sources and "core" in sources
        for source in sources:
            path = ROOT / source
            assert path.exists(), f"the Dockerfile copies {source}, which is not in the checkout"
            assert not ignored(source), f"Dockerfile.dockerignore leaves {source} out of the build context"
            if path.is_dir():
                assert not ignored(f"{source}/pyproject.toml"), f"{source}/pyproject.toml is left out"

    @pytest.mark.parametrize(
        "path", [".venv/bin/python", "tests/deploy/deployfiles.py", "core/src/kvroute/__pycache__/x.pyc", ".git/HEAD"]
    )
    def test_context_leaves_out(self, path: str) -> None:
        """Virtualenvs, tests, caches and .git stay out of the build context."""
        assert ignored(path)

    def test_instructions_parse_continuations(self) -> None:
        """The Dockerfile reader joins continuation lines into one instruction and skips comments."""
        parsed = instructions("# c\nFROM a AS b\nRUN x \\\n    # note\n    y\nUSER 1\n")
        assert [(i.keyword, i.args) for i in parsed] == [("FROM", "a AS b"), ("RUN", "x y"), ("USER", "1")]


def docker_daemon() -> str | None:
    """Why the image cannot be built here, or None when `docker info` succeeds."""
    binary = shutil.which("docker")
    if binary is None:
        return "the docker client is not installed"
    try:
        done = subprocess.run([binary, "info"], capture_output=True, text=True, timeout=30, check=False)
    except subprocess.TimeoutExpired:
        return "`docker info` did not answer within 30 s"
    if done.returncode != 0:
        reason = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return f"`docker info` failed: {reason}"
    return None


class TestImageBuild:
    """The image itself, where a Docker daemon is reachable."""

    def test_builds_and_runs_as_non_root(self, tmp_path: Path) -> None:
        """`docker build` succeeds, the image runs as uid 10001, and its entry point accepts its own config."""
        reason = docker_daemon()
        if reason is not None:
            pytest.skip(f"no Docker daemon, so the image is not built here ({reason}); the Dockerfile checks still ran")
        tag = f"kvroute-deploy-test:{uuid.uuid4().hex[:12]}"
        build = ["docker", "build", "-f", str(DOCKERFILE), "-t", tag, str(ROOT)]
        try:
            done = subprocess.run(build, capture_output=True, text=True, timeout=900, check=False)
            assert done.returncode == 0, f"docker build failed:\n{done.stderr[-4000:]}"
            who = subprocess.run(
                ["docker", "run", "--rm", "--entrypoint", "id", tag], capture_output=True, text=True, timeout=120
            )
            assert who.stdout.startswith("uid=10001"), f"expected uid=10001, got {who.stdout!r} {who.stderr!r}"
            check = subprocess.run(
                ["docker", "run", "--rm", "--network", "none", "--read-only", tag, "--check"],
                capture_output=True,
                text=True,
                timeout=120,
            )
            assert check.returncode == 0, f"kvroute serve --check in the image failed: {check.stderr}"
            health = subprocess.run(
                ["docker", "image", "inspect", "--format", "{{json .Config.Healthcheck}}", tag],
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert "/health" in health.stdout
        finally:
            subprocess.run(["docker", "image", "rm", "-f", tag], capture_output=True, timeout=120, check=False)
