"""kvroute's ``kubernetes`` discovery kind: follow a Service's EndpointSlices, list then watch.

Public API:

* `KubernetesDiscovery`: the provider (registered as kind ``kubernetes``; ``create(**options)`` is
  its factory, options in docs/kubernetes.md).
* `KubernetesTarget`: ``NAMESPACE/SERVICE:PORT``.
* `SliceState`, `slice_backends`, `endpoint_state`, `Defaults`: EndpointSlices to backends.
* `Backoff`: the capped exponential backoff between reconnects.
"""

from __future__ import annotations

from collections.abc import Callable

import kvroute
from kvroute_kubernetes.backoff import Backoff
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
    "Backoff",
    "Defaults",
    "KubernetesDiscovery",
    "KubernetesTarget",
    "SliceState",
    "endpoint_state",
    "kvroute_register_discovery",
    "slice_backends",
]


@kvroute.hookimpl
def kvroute_register_discovery(register: Callable[..., None]) -> None:
    register("kubernetes", KubernetesDiscovery.create)
