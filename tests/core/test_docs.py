"""Documentation stays in step with the code."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

import kvroute
from kvroute import hookspecs

DOCS = Path(__file__).resolve().parents[2] / "docs"


def _signature(name: str) -> str:
    spec = getattr(hookspecs, name)
    params = ", ".join(inspect.signature(spec).parameters)
    return f"{name}({params})"


class TestPluginHooksDoc:
    @pytest.mark.parametrize("name", sorted(hookspecs._all_specs()))
    def test_every_hook_documented_with_signature(self, name: str) -> None:
        """docs/plugin-hooks.md names each hook with its exact parameter list."""
        text = (DOCS / "plugin-hooks.md").read_text()
        assert _signature(name) in text, f"{_signature(name)} is not in docs/plugin-hooks.md"

    def test_no_documented_hook_is_missing_from_code(self) -> None:
        """Every kvroute_* hook the doc describes in a heading exists in hookspecs."""
        text = (DOCS / "plugin-hooks.md").read_text()
        documented = set(re.findall(r"^### `(kvroute_\w+)\(", text, flags=re.M))
        assert documented == set(hookspecs._all_specs())


class TestPublicApi:
    def test_all_is_importable(self) -> None:
        """Every name in kvroute.__all__ exists."""
        missing = [name for name in kvroute.__all__ if not hasattr(kvroute, name)]
        assert missing == []
