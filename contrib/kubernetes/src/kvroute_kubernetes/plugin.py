"""The entry point kvroute loads: registers the ``kubernetes`` discovery kind without importing its client.

Every ``kvroute`` command loads the installed plugins, ``kvroute --help`` included; the provider
imports kubernetes_asyncio (and aiohttp), about 0.3 s, so it is imported when a kubernetes
source is actually created.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import kvroute


def create(**options: Any) -> Any:
    """`KubernetesDiscovery.create`, imported on first use."""
    from kvroute_kubernetes.provider import KubernetesDiscovery

    return KubernetesDiscovery.create(**options)


@kvroute.hookimpl
def kvroute_register_discovery(register: Callable[..., None]) -> None:
    register("kubernetes", create)
