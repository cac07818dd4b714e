"""LiteLLM deployments as kvroute backends, and one kvroute fleet per model group.

A LiteLLM deployment (``{"model_name", "litellm_params", "model_info": {"id"}}``) becomes
a `kvroute.Backend` whose id is ``model_info.id``, whose URL is ``api_base`` and whose
weight is ``litellm_params.weight`` (LiteLLM's own weight for simple-shuffle). Each model
group gets its own `kvroute.Fleet`, so adding a deployment to one group never moves the
hash placements of another.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import attrs

from kvroute import Backend, ConfigError, Fleet, PluginManager, Router

__all__ = ["ModelGroup", "backend_from_deployment", "deployment_id"]


def deployment_id(deployment: Mapping[str, Any]) -> str:
    """The deployment's ``model_info.id`` as a string; `ConfigError` when it has none."""
    info = deployment.get("model_info")
    value = info.get("id") if isinstance(info, Mapping) else None
    if isinstance(value, bool) or not isinstance(value, str | int) or value == "":
        raise ConfigError(
            f"a LiteLLM deployment must have a 'model_info.id' string (got {value!r} for model group "
            f"{deployment.get('model_name')!r}); LiteLLM's Router sets one for every deployment it loads."
        )
    return str(value)


def backend_from_deployment(deployment: Mapping[str, Any]) -> Backend:
    """The kvroute backend for one LiteLLM deployment (id, api_base, weight, provider model as a label)."""
    params = deployment.get("litellm_params")
    params = params if isinstance(params, Mapping) else {}
    weight = params.get("weight", 1.0)
    ident = deployment_id(deployment)
    try:
        weight = float(weight if weight is not None else 1.0)
        return Backend(
            id=ident,
            url=str(params.get("api_base") or ""),
            kind="openai",
            weight=weight,
            labels={"litellm_model": str(params.get("model", ""))},
        )
    except (TypeError, ValueError) as exc:
        raise ConfigError(
            f"LiteLLM deployment {ident!r}: 'litellm_params.weight' must be a number > 0 ({exc})"
        ) from None


def _signature(backend: Backend) -> tuple[str, str, float]:
    return backend.id, backend.url, backend.weight


@attrs.define
class ModelGroup:
    """One LiteLLM model group: its kvroute fleet and the router (strategy instance) over it."""

    name: str
    fleet: Fleet
    router: Router
    _signature: tuple[tuple[str, str, float], ...] = ()

    @classmethod
    def create(cls, name: str, plugins: PluginManager, strategy: str, options: Mapping[str, Any] | None) -> ModelGroup:
        """An empty group with a fresh strategy instance built by name."""
        fleet = Fleet()
        return cls(name, fleet, Router.create(fleet, strategy, options, plugins=plugins))

    def sync(self, deployments: Iterable[Mapping[str, Any]]) -> None:
        """Make the fleet hold exactly ``deployments``: add new ones, remove gone ones, follow re-weights.

        Cheap when nothing changed (one tuple comparison), so it runs on every pick.
        """
        wanted: dict[str, Backend] = {}
        for deployment in deployments:
            backend = backend_from_deployment(deployment)
            wanted.setdefault(backend.id, backend)
        signature = tuple(sorted(_signature(b) for b in wanted.values()))
        if signature == self._signature:
            return
        with self.fleet.lock:
            for backend_id in [b.id for b in self.fleet.backends() if b.id not in wanted]:
                self.fleet.remove(backend_id)
            for backend in wanted.values():
                if backend.id not in self.fleet:
                    self.fleet.add(backend)
                    continue
                current = self.fleet.get(backend.id).backend
                if current.url != backend.url:
                    self.fleet.remove(backend.id)
                    self.fleet.add(backend)
                elif current.weight != backend.weight:
                    self.fleet.set_weight(backend.id, backend.weight)
        self._signature = signature
