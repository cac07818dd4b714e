"""Predicted time to first token (TTFT) and time per output token (TPOT) per backend, learned online.

No I/O: the host feeds it. The `Router` (built with ``predictor=``) tells it where each request
went (`Predictor.started`) and when the request left (`Predictor.forget`); the host reports what
it measured with `Predictor.observe` (TTFT at the first token, TPOT at the end), before it
releases the lease.

The model, per backend::

    TTFT = ttft_overhead_s + (queued prefill tokens ahead + uncached prompt tokens) / prefill rate
    TPOT = decode_step_s * (1 + decode_load_weight * requests decoding alongside) [/ (1 - prefill share)]

*Queued prefill tokens ahead* is the larger of two estimates: the uncached prompt tokens of
requests this router sent there that have not produced a first token yet (in-flight accounting),
and the engine's reported ``waiting`` requests times the backend's typical (median) uncached prompt (the
engine also counts other routers' requests). A data-parallel backend prefills on its ranks side
by side: the queue of the rank the decision names (`EngineLoad.ranks`) counts when the engine
reports one, else the backend's queue spread over its ranks. *Requests decoding alongside* are the
engine's ``running`` when reported, else the router's in-flight count. The engine's ``kv_usage`` is
not used: a full cache delays new requests only as the waiting queue already shows.

With ``prefill_slows_decode=True`` (off by default: in the simulator it lowered goodput at every
load), TPOT is also divided by ``1 - prefill share``, the share of the backend's time its prefills
are expected to take while the request decodes (an engine mixing prefill chunks into decode steps,
as vLLM's chunked prefill does, slows every decoding request by that much): the uncached tokens
this router sent there over the last ``arrival_window_s`` seconds, per second, over its prefill rate, at most 0.95.

The *prefill rate* (tokens/s) and the *decode step* (s) are learned per backend, so backends on
different hardware get rates of their own: every observed TTFT gives a rate sample ``work /
(TTFT - ttft_overhead_s)`` (``work`` as counted when the request was sent, its uncached part
corrected by the engine's reported cached tokens when the host passes them), every observed TPOT a
decode-step sample. A backend's rate is the median of its last ``window`` samples, so a few wild
samples (a stalled stream, a preempted request) do not move it; until ``min_samples`` are in, the
configured `Priors` hold. A backend whose engine telemetry is stale (reported once, now older than
`BackendState.load_max_age`) is predicted from the priors alone, its engine load ignored, and the
prediction says so (`Prediction.stale`).

Prediction error is tracked (`PredictionErrors`): each observed TTFT next to what was predicted
when the request was sent, for the host to export.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from typing import NamedTuple

import attrs
from attrs import validators as v

from kvroute.backend import BackendState
from kvroute.slo import Prediction
from kvroute.validators import expect

__all__ = ["Base", "Observation", "PredictionErrors", "Predictor", "Priors"]

_positive = expect("a positive number", v.instance_of((int, float)), v.gt(0), v.lt(math.inf), error=ValueError)
_non_negative = expect("a non-negative number", v.instance_of((int, float)), v.ge(0), v.lt(math.inf), error=ValueError)


@attrs.frozen(kw_only=True)
class Priors:
    """What a backend is assumed to do before it has been observed (and while its telemetry is stale).

    The defaults are a mid-size model on one modern GPU; set them from a benchmark of the
    engines (``kvroute simulate`` prints the simulated fleet's in docs/simulation.md).
    """

    #: Prompt tokens the backend prefills per second.
    prefill_tokens_per_s: float = attrs.field(default=10_000.0, validator=_positive)
    #: Seconds a request spends before its first token even with nothing to prefill (scheduling, one step).
    ttft_overhead_s: float = attrs.field(default=0.02, validator=_non_negative)
    #: Seconds per output token of a request decoding alone.
    decode_step_s: float = attrs.field(default=0.02, validator=_positive)
    #: Each request decoding alongside adds this share of ``decode_step_s`` to a step.
    decode_load_weight: float = attrs.field(default=0.02, validator=_non_negative)
    #: Uncached prompt tokens assumed per waiting request until some have been seen.
    uncached_tokens: float = attrs.field(default=1000.0, validator=_positive)


@attrs.frozen
class Observation:
    """One observed request next to its prediction: what `Predictor.observe` returns for the host to export."""

    backend_id: str
    predicted: Prediction
    ttft_s: float | None = None
    tpot_s: float | None = None

    @property
    def ttft_error_s(self) -> float | None:
        """Observed minus predicted TTFT (positive: slower than predicted); ``None`` when no TTFT was observed."""
        return None if self.ttft_s is None else self.ttft_s - self.predicted.ttft_s


class PredictionErrors:
    """The last ``size`` observed TTFTs next to their predictions, and summaries of the error."""

    def __init__(self, size: int = 1024) -> None:
        self._pairs: deque[tuple[float, float]] = deque(maxlen=size)
        #: Observed TTFTs ever recorded.
        self.count = 0

    def record(self, predicted_s: float, observed_s: float) -> None:
        """Add one (predicted, observed) TTFT pair."""
        self._pairs.append((predicted_s, observed_s))
        self.count += 1

    @property
    def pairs(self) -> tuple[tuple[float, float], ...]:
        """The recent (predicted, observed) TTFT pairs, oldest first."""
        return tuple(self._pairs)

    def median_abs_error_s(self) -> float | None:
        """Median of ``|observed - predicted|`` over the recent pairs (``None`` before any)."""
        if not self._pairs:
            return None
        return _median(abs(o - p) for p, o in self._pairs)

    def within(self, share: float = 0.25) -> float | None:
        """Share of recent pairs whose prediction was within ``share`` of the observed TTFT (``None`` before any)."""
        if not self._pairs:
            return None
        return sum(abs(o - p) <= share * o for p, o in self._pairs) / len(self._pairs)


class Base(NamedTuple):
    """The request-independent part of a backend's prediction (`Predictor.base`).

    A request with ``u`` uncached prompt tokens is predicted ``Prediction(ttft_s + u * s_per_token,
    tpot_s, stale)`` there.
    """

    #: Predicted TTFT of a request with nothing to prefill (overhead and the queue ahead).
    ttft_s: float
    #: Seconds each uncached prompt token adds (one over the prefill rate).
    s_per_token: float
    tpot_s: float
    stale: bool


@attrs.define
class _Rates:
    """One backend's learned rates: a window of samples each, the median once there are enough."""

    prefill: deque[float]
    decode: deque[float]
    uncached: deque[float]
    #: Uncached prompt tokens of this router's requests sent here that have no first token yet.
    queued_tokens: float = 0.0
    queued_requests: int = 0
    #: Uncached tokens sent here, decayed with time constant ``arrival_window_s``, and when last decayed.
    arrived: float = 0.0
    arrived_at: float = 0.0
    #: The medians, once each window holds ``min_samples`` (``None`` before): kept, not recomputed per prediction.
    prefill_rate: float | None = None
    decode_step: float | None = None
    mean_uncached: float | None = None


@attrs.define
class _Pending:
    backend_id: str
    work: float
    uncached: float
    prompt: float
    decode_load: float
    predicted: Prediction
    slowdown: float = 1.0
    queued: bool = True


class Predictor:
    """Predicts TTFT and TPOT per backend from in-flight accounting, engine load and rates learned per backend.

    ``priors`` hold for every backend, ``overrides`` (backend id -> `Priors`) for the named ones
    (mixed hardware). ``window`` samples are kept per backend and rate; ``min_samples`` must be in
    before the learned median replaces the prior. Not thread-safe: the `Router` calls it under its
    fleet's lock; a host calling `observe` from elsewhere takes ``router.fleet.lock``.
    """

    def __init__(
        self,
        priors: Priors | None = None,
        *,
        overrides: Mapping[str, Priors] | None = None,
        window: int = 64,
        min_samples: int = 3,
        arrival_window_s: float = 10.0,
        prefill_slows_decode: bool = False,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not isinstance(window, int) or isinstance(window, bool) or not 1 <= window <= 4096:
            raise ValueError(f"'window' must be an integer from 1 to 4096 (got {window!r}).")
        if not isinstance(min_samples, int) or isinstance(min_samples, bool) or not 1 <= min_samples <= window:
            raise ValueError(f"'min_samples' must be an integer from 1 to window={window} (got {min_samples!r}).")
        if (
            isinstance(arrival_window_s, bool)
            or not isinstance(arrival_window_s, int | float)
            or not (0 < arrival_window_s < math.inf)
        ):
            raise ValueError(f"'arrival_window_s' must be a positive number of seconds (got {arrival_window_s!r}).")
        self.arrival_window_s = float(arrival_window_s)
        #: Whether TPOT includes the prefill share's slowdown (engines mixing prefill chunks into decode steps).
        self.prefill_slows_decode = bool(prefill_slows_decode)
        #: The clock of the prefill share's window (a simulator passes its virtual time).
        self.clock = clock
        self.priors = priors or Priors()
        self.overrides = dict(overrides or {})
        self.window = window
        self.min_samples = min_samples
        self.errors = PredictionErrors()
        self._rates: dict[str, _Rates] = {}
        self._pending: dict[str, _Pending] = {}
        #: `base` per backend id, with what it was computed from: (engine load, in flight, valid until, base).
        self._bases: dict[str, tuple[object, int, float, Base]] = {}

    # -- rates ---------------------------------------------------------------------------

    def priors_for(self, backend_id: str) -> Priors:
        """The priors of ``backend_id``: its override, else the shared ones."""
        return self.overrides.get(backend_id, self.priors)

    def _state(self, backend_id: str) -> _Rates:
        rates = self._rates.get(backend_id)
        if rates is None:
            n = self.window
            rates = self._rates[backend_id] = _Rates(deque(maxlen=n), deque(maxlen=n), deque(maxlen=n))
        return rates

    def _window_median(self, samples: deque[float]) -> float | None:
        return _median(samples) if len(samples) >= self.min_samples else None

    def prefill_rate(self, backend_id: str) -> float:
        """Prompt tokens per second ``backend_id`` prefills: learned, or its prior."""
        rates = self._rates.get(backend_id)
        learned = None if rates is None else rates.prefill_rate
        return self.priors_for(backend_id).prefill_tokens_per_s if learned is None else learned

    def decode_step(self, backend_id: str) -> float:
        """Seconds per output token of a request decoding alone on ``backend_id``: learned, or its prior."""
        rates = self._rates.get(backend_id)
        learned = None if rates is None else rates.decode_step
        return self.priors_for(backend_id).decode_step_s if learned is None else learned

    def samples(self, backend_id: str) -> int:
        """TTFT samples ``backend_id``'s prefill rate rests on (at most ``window``)."""
        rates = self._rates.get(backend_id)
        return 0 if rates is None else len(rates.prefill)

    # -- predicting ----------------------------------------------------------------------

    def _load(self, state: BackendState, rank: int | None, now: float | None) -> tuple[float, float, bool]:
        """(queued prefill tokens ahead, requests decoding alongside, stale) for ``state``."""
        rates = self._rates.get(state.id)
        if rates is None:
            ours, decoding = 0.0, float(state.in_flight)
        else:
            ours = rates.queued_tokens
            decoding = float(max(state.in_flight - rates.queued_requests, 0))
        load = state.load
        size = state.backend.data_parallel_size
        if load is not None and load.data_parallel_size is not None and load.data_parallel_size > size:
            size = load.data_parallel_size
        if load is None or (time.monotonic() if now is None else now) - load.observed_at > state.load_max_age:
            if size > 1:
                return ours / size, decoding / size, load is not None
            return ours, decoding, load is not None
        waiting, running = load.waiting, load.running
        if rank is not None and load.ranks:
            # The named rank's own queue; this router's requests assumed spread over the ranks.
            for r in load.ranks:
                if r.rank == rank:
                    waiting, running = r.waiting, r.running
                    break
            ours /= size
            size = 1
        if waiting is not None:
            mean = None if rates is None else rates.mean_uncached
            if mean is None:
                mean = self.overrides.get(state.id, self.priors).uncached_tokens
            if waiting * mean > ours:
                ours = waiting * mean
        if size > 1:
            ours /= size  # ranks prefill side by side
        if running is not None:
            decoding = running / size
        return ours, decoding, False

    def predict(
        self,
        state: BackendState,
        uncached_tokens: float,
        *,
        rank: int | None = None,
        now: float | None = None,
    ) -> Prediction:
        """What a request with ``uncached_tokens`` prompt tokens not in ``state``'s cache would get there.

        ``rank`` names the data-parallel rank it would reach, if chosen; ``now`` is a
        ``time.monotonic()`` reading (the engine load's clock) for the staleness check.
        """
        queued, decoding, stale = self._load(state, rank, now)
        return self._predict(state.id, queued, max(uncached_tokens, 0.0), decoding, stale)

    def _slowdown(self, rates: _Rates | None, rate: float) -> float:
        """``1 / (1 - prefill share)`` of a backend (see the module docstring)."""
        if rates is None or not rates.arrived or not self.prefill_slows_decode:
            return 1.0
        age = self.clock() - rates.arrived_at
        arrived = rates.arrived * math.exp(-age / self.arrival_window_s) if age > 0 else rates.arrived
        share = min(arrived / self.arrival_window_s / rate, 0.95)
        return 1.0 / (1.0 - share)

    def prefill_share(self, backend_id: str) -> float:
        """The share of ``backend_id``'s time its recent prefills take (see the module docstring)."""
        return 1.0 - 1.0 / self._slowdown(self._rates.get(backend_id), self.prefill_rate(backend_id))

    def _predict(self, backend_id: str, queued: float, uncached: float, decoding: float, stale: bool) -> Prediction:
        priors = self.overrides.get(backend_id, self.priors)
        rate, step = priors.prefill_tokens_per_s, priors.decode_step_s
        rates = None if stale else self._rates.get(backend_id)
        if rates is not None:
            if rates.prefill_rate is not None:
                rate = rates.prefill_rate
            if rates.decode_step is not None:
                step = rates.decode_step
        ttft = priors.ttft_overhead_s + (queued + uncached) / rate
        tpot = step * (1.0 + priors.decode_load_weight * decoding) * self._slowdown(rates, rate)
        return Prediction(ttft, tpot, stale)

    def base(self, state: BackendState, now: float | None = None) -> Base:
        """The request-independent part of `predict` on ``state`` (no rank named), kept until it changes.

        ``predict(state, u, now=now)`` is ``Prediction(b.ttft_s + u * b.s_per_token, b.tpot_s, b.stale)``
        for ``b = base(state, now)`` (TTFT is linear in the uncached tokens). A backend's base is
        computed once and kept while its in-flight count and engine load (the same object) are
        unchanged, its load has not grown stale, and this predictor has not counted, released or
        observed a request there: a choice among many candidates then costs a lookup per candidate.
        With ``prefill_slows_decode`` (TPOT changes with time) it is computed on every call. Call
        `invalidate` after changing ``priors`` or ``overrides``.
        """
        if now is None:
            now = time.monotonic()
        load = state.load
        kept = self._bases.get(state.backend.id)
        if kept is not None and kept[0] is load and kept[1] == state.in_flight and now <= kept[2]:
            return kept[3]
        backend_id = state.backend.id
        queued, decoding, stale = self._load(state, None, now)
        at_zero = self._predict(backend_id, queued, 0.0, decoding, stale)
        rate = self.overrides.get(backend_id, self.priors).prefill_tokens_per_s
        rates = None if stale else self._rates.get(backend_id)
        if rates is not None and rates.prefill_rate is not None:
            rate = rates.prefill_rate
        base = Base(at_zero.ttft_s, 1.0 / rate, at_zero.tpot_s or 0.0, stale)
        if not self.prefill_slows_decode:
            until = math.inf if load is None or stale else load.observed_at + state.load_max_age
            self._bases[backend_id] = (load, state.in_flight, until, base)
        return base

    def invalidate(self) -> None:
        """Forget every kept `base` (after changing ``priors`` or ``overrides``)."""
        self._bases.clear()

    # -- accounting (the router) ---------------------------------------------------------

    def started(
        self,
        request_id: str,
        state: BackendState,
        prompt_tokens: float,
        uncached_tokens: float,
        *,
        rank: int | None = None,
        prediction: Prediction | None = None,
        now: float | None = None,
    ) -> Prediction:
        """The request was sent to ``state``: queue its uncached tokens there; returns its prediction.

        Called by the router before ``state``'s in-flight count rises. A request id already
        pending is replaced (a retry on another backend).
        """
        self.forget(request_id)
        queued, decoding, stale = self._load(state, rank, now)
        uncached = max(uncached_tokens, 0.0)
        if prediction is None:
            prediction = self._predict(state.id, queued, uncached, decoding, stale)
        rates = self._state(state.id)
        self._bases.pop(state.id, None)
        rates.queued_tokens += uncached
        rates.queued_requests += 1
        slowdown = self._slowdown(rates, self.prefill_rate(state.id))
        at = self.clock()
        age = at - rates.arrived_at
        rates.arrived = (
            rates.arrived * math.exp(-age / self.arrival_window_s) if age > 0 else rates.arrived
        ) + uncached
        rates.arrived_at = at
        self._pending[request_id] = _Pending(
            state.id, queued + uncached, uncached, float(prompt_tokens), decoding, prediction, slowdown
        )
        return prediction

    def _unqueue(self, pending: _Pending) -> None:
        if not pending.queued:
            return
        pending.queued = False
        rates = self._rates.get(pending.backend_id)
        self._bases.pop(pending.backend_id, None)
        if rates is not None:
            rates.queued_tokens = max(rates.queued_tokens - pending.uncached, 0.0)
            rates.queued_requests = max(rates.queued_requests - 1, 0)

    def forget(self, request_id: str) -> None:
        """The request left its backend (released): drop what is kept of it."""
        pending = self._pending.pop(request_id, None)
        if pending is not None:
            self._unqueue(pending)

    def forget_backend(self, backend_id: str) -> None:
        """Drop a backend's learned rates (it left the fleet, or its engine changed)."""
        self._rates.pop(backend_id, None)
        self._bases.pop(backend_id, None)
        for request_id in [k for k, p in self._pending.items() if p.backend_id == backend_id]:
            del self._pending[request_id]

    @property
    def pending(self) -> int:
        """Requests sent and not yet forgotten."""
        return len(self._pending)

    def queued_tokens(self, backend_id: str) -> float:
        """Uncached prompt tokens this router sent to ``backend_id`` that have no first token yet."""
        rates = self._rates.get(backend_id)
        return 0.0 if rates is None else rates.queued_tokens

    # -- learning (the host) -------------------------------------------------------------

    def observe(
        self,
        request_id: str,
        *,
        ttft_s: float | None = None,
        tpot_s: float | None = None,
        cached_tokens: float | None = None,
    ) -> Observation | None:
        """Report what a request pending since `started` measured; returns it next to its prediction.

        ``ttft_s``: seconds to the first token (its prefill left the queue; a rate sample);
        ``tpot_s``: mean seconds per output token after the first (a decode sample);
        ``cached_tokens``: prompt tokens the engine reported cached (corrects the work's uncached
        part). Call it before the lease is released; an unknown id, or a value that is not a
        finite non-negative number, teaches nothing and returns ``None``.
        """
        pending = self._pending.get(request_id)
        if pending is None:
            return None
        ttft = _finite(ttft_s)
        tpot = _finite(tpot_s)
        if ttft is None and tpot is None:
            return None
        priors = self.priors_for(pending.backend_id)
        rates = self._state(pending.backend_id)
        self._bases.pop(pending.backend_id, None)
        if ttft is not None:
            self._unqueue(pending)
            uncached = pending.uncached
            cached = _finite(cached_tokens)
            if cached is not None:
                uncached = max(pending.prompt - cached, 0.0)
            rates.uncached.append(uncached)
            rates.mean_uncached = self._window_median(rates.uncached)
            work = pending.work - pending.uncached + uncached
            busy = ttft - priors.ttft_overhead_s
            if work >= 1.0 and busy > 0:
                rates.prefill.append(work / busy)
                rates.prefill_rate = self._window_median(rates.prefill)
            self.errors.record(pending.predicted.ttft_s, ttft)
        if tpot is not None and tpot > 0:
            rates.decode.append(tpot / (1.0 + priors.decode_load_weight * pending.decode_load) / pending.slowdown)
            rates.decode_step = self._window_median(rates.decode)
        return Observation(pending.backend_id, pending.predicted, ttft, tpot)

    def summary(self, backend_ids: Iterable[str] | None = None) -> dict[str, dict[str, float | int]]:
        """Per backend: learned prefill rate, decode step, samples and queued tokens (for a status page)."""
        ids = list(self._rates) if backend_ids is None else list(backend_ids)
        return {
            b: {
                "prefill_tokens_per_s": self.prefill_rate(b),
                "decode_step_s": self.decode_step(b),
                "samples": self.samples(b),
                "queued_tokens": self.queued_tokens(b),
            }
            for b in ids
        }


def _median(values: Iterable[float]) -> float:
    """The median (``statistics.median`` without importing it: ``import kvroute`` stays light)."""
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def _finite(value: float | None) -> float | None:
    if value is None or type(value) is bool:
        return None
    if type(value) is not float:
        try:
            value = float(value)
        except (TypeError, ValueError):
            return None
    return value if 0 <= value < math.inf else None
