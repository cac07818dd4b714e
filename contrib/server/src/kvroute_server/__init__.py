"""kvroute-server: the OpenAI-compatible routing proxy behind ``kvroute serve`` (``pip install "kvroute[server]"``).

Public API: `ProxyApp` (the ASGI app), the configuration types and loaders, and
`ServerThread` (run any ASGI app on loopback in a thread: tests, benchmarks, notebooks).
They are imported on first use, so that the plugin module (`kvroute_server.commands`), which
every `kvroute.PluginManager` loads, does not import uvicorn or aiohttp.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvroute_server.config import (
        BackendConfig,
        HealthConfig,
        ServerConfig,
        SessionConfig,
        TimeoutConfig,
        TracingConfig,
        load_toml,
    )
    from kvroute_server.http.runner import ServerThread, run_server
    from kvroute_server.proxy.app import ProxyApp
    from kvroute_server.sagemaker import import_sagemaker, load_sagemaker

#: Public name -> the module that defines it.
_EXPORTS = {
    "ProxyApp": "kvroute_server.proxy.app",
    "BackendConfig": "kvroute_server.config",
    "HealthConfig": "kvroute_server.config",
    "ServerConfig": "kvroute_server.config",
    "SessionConfig": "kvroute_server.config",
    "TimeoutConfig": "kvroute_server.config",
    "TracingConfig": "kvroute_server.config",
    "load_toml": "kvroute_server.config",
    "ServerThread": "kvroute_server.http.runner",
    "run_server": "kvroute_server.http.runner",
    "import_sagemaker": "kvroute_server.sagemaker",
    "load_sagemaker": "kvroute_server.sagemaker",
}

__all__ = [
    "BackendConfig",
    "HealthConfig",
    "ProxyApp",
    "ServerConfig",
    "ServerThread",
    "SessionConfig",
    "TimeoutConfig",
    "TracingConfig",
    "import_sagemaker",
    "load_sagemaker",
    "load_toml",
    "run_server",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'kvroute_server' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
