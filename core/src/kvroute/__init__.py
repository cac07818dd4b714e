"""kvroute: prefix-aware routing for LLM inference fleets.

The public API is re-exported here; everything else is an implementation detail.
"""

from __future__ import annotations

from kvroute._markers import hookimpl
from kvroute.adapters import BackendAdapter, HttpGetter, HttpReply, OpenAIAdapter
from kvroute.backend import Backend, BackendState, EngineLoad
from kvroute.cache_view import CacheView, Reuse
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
from kvroute.holds import HoldLog
from kvroute.plugins import PluginManager
from kvroute.predictor import Observation, Predictor, Priors
from kvroute.request import AFFINITY_HEADER, LORA_HEADER, REQUEST_ID_HEADER, RouteRequest
from kvroute.router import Lease, Router
from kvroute.sessions import Sessions
from kvroute.shadow import ShadowSet, Verdict
from kvroute.slo import Objectives, Prediction, Priority
from kvroute.slo_choice import SloChoice
from kvroute.strategy import BaseStrategy, Decision, Hold, Holds, Outcome, SpillReason, Status, Strategy

__all__ = [
    "AFFINITY_HEADER",
    "LORA_HEADER",
    "REQUEST_ID_HEADER",
    "Backend",
    "BackendAdapter",
    "BackendState",
    "BaseStrategy",
    "CacheView",
    "ConfigError",
    "Decision",
    "EngineLoad",
    "Fleet",
    "FleetEvent",
    "Hold",
    "HoldLog",
    "Holds",
    "HttpGetter",
    "HttpReply",
    "InvalidRequest",
    "KvrouteError",
    "Lease",
    "Objectives",
    "Observation",
    "NoBackendAvailable",
    "OpenAIAdapter",
    "Outcome",
    "PluginLoadError",
    "PluginManager",
    "Prediction",
    "Predictor",
    "Priority",
    "Priors",
    "StrategyError",
    "Reuse",
    "RouteRequest",
    "Router",
    "Sessions",
    "ShadowSet",
    "SloChoice",
    "SpillReason",
    "Status",
    "Strategy",
    "UnknownBackend",
    "Verdict",
    "__version__",
    "hash64",
    "hash_parts",
    "hookimpl",
]


def __getattr__(name: str) -> str:
    # ``kvroute.__version__`` is read from the installed metadata on first use: importing
    # importlib.metadata costs ~25 ms that `import kvroute` need not pay.
    if name == "__version__":
        from importlib import metadata

        try:
            return metadata.version("kvroute")
        except metadata.PackageNotFoundError:  # running from a source tree
            return "0.0.0"
    raise AttributeError(f"module 'kvroute' has no attribute {name!r}")
