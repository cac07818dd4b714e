"""Backend adapters: everything engine-specific about talking to one backend.

A backend kind (``openai``, ``vllm``, ``tensorrt-llm``...) is registered through the
``kvroute_register_backend_kinds`` hook with a factory ``factory(backend, **options)``
returning an object that follows `BackendAdapter`. The core ships ``openai``: any
OpenAI-compatible server, probed on ``/health``, with no engine telemetry.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import attrs

from kvroute.backend import Backend

__all__ = ["BackendAdapter", "OpenAIAdapter"]


@runtime_checkable
class BackendAdapter(Protocol):
    """What the proxy needs to know about one backend's engine."""

    backend: Backend

    #: Path answering 200 when the engine can serve (probed by active health checks).
    health_path: str
    #: Path listing served models in OpenAI's ``{"object": "list", "data": [...]}`` shape.
    models_path: str


@attrs.define
class OpenAIAdapter:
    """Any OpenAI-compatible server: health on ``/health``, models on ``/v1/models``, no telemetry."""

    backend: Backend
    health_path: str = "/health"
    models_path: str = "/v1/models"

    @classmethod
    def create(cls, backend: Backend, **options: Any) -> OpenAIAdapter:
        """Factory registered for kind ``openai``; options override the paths."""
        return cls(backend, **options)
