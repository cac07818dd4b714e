"""What the core registers itself: the generic ``openai`` backend kind. Never a strategy."""

from __future__ import annotations

from collections.abc import Callable

from kvroute._markers import hookimpl
from kvroute.adapters import OpenAIAdapter


@hookimpl
def kvroute_register_backend_kinds(register: Callable[..., None]) -> None:
    register("openai", OpenAIAdapter.create)
