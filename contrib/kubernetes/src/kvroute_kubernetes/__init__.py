"""kvroute's ``kubernetes`` discovery kind: follow a Service's EndpointSlices, list then watch.

Public API:

* `KubernetesDiscovery`: the provider (registered as kind ``kubernetes``; ``create(**options)`` is
  its factory, options in docs/kubernetes.md).
* `KubernetesTarget`: ``NAMESPACE/SERVICE:PORT``.
* `SliceState`, `slice_backends`, `endpoint_state`, `Defaults`: EndpointSlices to backends.

The entry point is `kvroute_kubernetes.plugin`, which registers the kind without importing this
package's client (kubernetes_asyncio) until a source is created.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvroute_kubernetes.provider import KubernetesDiscovery
    from kvroute_kubernetes.slices import (
        ANNOTATION_KIND,
        ANNOTATION_MODELS,
        ANNOTATION_WEIGHT,
        Defaults,
        SliceState,
        endpoint_state,
        slice_backends,
    )
    from kvroute_kubernetes.target import KubernetesTarget

__all__ = [
    "ANNOTATION_KIND",
    "ANNOTATION_MODELS",
    "ANNOTATION_WEIGHT",
    "Defaults",
    "KubernetesDiscovery",
    "KubernetesTarget",
    "SliceState",
    "endpoint_state",
    "slice_backends",
]

# Where each public name lives: imported on first access (PEP 562), so that loading the entry
# point (`kvroute_kubernetes.plugin`, which imports this package first) costs nothing.
_HOMES = {
    "KubernetesDiscovery": "provider",
    "KubernetesTarget": "target",
    **dict.fromkeys(
        (
            "ANNOTATION_KIND",
            "ANNOTATION_MODELS",
            "ANNOTATION_WEIGHT",
            "Defaults",
            "SliceState",
            "endpoint_state",
            "slice_backends",
        ),
        "slices",
    ),
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'kvroute_kubernetes' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f"kvroute_kubernetes.{home}"), name)
    globals()[name] = value
    return value
