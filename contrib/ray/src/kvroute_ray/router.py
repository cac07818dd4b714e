"""`KvrouteRequestRouter`: a kvroute strategy as a Ray Serve request router.

Ray Serve builds one request router per deployment handle (the HTTP proxy's, the ingress
deployment's, the driver's) and calls it on the handle's event loop:

* ``initialize_state(**request_router_kwargs)``: here ``strategy`` and ``options``, exactly what
  ``kvroute serve --strategy NAME --option k=v`` takes; the strategy is built at once;
* ``update_replicas`` / ``on_replica_actor_died``: the deployment's running replicas become the
  backends of a kvroute `Fleet` (backend id: the replica's unique id), so the strategy sees Ray's
  scale-outs, replacements and deaths as ordinary fleet changes and its movement guarantees hold;
* ``choose_replicas``: the request's text is read from its arguments (`kvroute_ray.requests`), the
  strategy picks a replica, and the answer is ranked tiers: the strategy's choice, then its next
  choices with the earlier ones excluded (``fallbacks`` of them), then every other replica. Ray
  takes the first tier with a replica under its ``max_ongoing_requests``;
* ``on_request_routed`` / ``on_request_completed``: the request counts in flight on the replica
  Ray actually sent it to (which a later tier may have given) from acceptance to completion.

A request whose arguments hold no readable prompt is counted (``stats.unparsed``) and goes to
the least-loaded replica. Ray's multiplexed models: replicas that have the request's model
loaded form the first tiers when there are any, and the model id keys the request as a LoRA
adapter does in ``kvroute serve``.

Ray ships this class to each routing process by value, so look routers up with
`kvroute_ray.registry.routers`, not through the class.

Use :func:`request_router_config` to build the deployment's ``RequestRouterConfig``: it builds
the strategy once, so a wrong name or option fails when the application is defined, not at its
first request.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import attrs
from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from kvroute import Backend, ConfigError, Decision, Fleet, Lease, PluginManager, Router, RouteRequest, Status
from kvroute.errors import KvrouteError
from kvroute.logs import get_logger
from kvroute_ray import registry
from kvroute_ray.requests import route_request

__all__ = ["KvrouteRequestRouter", "RouterStats", "request_router_config", "validate_kwargs"]

log = get_logger(__name__)

#: Requests chosen for but not yet accepted by a replica that are remembered (oldest dropped first).
_MAX_PENDING = 10_000


@attrs.define
class RouterStats:
    """What one router instance did (``KvrouteRequestRouter.stats``)."""

    #: Requests routed by the strategy (one per ``choose_replicas`` call with a readable prompt).
    decided: int = 0
    #: Requests whose arguments held no readable prompt: routed to the least-loaded replica.
    unparsed: int = 0
    #: Requests a replica accepted that were not on the strategy's first choice (a later tier).
    fallbacks: int = 0
    #: Requests accepted by a replica and not yet completed.
    in_flight: int = 0
    #: Requests completed (successfully or not) after being accepted.
    completed: int = 0
    #: Replicas removed because Ray reported their actor dead.
    replicas_died: int = 0


def validate_kwargs(kwargs: Mapping[str, Any], plugins: PluginManager | None = None) -> tuple[str, dict[str, Any], int]:
    """Check ``request_router_kwargs`` and build the strategy once: ``(strategy, options, fallbacks)``.

    Raises `ConfigError` with kvroute's usual message for an unknown key, a strategy that is not
    installed or a bad option.
    """
    unknown = sorted(set(kwargs) - {"strategy", "options", "fallbacks"})
    if unknown:
        raise ConfigError(
            f"KvrouteRequestRouter has no setting {', '.join(map(repr, unknown))} "
            "(expected: strategy, options, fallbacks)."
        )
    strategy = kwargs.get("strategy", "bounded-load")
    if not isinstance(strategy, str) or not strategy:
        raise ConfigError(f"'strategy' must be the name of an installed kvroute strategy (got {strategy!r}).")
    options = kwargs.get("options") or {}
    if not isinstance(options, Mapping):
        raise ConfigError(f"'options' must be a mapping of option names to values (got {type(options).__name__}).")
    fallbacks = kwargs.get("fallbacks", 2)
    if isinstance(fallbacks, bool) or not isinstance(fallbacks, int) or fallbacks < 0:
        raise ConfigError(f"'fallbacks' must be an integer >= 0 (got {fallbacks!r}).")
    (plugins or PluginManager()).create_strategy(strategy, dict(options))
    return strategy, dict(options), fallbacks


def request_router_config(
    strategy: str = "bounded-load",
    options: Mapping[str, Any] | None = None,
    *,
    fallbacks: int = 2,
    **ray_settings: Any,
) -> Any:
    """A ``ray.serve.config.RequestRouterConfig`` that routes with the kvroute strategy ``strategy``.

    ``options`` are the strategy's options; ``fallbacks`` how many of the strategy's next choices are
    ranked after its first before all other replicas; ``ray_settings`` go to ``RequestRouterConfig``
    as they are (``initial_backoff_s``...). Raises `ConfigError` now for a bad name or option.

    >>> @serve.deployment(request_router_config=request_router_config("bounded-load"))  # doctest: +SKIP
    """
    from ray.serve.config import RequestRouterConfig

    kwargs = {"strategy": strategy, "options": dict(options or {}), "fallbacks": fallbacks}
    validate_kwargs(kwargs)
    settings: dict[str, Any] = {"request_router_class": KvrouteRequestRouter, "request_router_kwargs": kwargs}
    return RequestRouterConfig(**settings, **ray_settings)


def _backend_id(replica_id: ReplicaID) -> str:
    return str(replica_id.unique_id)


class KvrouteRequestRouter(RequestRouter):
    """Ray Serve's ``RequestRouter`` running a kvroute strategy over the deployment's replicas."""

    def initialize_state(self, **kwargs: Any) -> None:
        strategy, options, fallbacks = validate_kwargs(kwargs)
        self.strategy_name = strategy
        self.fallback_count = fallbacks
        self.fleet = Fleet()
        self.kvroute = Router.create(self.fleet, strategy, options)
        self.stats = RouterStats()
        self._by_backend: dict[str, RunningReplica] = {}
        self._chosen: OrderedDict[str, tuple[RouteRequest, Decision]] = OrderedDict()
        self._leases: dict[str, Lease] = {}
        #: When choose_replicas last saw each waiting request (request-less rounds serve stale ones).
        self._asked_at: dict[str, float] = {}
        self.stale_after_s = 2.0
        registry.register(self)
        log.info("ray_router_ready", strategy=strategy, deployment=str(getattr(self, "_deployment_id", "")))

    # -- replicas --------------------------------------------------------------------------------

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        self.sync_replicas(replicas)

    def sync_replicas(self, replicas: Iterable[RunningReplica]) -> None:
        """Make the fleet hold exactly ``replicas`` (added in order; gone ones removed)."""
        wanted = {_backend_id(r.replica_id): r for r in replicas}
        with self.fleet.lock:
            for backend_id in [b.id for b in self.fleet.backends() if b.id not in wanted]:
                self._end_leases_on(backend_id, "replica removed")
                self.fleet.remove(backend_id)
            for backend_id, replica in wanted.items():
                if backend_id not in self.fleet:
                    self.fleet.add(Backend(id=backend_id, kind="ray", labels={"replica": str(replica.replica_id)}))
        self._by_backend = wanted

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        backend_id = _backend_id(replica_id)
        self._by_backend.pop(backend_id, None)
        with self.fleet.lock:
            if backend_id in self.fleet:
                self._end_leases_on(backend_id, "replica actor died")
                self.fleet.remove(backend_id)
                self.stats.replicas_died += 1
        log.warning("ray_replica_died", backend=backend_id)

    def _end_leases_on(self, backend_id: str, why: str) -> None:
        for request_id in [k for k, lease in self._leases.items() if lease.backend.id == backend_id]:
            self._release(request_id, Status.ERROR, why)

    # -- choosing --------------------------------------------------------------------------------

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        request = None
        if pending_request is not None:
            # The tiers below always hold every candidate: when none of them can take the request,
            # Ray must back off before asking again (without this it asks again at once, in a loop).
            pending_request.routing_context.should_backoff = True
            metadata = pending_request.metadata
            self._asked_at[metadata.internal_request_id] = time.monotonic()
            while len(self._asked_at) > _MAX_PENDING:
                self._asked_at.pop(next(iter(self._asked_at)))
            request = route_request(
                pending_request.args,
                pending_request.kwargs,
                request_id=getattr(metadata, "request_id", None),
                multiplexed_model_id=getattr(metadata, "multiplexed_model_id", None) or None,
                session_id=getattr(metadata, "session_id", None) or None,
            )
        if request is None:
            if pending_request is None:
                # Ray <= 2.55 also asks with no request when every waiting one is being routed, in a
                # loop that awaits nothing else: yield, so that the queue-length probes it waits on run.
                await asyncio.sleep(0)
            else:
                self.stats.unparsed += 1
            return self._by_load(candidate_replicas)
        model_id = getattr(pending_request.metadata, "multiplexed_model_id", "") if pending_request else ""
        groups: list[list[RunningReplica]] = [candidate_replicas]
        if model_id:
            loaded = [r for r in candidate_replicas if model_id in (r.multiplexed_model_ids or ())]
            if loaded and len(loaded) < len(candidate_replicas):
                groups = [loaded, [r for r in candidate_replicas if r not in loaded]]
        ranked: list[Decision] = []
        for group in groups:
            ranked.extend(self._rank(request, group))
        if not ranked:  # the fleet does not know these replicas yet
            return self._by_load(candidate_replicas)
        self.stats.decided += 1
        by_id = {_backend_id(r.replica_id): r for r in candidate_replicas}
        order = [d.backend.id for d in ranked]
        tiers = [[by_id[b]] for b in order[: self.fallback_count + 1]]
        rest = [by_id[b] for b in order[self.fallback_count + 1 :]]
        rest.extend(r for b, r in by_id.items() if b not in order)
        if rest:
            tiers.append(rest)
        internal_id = pending_request.metadata.internal_request_id if pending_request else ""
        if internal_id:
            self._chosen[internal_id] = (request, ranked[0])
            self._chosen.move_to_end(internal_id)
            while len(self._chosen) > _MAX_PENDING:
                self._chosen.popitem(last=False)
        return tiers

    def _rank(self, request: RouteRequest, group: Sequence[RunningReplica]) -> list[Decision]:
        """The strategy's decisions among ``group``, best first: up to ``fallbacks + 1`` of them."""
        allowed = {_backend_id(r.replica_id) for r in group}
        exclude = {b.id for b in self.fleet.backends() if b.id not in allowed}
        ranked: list[Decision] = []
        while len(ranked) <= self.fallback_count:
            try:
                decision, _ = self.kvroute.decide(request, exclude=exclude | {d.backend.id for d in ranked})
            except KvrouteError:  # NoBackendAvailable: every allowed replica is ranked already
                break
            ranked.append(decision)
        return ranked

    def _by_load(self, candidates: list[RunningReplica]) -> list[list[RunningReplica]]:
        """Least-loaded first, by this router's in-flight counts (ties keep Ray's order)."""

        def in_flight(replica: RunningReplica) -> int:
            backend_id = _backend_id(replica.replica_id)
            return self.fleet.in_flight(backend_id) if backend_id in self.fleet else 0

        ordered = sorted(candidates, key=in_flight)
        return [ordered[:1], ordered[1:]] if len(ordered) > 1 else [ordered]

    def _fulfill_next_pending_request(self, replica: RunningReplica, request_metadata: Any = None) -> None:
        """Give ``replica`` to the request it was chosen for; a request-less choice to the oldest waiting one.

        Ray's default matches the exact request, which is what a prefix choice needs. Ray <= 2.55 also
        runs request-less rounds (``request_metadata`` None), and its routing loop can drop a request it
        had taken for routing; the default then matches nothing and that request waits forever, so a
        request-less round here serves the oldest waiting request, as Ray's ``FIFOMixin`` does.
        """
        if request_metadata is not None:
            super()._fulfill_next_pending_request(replica, request_metadata)
            return
        # Only a request nobody routes any more: one asked about more than `stale_after_s` ago. A request
        # still being routed keeps its own choice (giving it this load-picked replica would misroute it).
        now = time.monotonic()
        for waiting in list(self._pending_requests_to_fulfill):
            if waiting.future.done():
                continue
            asked = self._asked_at.get(waiting.metadata.internal_request_id)
            if asked is not None and now - asked >= self.stale_after_s:
                waiting.future.set_result(replica)
                self._remove_pending_request_from_indices(waiting)
                self._asked_at.pop(waiting.metadata.internal_request_id, None)
                return

    # -- in flight -------------------------------------------------------------------------------

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        internal_id = pending_request.metadata.internal_request_id
        self._asked_at.pop(internal_id, None)
        chosen = self._chosen.pop(internal_id, None)
        backend_id = _backend_id(replica_id)
        if chosen is None or backend_id not in self.fleet or internal_id in self._leases:
            return
        request, first = chosen
        with self.fleet.lock:
            state = self.fleet.get(backend_id)
            decision = first
            if backend_id != first.backend.id:
                self.stats.fallbacks += 1
                decision = Decision(
                    state.backend,
                    reason="ray_fallback",
                    strategy=self.strategy_name,
                    detail={"first": first.backend.id},
                )
            self.fleet.request_started(state)
            lease = Lease(request, decision, state, time.monotonic())
            on_start = getattr(self.kvroute.strategy, "on_request_start", None)
            if on_start is not None:
                try:
                    on_start(request, decision)
                except Exception as exc:  # the request is already on its way: log, keep counting
                    log.exception("strategy_callback_failed", callback="on_request_start", error=str(exc))
        self._leases[internal_id] = lease
        self.stats.in_flight += 1

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        self._chosen.pop(internal_request_id, None)
        self._asked_at.pop(internal_request_id, None)
        self._release(internal_request_id, Status.OK, None)

    def _release(self, internal_id: str, status: Status, error: str | None) -> None:
        lease = self._leases.pop(internal_id, None)
        if lease is None:
            return
        self.kvroute.release(lease, status, error)
        self.stats.in_flight -= 1
        self.stats.completed += 1
