"""The OpenAI-compatible routing proxy behind ``kvroute serve`` (extra ``kvroute[server]``).

Public API: `ProxyApp` (the ASGI app), the configuration types and loaders, and
`ServerThread` (run any ASGI app on loopback in a thread: tests, benchmarks, notebooks).
"""

from __future__ import annotations

from kvroute.server.app import ProxyApp
from kvroute.server.config import BackendConfig, HealthConfig, ServerConfig, TimeoutConfig, load_toml
from kvroute.server.runner import ServerThread, run_server
from kvroute.server.sagemaker import import_sagemaker, load_sagemaker

__all__ = [
    "BackendConfig",
    "HealthConfig",
    "ProxyApp",
    "ServerConfig",
    "ServerThread",
    "TimeoutConfig",
    "import_sagemaker",
    "load_sagemaker",
    "load_toml",
    "run_server",
]
