"""docs/deploy.md says what tests/deploy checks."""

from __future__ import annotations

from importlib import metadata

from tests.deploy.deployfiles import KUBERNETES_VERSIONS, OVERLAY, ROOT

DOC = ROOT / "docs" / "deploy.md"


class TestDeployDoc:
    """The walkthrough's claims about validation and its commands."""

    def test_states_the_validated_versions(self) -> None:
        """The doc names the Kubernetes versions the manifests are validated against, and the validator's version."""
        text = " ".join(DOC.read_text(encoding="utf-8").split())
        versions = f"Kubernetes {KUBERNETES_VERSIONS[0]} to {KUBERNETES_VERSIONS[-1]}"
        assert versions in text.replace("**", ""), f"expected docs/deploy.md to say {versions!r}"
        assert f"`kubernetes-validate` {metadata.version('kubernetes-validate')}" in text

    def test_apply_command_names_the_overlay(self) -> None:
        """The walkthrough applies the example overlay by its path in the repository."""
        command = f"kubectl apply -k {OVERLAY.relative_to(ROOT).as_posix()}"
        assert command in DOC.read_text(encoding="utf-8")
        assert (OVERLAY / "kustomization.yaml").exists()
