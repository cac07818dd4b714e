"""kvroute inside Ray Serve: any kvroute strategy routes a deployment's requests over its replicas.

    from ray import serve
    from kvroute_ray import request_router_config

    @serve.deployment(num_replicas=4, request_router_config=request_router_config("bounded-load"))
    class Engine: ...

See docs/ray.md and this distribution's README.
"""

from __future__ import annotations

from kvroute_ray.requests import body_of, route_request
from kvroute_ray.router import KvrouteRequestRouter, RouterStats, request_router_config, validate_kwargs

__all__ = [
    "KvrouteRequestRouter",
    "RouterStats",
    "body_of",
    "request_router_config",
    "route_request",
    "validate_kwargs",
]
