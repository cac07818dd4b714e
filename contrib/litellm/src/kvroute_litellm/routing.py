"""`KvrouteRouting`: a kvroute strategy as LiteLLM's custom routing strategy.

Why the custom routing strategy and not a routing plugin or a pre-call filter: LiteLLM's
``Router.register_plugin(CustomRoutingStrategyBase)`` hands the strategy the whole call
(messages, keyword arguments) and takes back one *deployment*, which is exactly kvroute's
decision. Its ``Router(plugins=[...])`` pipeline only narrows ``candidate_models`` by
provider model name, so it cannot choose between two deployments of the same model on
different servers, which is the whole point of prefix-aware routing.

What it does per call:

1. asks LiteLLM for the group's healthy deployments (``select(kind="healthy")``: cooldowns,
   context-window and tag checks stay LiteLLM's), and mirrors the whole group into a
   kvroute `Fleet` (one fleet and strategy instance per model group);
2. builds a `kvroute.RouteRequest` from the messages as ``kvroute serve`` would;
3. leases a backend from the kvroute `Router` (the request now counts in flight there),
   excluding deployments that are cooling down or already failed this call, and stamps the
   lease id into the call's metadata;
4. LiteLLM's success and failure callbacks (`LeaseCallbacks`) end the lease: when a
   non-streaming call returns, when a stream has been consumed, or when an attempt fails
   (the next retry then avoids that deployment). A lease no callback ends (a client that
   abandoned a stream) expires after ``lease_timeout`` seconds.
"""

from __future__ import annotations

import itertools
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

from litellm.integrations.custom_logger import CustomLogger
from litellm.types.router import CustomRoutingStrategyBase

from kvroute import ConfigError, Lease, NoBackendAvailable, PluginManager, Status
from kvroute.logs import get_logger
from kvroute_litellm.deployments import ModelGroup, deployment_id
from kvroute_litellm.requests import metadata_of, route_request

__all__ = ["DECISION_KEY", "FAILED_KEY", "LEASE_KEY", "KvrouteRouting", "LeaseCallbacks", "install"]

log = get_logger(__name__)

#: Metadata key holding the lease id of the attempt in progress.
LEASE_KEY = "kvroute_lease_id"
#: Metadata key holding the decision's one-line explanation (``consistent-hash -> d1 (hash)``).
DECISION_KEY = "kvroute_decision"
#: Metadata key listing deployment ids that failed this call (retries avoid them).
FAILED_KEY = "kvroute_failed_deployments"


def _pick_reserves() -> bool:
    """False inside LiteLLM's dry-run ``Router.select()``: a pick that makes no call holds no lease."""
    try:
        from litellm.router_strategy.least_busy import pick_reserves
    except ImportError:  # an older or newer LiteLLM without the flag: always lease (timeouts clean up)
        return True
    return bool(pick_reserves(True))


class LeaseCallbacks(CustomLogger):
    """LiteLLM callbacks that end kvroute leases when an attempt succeeds or fails.

    ``instance`` is public on purpose: LiteLLM de-duplicates custom loggers by class name and
    public attributes, and two integrations in one process must both stay registered.
    """

    def __init__(self, owner: KvrouteRouting) -> None:
        super().__init__()
        self._owner = owner
        self.instance = owner.instance

    async def async_log_success_event(self, kwargs: Any, response_obj: Any, start_time: Any, end_time: Any) -> None:
        self._owner.finish(kwargs, ok=True)

    async def async_log_failure_event(self, kwargs: Any, response_obj: Any, start_time: Any, end_time: Any) -> None:
        self._owner.finish(kwargs, ok=False)

    def log_success_event(self, kwargs: Any, response_obj: Any, start_time: Any, end_time: Any) -> None:
        self._owner.finish(kwargs, ok=True)

    def log_failure_event(self, kwargs: Any, response_obj: Any, start_time: Any, end_time: Any) -> None:
        self._owner.finish(kwargs, ok=False)


class KvrouteRouting(CustomRoutingStrategyBase):
    """Route a LiteLLM ``Router``'s calls with a kvroute strategy chosen by name.

    Build it with :func:`install` (or call :meth:`install` yourself). ``strategy`` and
    ``options`` are what ``kvroute serve --strategy NAME --option k=v`` takes; give the
    deployments the same ``model_info.id`` as the backend ids of a standalone ``kvroute
    serve`` and both send the same prefix to the same server.
    """

    def __init__(
        self,
        litellm_router: Any,
        strategy: str,
        options: Mapping[str, Any] | None = None,
        *,
        plugins: PluginManager | None = None,
        lease_timeout: float | None = 600.0,
    ) -> None:
        if lease_timeout is not None and not (isinstance(lease_timeout, int | float) and lease_timeout > 0):
            raise ConfigError(f"'lease_timeout' must be a number of seconds > 0 or None (got {lease_timeout!r}).")
        self.litellm_router = litellm_router
        self.strategy = strategy
        self.options = dict(options or {})
        self.plugins = plugins or PluginManager()
        self.plugins.create_strategy(strategy, self.options)  # a wrong name or option fails here, not per call
        self.lease_timeout = lease_timeout
        self.instance = uuid.uuid4().hex[:12]
        self.callbacks = LeaseCallbacks(self)
        self._groups: dict[str, ModelGroup] = {}
        self._leases: OrderedDict[str, tuple[ModelGroup, Lease]] = OrderedDict()
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._installed = False

    # -- lifecycle ---------------------------------------------------------------------

    def install(self) -> KvrouteRouting:
        """Register as the router's routing strategy and add the lease callbacks to LiteLLM."""
        import litellm

        register = getattr(self.litellm_router, "register_plugin", None)
        if register is None:
            raise ConfigError(
                "this LiteLLM Router has no register_plugin(); kvroute-litellm needs litellm>=1.110 "
                f"(got {getattr(litellm, 'version', 'an older version')})."
            )
        register(self)
        litellm.logging_callback_manager.add_litellm_callback(self.callbacks)
        self._installed = True
        return self

    def uninstall(self) -> None:
        """Remove the lease callbacks and end every open lease (the router keeps this strategy until
        its routing strategy is changed with ``apply``)."""
        import litellm

        litellm.logging_callback_manager.remove_callback_from_all_lists(self.callbacks)
        with self._lock:
            leases = list(self._leases.values())
            self._leases.clear()
        for group, lease in leases:
            group.router.release(lease, Status.CANCELLED, "uninstalled")
        self._installed = False

    # -- reading -----------------------------------------------------------------------

    @property
    def groups(self) -> Mapping[str, ModelGroup]:
        """The model groups seen so far, each with its kvroute ``fleet`` and ``router``."""
        return dict(self._groups)

    def in_flight(self) -> dict[str, int]:
        """Requests in flight per deployment id, as this process counts them."""
        return {s.id: s.in_flight for g in self._groups.values() for s in g.fleet}

    def open_leases(self) -> int:
        """How many attempts are leased and not yet ended by a callback."""
        with self._lock:
            return len(self._leases)

    # -- LiteLLM's routing interface ---------------------------------------------------

    async def async_get_available_deployment(  # type: ignore[override]
        self,
        model: str,
        messages: list[dict[str, Any]] | None = None,
        input: str | list[object] | None = None,
        specific_deployment: bool | None = False,
        request_kwargs: dict[str, Any] | None = None,
    ) -> Mapping[str, Any]:
        kwargs = request_kwargs if request_kwargs is not None else {}
        healthy = await self.litellm_router.select(
            model, kwargs, kind="healthy", messages=messages, input=input, specific_deployment=specific_deployment
        )
        if isinstance(healthy, Mapping):  # a specific deployment was asked for by id
            return healthy
        return self._choose(model, messages, input, kwargs, list(healthy or ()))

    def get_available_deployment(  # type: ignore[override]
        self,
        model: str,
        messages: list[dict[str, Any]] | None = None,
        input: str | list[object] | None = None,
        specific_deployment: bool | None = False,
        request_kwargs: dict[str, Any] | None = None,
    ) -> Mapping[str, Any]:
        """The sync path (``Router.completion``): the group minus deployments in cooldown."""
        kwargs = request_kwargs if request_kwargs is not None else {}
        group = list(self.litellm_router.registry().deployments(model, source="group") or ())
        ids = [deployment_id(d) for d in group]
        cooldowns = self.litellm_router.health().cooldowns  # a property of LiteLLM's health view
        cooling = {item[0] for item in cooldowns.get_active_cooldowns(ids, None)}
        healthy = [d for d, i in zip(group, ids, strict=True) if i not in cooling]
        return self._choose(model, messages, input, kwargs, healthy)

    # -- deciding ----------------------------------------------------------------------

    def _group_for(self, name: str, healthy: Sequence[Mapping[str, Any]]) -> ModelGroup:
        group = self._groups.get(name)
        if group is None:
            group = self._groups[name] = ModelGroup.create(name, self.plugins, self.strategy, self.options)
        members = list(self.litellm_router.registry().deployments(name, source="group") or ())
        known = {deployment_id(d) for d in members}
        members.extend(d for d in healthy if deployment_id(d) not in known)
        group.sync(members)
        return group

    def _choose(
        self,
        model: str,
        messages: Sequence[Mapping[str, Any]] | None,
        input: object,
        kwargs: dict[str, Any],
        healthy: list[Mapping[str, Any]],
    ) -> Mapping[str, Any]:
        self._expire()
        if not healthy:
            raise NoBackendAvailable(
                f"no LiteLLM deployment of model group {model!r} can take the call "
                "(none configured, or all cooling down after failures)."
            )
        group_name = str(healthy[0].get("model_name") or model)
        group = self._group_for(group_name, healthy)
        by_id = {deployment_id(d): d for d in healthy}
        request = route_request(model, messages, input, kwargs)
        metadata = metadata_of(kwargs)
        failed = {str(i) for i in (metadata or {}).get(FAILED_KEY, ()) if str(i) in by_id}
        cooling = [b.id for b in group.fleet.backends() if b.id not in by_id]
        reserve = _pick_reserves()
        for exclude in ([*cooling, *failed], cooling) if failed else (cooling,):
            try:
                if not reserve:
                    decision, _ = group.router.decide(request, exclude=exclude)
                    return by_id[decision.backend.id]
                lease = group.router.acquire(request, exclude=exclude)
                break
            except NoBackendAvailable:
                if exclude is cooling:
                    raise
                # Every healthy deployment already failed this call: retry among all of them.
        if metadata is None:
            metadata = kwargs["metadata"] = {}
        lease_id = f"{self.instance}-{next(self._ids)}"
        with self._lock:
            self._leases[lease_id] = (group, lease)
        metadata[LEASE_KEY] = lease_id
        metadata[DECISION_KEY] = lease.decision.explain()
        return by_id[lease.backend.id]

    # -- ending leases -----------------------------------------------------------------

    def finish(self, kwargs: Mapping[str, Any], *, ok: bool) -> None:
        """End the lease a LiteLLM callback's ``kwargs`` refer to; unknown or ended leases are ignored."""
        params = kwargs.get("litellm_params")
        sources = [params.get("metadata"), params.get("litellm_metadata")] if isinstance(params, Mapping) else []
        sources.append(metadata_of(kwargs))
        for metadata in sources:
            if not isinstance(metadata, dict):
                continue
            lease_id = metadata.get(LEASE_KEY)
            if not isinstance(lease_id, str):
                continue
            with self._lock:
                entry = self._leases.pop(lease_id, None)
            if entry is None:
                continue
            group, lease = entry
            if ok:
                group.router.release(lease)
            else:
                error = kwargs.get("exception")
                group.router.release(lease, Status.ERROR, f"{type(error).__name__}: {error}" if error else "failed")
                failed = metadata.setdefault(FAILED_KEY, [])
                if isinstance(failed, list) and lease.backend.id not in failed:
                    failed.append(lease.backend.id)
            return

    def _expire(self) -> None:
        """End leases older than ``lease_timeout`` (no callback came: an abandoned stream)."""
        if self.lease_timeout is None:
            return
        deadline = time.monotonic() - self.lease_timeout
        expired: list[tuple[ModelGroup, Lease]] = []
        with self._lock:
            while self._leases:
                lease_id, (group, lease) = next(iter(self._leases.items()))
                if lease.started_at > deadline:
                    break
                del self._leases[lease_id]
                expired.append((group, lease))
        for group, lease in expired:
            log.warning("lease_expired", backend=lease.backend.id, timeout_s=self.lease_timeout)
            group.router.release(lease, Status.CANCELLED, "lease_timeout")


def install(
    litellm_router: Any,
    strategy: str,
    options: Mapping[str, Any] | None = None,
    *,
    plugins: PluginManager | None = None,
    lease_timeout: float | None = 600.0,
) -> KvrouteRouting:
    """Make ``litellm_router`` pick deployments with the kvroute strategy ``strategy``.

    >>> routing = install(router, "consistent-hash", {"prefix_length": 2048})  # doctest: +SKIP
    >>> await router.acompletion(model="llama", messages=[...])                # doctest: +SKIP
    """
    return KvrouteRouting(litellm_router, strategy, options, plugins=plugins, lease_timeout=lease_timeout).install()
