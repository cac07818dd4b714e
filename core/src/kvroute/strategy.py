"""The `Strategy` interface, the `Decision` it produces, and building strategies from options.

A strategy answers one question, synchronously and without I/O: given this request and
these candidates, which backend? It may keep state (an index, counters) fed by the
optional callbacks. The router calls it directly; pluggy is only used to find it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from enum import StrEnum
from typing import Any, Literal, Protocol, runtime_checkable

import attrs

from kvroute.backend import Backend, BackendState
from kvroute.errors import ConfigError
from kvroute.fleet import FleetEvent
from kvroute.request import RouteRequest
from kvroute.slo import Prediction

__all__ = [
    "BaseStrategy",
    "Decision",
    "HasPromptTokenizer",
    "Hold",
    "HoldKind",
    "Holds",
    "Outcome",
    "Pick",
    "SpillReason",
    "Status",
    "Strategy",
    "StrategyFactory",
    "build_strategy",
]


class SpillReason(StrEnum):
    """Why a request did not go to its key's first choice (`Decision.spill_reason`)."""

    #: The home is at its bounded-load cap (``load_factor`` x its fair share, at least ``min_capacity``).
    LOAD_FACTOR = "load_factor"
    #: The home has ``concurrency_threshold`` requests in flight (SageMaker's rule).
    CONCURRENCY_THRESHOLD = "concurrency_threshold"
    #: The home is unhealthy, draining or excluded for this request.
    HOME_UNROUTABLE = "home_unroutable"


class Status(StrEnum):
    """How a routed request ended (`Outcome.status`, `Router.release`)."""

    OK = "ok"
    ERROR = "error"
    CANCELLED = "cancelled"


@attrs.frozen
class Decision:
    """Which strategy chose which backend, and why.

    ``reason`` is a short machine-readable word (``random``, ``least_loaded``, ``hash``,
    ``spilled``...); ``detail`` holds anything that explains it (the home backend, the spill
    cause, the matched prefix length). ``key`` is the prefix key hash when there is one.
    The router fills ``strategy`` and ``duration_s`` (wall-clock cost of ``pick``).
    ``data_parallel_rank`` names the rank of a data-parallel backend the request should reach
    (the proxy sends it upstream as ``X-data-parallel-rank``); ``None`` lets the host decide
    (`kvroute.ranks.rank_for`) or leaves it to the engine.
    """

    backend: Backend
    reason: str = "picked"
    strategy: str = ""
    key: int | None = None
    spilled: bool = False
    detail: Mapping[str, Any] = attrs.field(factory=dict, hash=False)
    duration_s: float = 0.0
    #: Why a spilled decision left the key's first choice: a `SpillReason` value for the
    #: limits the in-repo strategies apply, any short word for a third party's own.
    spill_reason: SpillReason | str | None = None
    #: The data-parallel rank chosen within ``backend`` (``None``: no rank chosen).
    data_parallel_rank: int | None = None
    #: The latency the strategy (or the router's predictor) expects on ``backend`` (`kvroute.slo`).
    prediction: Prediction | None = attrs.field(default=None, hash=False)

    def explain(self) -> str:
        """One human-readable line: ``bounded-load -> b2 (spilled: concurrency_threshold)``, ``-> b2 rank 1 (...)``."""
        items = dict(self.detail)
        if self.spill_reason is not None:
            items.setdefault("spill_reason", str(self.spill_reason))
        extra = ", ".join(f"{k}={v}" for k, v in items.items())
        where = (
            self.backend.id if self.data_parallel_rank is None else f"{self.backend.id} rank {self.data_parallel_rank}"
        )
        return f"{self.strategy} -> {where} ({self.reason}{': ' + extra if extra else ''})"


#: What ``pick`` may return: a full `Decision`, or just the backend (or its state).
Pick = Decision | Backend | BackendState


@attrs.frozen
class Outcome:
    """How a routed request ended: ``ok``, ``error`` or ``cancelled``, and its duration."""

    status: Status = attrs.field(converter=Status)
    duration_s: float
    error: str | None = None


@runtime_checkable
class Strategy(Protocol):
    """What the router needs from a strategy. Subclass `BaseStrategy` for no-op callbacks."""

    def pick(self, request: RouteRequest, candidates: Sequence[BackendState]) -> Pick:
        """Choose one of ``candidates`` (never empty) for ``request``; no I/O, no blocking."""
        ...

    def on_request_start(self, request: RouteRequest, decision: Decision) -> None:
        """The request was sent to ``decision.backend`` (counted in flight)."""
        ...

    def on_request_finish(self, request: RouteRequest, decision: Decision, outcome: Outcome) -> None:
        """The request left ``decision.backend``."""
        ...

    def on_fleet_change(self, event: FleetEvent, members: Sequence[BackendState]) -> None:
        """Membership changed; ``members`` is every backend now in the fleet."""
        ...


@runtime_checkable
class HasPromptTokenizer(Protocol):
    """A strategy that tokenizes prompts as the engine does (the proxy then checks parity at startup)."""

    @property
    def prompt_tokenizer(self) -> Any:
        """The tokenizer it uses (``tokenize`` / ``chat`` methods; see kvroute_server.parity)."""
        ...


#: What a `Hold`'s key stands for: a strategy's prefix key, a conversation's or a session id's (`kvroute.sessions`),
#: or a conversation of a group (a system prompt) that started (``group``: the consistent-hash family's hot groups).
HoldKind = Literal["key", "conversation", "session", "group"]


@attrs.frozen(slots=True)
class Hold:
    """One replica's routing state for one key: requests of ``key`` go to ``backend_id`` (router-replica sync).

    ``age_s`` is how long ago the hold was made or last refreshed, as its sender saw it (replicas
    share no clock); a receiver dates it ``now - age_s``.
    """

    kind: HoldKind
    key: int
    backend_id: str
    age_s: float = 0.0


@runtime_checkable
class Holds(Protocol):
    """Optional strategy methods that let router replicas share where they sent keys (``kvroute serve --peer``).

    A strategy that remembers where a key went (a conversation's later turns follow its first) keeps
    that memory per process; replicas that never saw a key's first request place its later ones by
    their own state. With these methods the router hands each started request's holds to its host
    (`Router.holds`), which sends them to the other replicas, whose routers `adopt_holds` them.
    `kvroute.sessions.Sessions` has the same two methods for session and conversation bindings.
    """

    def holds_made(self, request: RouteRequest, decision: Decision) -> Sequence[Hold]:
        """The holds ``request`` made or refreshed by starting on ``decision.backend`` (under the router's lock)."""
        ...

    def adopt_holds(self, holds: Sequence[Hold]) -> Mapping[str, int]:
        """Take another replica's holds for keys this strategy does not hold; counts by result word."""
        ...


class BaseStrategy:
    """Convenience base class: the callbacks do nothing. Only ``pick`` must be written."""

    def pick(self, request: RouteRequest, candidates: Sequence[BackendState]) -> Pick:
        raise NotImplementedError

    def on_request_start(self, request: RouteRequest, decision: Decision) -> None:
        return None

    def on_request_finish(self, request: RouteRequest, decision: Decision, outcome: Outcome) -> None:
        return None

    def on_fleet_change(self, event: FleetEvent, members: Sequence[BackendState]) -> None:
        return None


#: Registered by plugins: called with the strategy's options as keyword arguments.
StrategyFactory = Callable[..., Strategy]


def _accepted_options(factory: StrategyFactory) -> list[str]:
    if isinstance(factory, type) and attrs.has(factory):
        return [a.alias or a.name for a in attrs.fields(factory) if a.init]
    import inspect

    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        return []
    return [p for p in params if p != "self"]


def build_strategy(name: str, factory: StrategyFactory, options: Mapping[str, Any] | None = None) -> Strategy:
    """Call ``factory(**options)`` and turn every option mistake into a `ConfigError`.

    Option names may use dashes or underscores (``prefix-length`` == ``prefix_length``).
    """
    opts = {k.replace("-", "_"): v for k, v in (options or {}).items()}
    accepted = _accepted_options(factory)
    unknown = sorted(set(opts) - set(accepted)) if accepted else []
    if unknown:
        raise ConfigError(
            f"strategy {name!r} has no option {', '.join(map(repr, unknown))} "
            f"(expected one of: {', '.join(accepted) or 'none'})."
        )
    try:
        strategy = factory(**opts)
    except ConfigError:
        raise
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"strategy {name!r}: {exc}") from None
    if not callable(getattr(strategy, "pick", None)):
        raise ConfigError(f"strategy {name!r}: its factory returned {type(strategy).__name__}, which has no pick().")
    return strategy
