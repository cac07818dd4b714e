"""The kvroute request routers alive in this process, for introspection (their fleets and `RouterStats`).

Ray Serve ships a deployment's request router class by value (it pickles the class's own module), so
each process that routes gets its own copy of the class; this module is imported by reference and is
the one place every copy registers with.
"""

from __future__ import annotations

import weakref
from typing import Any

__all__ = ["register", "routers"]

_ROUTERS: weakref.WeakSet[Any] = weakref.WeakSet()


def register(router: Any) -> None:
    """Remember ``router`` for as long as Ray keeps it."""
    _ROUTERS.add(router)


def routers(app_name: str | None = None, deployment: str | None = None) -> list[Any]:
    """The live ``KvrouteRequestRouter`` instances of this process, optionally of one application/deployment."""
    found = []
    for router in list(_ROUTERS):
        ident = getattr(router, "_deployment_id", None)
        if app_name is not None and getattr(ident, "app_name", None) != app_name:
            continue
        if deployment is not None and getattr(ident, "name", None) != deployment:
            continue
        found.append(router)
    return found
