"""kvroute: prefix-aware routing for LLM inference fleets.

The public API is re-exported here; everything else is an implementation detail.
"""

from __future__ import annotations

from importlib import metadata as _metadata

from kvroute._markers import hookimpl
from kvroute.adapters import BackendAdapter, HttpGetter, HttpReply, OpenAIAdapter
from kvroute.backend import Backend, BackendState, EngineLoad
from kvroute.errors import (
    ConfigError,
    InvalidRequest,
    KvrouteError,
    NoBackendAvailable,
    PluginLoadError,
    StrategyError,
    UnknownBackend,
)
from kvroute.fleet import Fleet, FleetEvent
from kvroute.hashing import hash64, hash_parts
from kvroute.plugins import PluginManager
from kvroute.request import AFFINITY_HEADER, LORA_HEADER, REQUEST_ID_HEADER, RouteRequest
from kvroute.router import Lease, Router
from kvroute.strategy import BaseStrategy, Decision, Outcome, SpillReason, Status, Strategy

try:
    __version__ = _metadata.version("kvroute")
except _metadata.PackageNotFoundError:  # running from a source tree
    __version__ = "0.0.0"

__all__ = [
    "AFFINITY_HEADER",
    "LORA_HEADER",
    "REQUEST_ID_HEADER",
    "Backend",
    "BackendAdapter",
    "BackendState",
    "BaseStrategy",
    "ConfigError",
    "Decision",
    "EngineLoad",
    "Fleet",
    "FleetEvent",
    "HttpGetter",
    "HttpReply",
    "InvalidRequest",
    "KvrouteError",
    "Lease",
    "NoBackendAvailable",
    "OpenAIAdapter",
    "Outcome",
    "PluginLoadError",
    "PluginManager",
    "StrategyError",
    "RouteRequest",
    "Router",
    "SpillReason",
    "Status",
    "Strategy",
    "UnknownBackend",
    "__version__",
    "hash64",
    "hash_parts",
    "hookimpl",
]
