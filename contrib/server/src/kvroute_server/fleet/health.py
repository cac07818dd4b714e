"""Active health probes, passive ejection, model discovery and load polling, per backend adapter.

Each round probes every backend concurrently through its adapter (``probe`` when it `Probes`,
else ``GET health_path``). ``unhealthy_threshold`` consecutive failures eject a backend
(``Fleet.set_healthy(id, False)``, so strategies see it); ``healthy_threshold`` consecutive
successes bring it back. A healthy backend whose adapter `ListsModels` and that declares no
models is asked for them until it answers (stored with ``Fleet.set_served_models``, so routing
filters on them); one that `PollsLoad` is asked for its load every round. The capabilities are
the protocols of `kvroute.adapters`, checked with ``isinstance``.

Outlier detection (`kvroute_server.fleet.outliers`) ejects through the same ``Fleet.set_healthy``,
counted and logged the same way with its own causes; a backend it holds out is not brought back by
passing health probes, only by its own probe request once the back-off is over. It needs the
probes' loop, so it is off when probing is.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable

import anyio
import attrs
import structlog
from anyio.abc import TaskStatus

from kvroute.adapters import BackendAdapter, HttpGetter, ListsModels, PollsLoad, Probes
from kvroute.backend import EngineLoad
from kvroute.errors import UnknownBackend
from kvroute.fleet import Fleet
from kvroute_server.config import HealthConfig, OutlierConfig, TimeoutConfig
from kvroute_server.fleet.adapter_http import BackendHttp
from kvroute_server.fleet.outliers import OutlierDetector
from kvroute_server.http.sse import ends_with_done, first_data_event, is_json_object
from kvroute_server.ops.metrics import ProxyMetrics

__all__ = ["HealthChecker"]

log = structlog.get_logger(__name__)

_PROBE_ERRORS = (OSError, TimeoutError, ValueError)
#: The outlier probe: the smallest completion an OpenAI-compatible engine answers.
PROBE_PATH = "/v1/chat/completions"


@attrs.define
class _Counts:
    failures: int = 0
    successes: int = 0
    models_known: bool = False


class HealthChecker:
    """Keeps ``Fleet`` health and served models in step with probes and with errors seen while proxying.

    ``adapter_for(id)`` is a backend's adapter (``None`` once removed); ``http_for(id)`` its client.
    """

    def __init__(
        self,
        fleet: Fleet,
        adapter_for: Callable[[str], BackendAdapter | None],
        http_for: Callable[[str], HttpGetter],
        config: HealthConfig,
        metrics: ProxyMetrics,
    ) -> None:
        self.fleet = fleet
        self.adapter_for = adapter_for
        self.http_for = http_for
        self.config = config
        self.metrics = metrics
        self._counts: dict[str, _Counts] = {}
        self._wake = anyio.Event()
        self.rounds = 0
        #: Set once the first round is over (the proxy's tokenizer parity check waits for it).
        self.first_round = anyio.Event()
        #: Judges attempts' outcomes (the forwarder reports them); `OutlierDetector.configure` sets its settings.
        self.outliers = OutlierDetector(
            OutlierConfig(),
            TimeoutConfig(),
            eject=self._eject_outlier,
            restore=self._restore_outlier,
            probe=self._probe_request,
            fleet_ids=lambda: [state.id for state in self.fleet],
        )

    def _count(self, backend_id: str) -> _Counts:
        counts = self._counts.get(backend_id)
        if counts is None:
            counts = self._counts[backend_id] = _Counts()
        return counts

    def forget(self, backend_id: str) -> None:
        """Drop what is known about a removed backend."""
        self._counts.pop(backend_id, None)
        self.outliers.forget(backend_id)

    def wake(self) -> None:
        """Start the next round now (after a backend was added)."""
        self._wake.set()

    # -- passive ----------------------------------------------------------------------

    def connection_failed(self, backend_id: str, error: str) -> None:
        """A proxied request could not reach the backend: eject it until probes pass again."""
        if not (self.config.enabled and self.config.passive_ejection):
            return
        counts = self._count(backend_id)
        counts.successes = 0
        counts.failures = max(counts.failures, self.config.unhealthy_threshold)
        self._set(backend_id, False, "passive", error)

    def _eject_outlier(self, backend_id: str, cause: str, message: str) -> bool:
        """Eject an outlier (`OutlierDetector`); refused when probes are off (nothing would probe it back).

        One already out (a failed probe, a connection error) is counted and logged under the outlier's cause
        too: from now on its probe request, not passing health probes, brings it back.
        """
        if not self.config.enabled or backend_id not in self.fleet:
            return False
        if self.fleet.get(backend_id).healthy:
            self._set(backend_id, False, cause, message)
        else:
            self.metrics.ejections.labels(backend_id, cause).inc()
            log.warning("backend_ejected", backend=backend_id, cause=cause, error=message, already_out=True)
        return True

    def _restore_outlier(self, backend_id: str) -> None:
        """An outlier's probe request succeeded: back in rotation unless its health probes are failing."""
        if self._count(backend_id).failures < self.config.unhealthy_threshold:
            self._set(backend_id, True, "outlier_probe")

    async def _probe_request(self, backend_id: str, model: str | None, seconds: float) -> float | None:
        """Two small completions (``max_tokens`` 1), whole then streamed: the first must answer 200 with a JSON
        object, the second 200 with a data event first and ``data: [DONE]`` last. Returns the seconds the whole
        one took (the detector compares them with the fleet's), None when either failed."""
        if backend_id not in self.fleet:
            return None
        state = self.fleet.get(backend_id)
        model = model or next(iter(sorted(state.models)), None) or "default"
        http = self.http_for(backend_id)
        if not isinstance(http, BackendHttp):
            return None
        http = http.with_timeout(seconds)
        took: float | None = None
        for stream in (False, True):
            body = {
                "model": model,
                "messages": [{"role": "user", "content": "ping"}],
                "max_tokens": 1,
                "stream": stream,
            }
            started = time.monotonic()
            try:
                with anyio.fail_after(seconds):
                    reply = await http.post(PROBE_PATH, body)
            except _PROBE_ERRORS as exc:
                log.info("outlier_probe_error", backend=backend_id, stream=stream, error=f"{type(exc).__name__}: {exc}")
                return None
            took = took if took is not None else time.monotonic() - started
            text = reply.body
            good = bool(first_data_event(text)) and ends_with_done(text) if stream else is_json_object(text)
            if reply.status != 200 or not good:
                return None
        return took

    def _set(self, backend_id: str, healthy: bool, cause: str, error: str | None = None) -> None:
        try:
            event = self.fleet.set_healthy(backend_id, healthy)
        except UnknownBackend:
            return
        if event is None:
            return
        if healthy:
            self.metrics.restorations.labels(backend_id).inc()
            log.warning("backend_restored", backend=backend_id)
        else:
            self.metrics.ejections.labels(backend_id, cause).inc()
            log.warning("backend_ejected", backend=backend_id, cause=cause, error=error)

    # -- active -----------------------------------------------------------------------

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Probe forever, and probe outliers back when their back-off is over (cancel the task group to stop)."""
        async with anyio.create_task_group() as tg:
            await tg.start(self.outliers.run)
            task_status.started()
            while True:
                await self.probe_all()
                with anyio.move_on_after(self.config.interval):
                    await self._wake.wait()
                self._wake = anyio.Event()

    async def probe_all(self) -> None:
        """One round: probe every backend concurrently."""
        async with anyio.create_task_group() as tg:
            for state in self.fleet:
                tg.start_soon(self.check, state.id)
        self.rounds += 1
        self.first_round.set()

    async def check(self, backend_id: str) -> bool:
        """Probe one backend and apply the thresholds; returns the probe's result."""
        adapter = self.adapter_for(backend_id)
        if adapter is None:
            return False
        http = self.http_for(backend_id)
        error: str | None = None
        try:
            with anyio.fail_after(self.config.timeout):
                if isinstance(adapter, Probes):
                    ok = bool(await adapter.probe(http))
                else:
                    ok = (await http.get(adapter.health_path)).status == 200
        except _PROBE_ERRORS as exc:
            ok, error = False, f"{type(exc).__name__}: {exc}"
        counts = self._count(backend_id)
        if ok:
            counts.successes += 1
            counts.failures = 0
            if counts.successes >= self.config.healthy_threshold and not self.outliers.holds(backend_id):
                self._set(backend_id, True, "probe")
            await self._after_success(backend_id, adapter, http, counts)
        else:
            counts.failures += 1
            counts.successes = 0
            if counts.failures >= self.config.unhealthy_threshold:
                self._set(backend_id, False, "probe", error or "probe answered not ready")
        return ok

    async def _after_success(self, backend_id: str, adapter: BackendAdapter, http: HttpGetter, counts: _Counts) -> None:
        # Declared models are the operator's word: the engine is not asked for its own.
        discover = self.config.discover_models and not counts.models_known and not adapter.backend.models
        if discover and isinstance(adapter, ListsModels):
            try:
                with anyio.fail_after(self.config.timeout):
                    models = list(await adapter.list_models(http))
            except _PROBE_ERRORS as exc:
                log.info("models_discovery_failed", backend=backend_id, error=f"{type(exc).__name__}: {exc}")
            else:
                counts.models_known = True
                with contextlib.suppress(UnknownBackend):
                    self.fleet.set_served_models(backend_id, models)
        if isinstance(adapter, PollsLoad):
            try:
                with anyio.fail_after(self.config.timeout):
                    load = await adapter.poll_load(http)
            except _PROBE_ERRORS as exc:
                log.info("load_poll_failed", backend=backend_id, error=f"{type(exc).__name__}: {exc}")
                return
            if isinstance(load, EngineLoad):
                with contextlib.suppress(UnknownBackend):
                    self.fleet.update_load(backend_id, load)
