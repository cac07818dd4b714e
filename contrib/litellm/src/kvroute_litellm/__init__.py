"""kvroute inside LiteLLM: any kvroute strategy picks the deployment for a LiteLLM ``Router``.

    import litellm, kvroute_litellm

    router = litellm.Router(model_list=[...])                # deployments with model_info.id
    kvroute_litellm.install(router, "consistent-hash", {"prefix_length": 2048})
    await router.acompletion(model="llama", messages=[...])  # routed by kvroute

See docs/embedding.md and this distribution's README.
"""

from __future__ import annotations

from kvroute_litellm.deployments import ModelGroup, backend_from_deployment, deployment_id
from kvroute_litellm.requests import METADATA_AFFINITY_KEY, route_request
from kvroute_litellm.routing import DECISION_KEY, FAILED_KEY, LEASE_KEY, KvrouteRouting, LeaseCallbacks, install

__all__ = [
    "DECISION_KEY",
    "FAILED_KEY",
    "LEASE_KEY",
    "METADATA_AFFINITY_KEY",
    "KvrouteRouting",
    "LeaseCallbacks",
    "ModelGroup",
    "backend_from_deployment",
    "deployment_id",
    "install",
    "route_request",
]
