"""Predicted time to first token (TTFT) and time per output token (TPOT) per backend, learned online.

No I/O: the host feeds it. The `Router` (built with ``predictor=``) tells it where each request
went (`Predictor.started`) and when the request left (`Predictor.forget`); the host reports what
it measured with `Predictor.observe` (TTFT at the first token, TPOT at the end), before it
releases the lease.

The model, per backend::

    TTFT = ttft_overhead_s + max((queued prefill tokens ahead + uncached) / prefill rate,
                                 seat wait + uncached / prefill rate)
    seat wait = (k + 1/2) * seat time / seats, with k = requests on the backend - seats (none while k < 0)
    TPOT = decode_step_s * (1 + decode_load_weight * requests decoding alongside) [/ (1 - prefill share)]

*Queued prefill tokens ahead* is the larger of two estimates: the uncached prompt tokens of
requests this router sent there that have not produced a first token yet (in-flight accounting),
and the engine's reported ``waiting`` requests times the backend's typical (median) uncached prompt (the
engine also counts other routers' requests). A data-parallel backend prefills on its ranks side
by side: the queue of the rank the decision names (`EngineLoad.ranks`) counts when the engine
reports one, else the backend's queue spread over its ranks. *Requests decoding alongside* are the
engine's ``running`` when reported, else the router's in-flight count. The engine's ``kv_usage`` is
not used: a full cache delays new requests only as the waiting queue already shows.

*The wait for a batch seat*: engines run at most ``seats`` requests at once (vLLM's ``max_num_seqs``) and
queue the rest first come, first served; with every seat taken a seat frees every ``seat time / seats``
seconds on average, the ``k`` requests already waiting go first, and the first seat frees half an interval
away. *Requests on the backend* are this router's in-flight count now plus the others the engine last
reported (its ``running + waiting`` less this router's count when that report was first seen: other
routers' requests), so a report seconds old does not hide the requests that ended since; per rank for a
named data-parallel rank. With seats known, the engine's waiting requests are the ones beyond the seats now,
not as last reported. *Seats* are the configured `Priors.seats` until the engine has been seen full
(requests waiting while as many ran as ever seen): then the most ever seen taken at once, by the engine's
reported ``running`` or by this router's own requests (a request's first token while ``n`` requests sent
there before it are still in flight proves ``n + 1`` seats, engines serving in order; one-rank backends;
counted once proved `SEEN_SEATS` times).
Requiring "full" keeps a request read between two engine steps (waiting while seats are free) from
counting: requests must be reported waiting, with no more running than ever seen, for `FULL_FOR_S`. This
router's own requests also show the engine full, without telemetry and before the next report: a request
sent behind at least as many of them as the seats proved, whose first token came when fewer of those were
left and after more than twice its prefill time, waited for a seat (`SEEN_SEATS` such).
The *seat time* (how long a request holds its seat: ``ttft_overhead_s`` + its uncached tokens over the
prefill rate + the time from its first token to `Predictor.forget`) is learned per backend like
the rates; before, ``ttft_overhead_s + uncached_tokens / rate + decode step x output_tokens``.

With ``prefill_slows_decode=True`` (off by default: in the simulator it lowered goodput at every
load), TPOT is also divided by ``1 - prefill share``, the share of the backend's time its prefills
are expected to take while the request decodes (an engine mixing prefill chunks into decode steps,
as vLLM's chunked prefill does, slows every decoding request by that much): the uncached tokens
this router sent there over the last ``arrival_window_s`` seconds, per second, over its prefill rate, at most 0.95.

The *prefill rate* (tokens/s) and the *decode step* (s) are learned per backend, so backends on
different hardware get rates of their own: every observed TTFT gives a rate sample ``work /
(TTFT - ttft_overhead_s)`` (``work`` as counted when the request was sent, its uncached part
corrected by the engine's reported cached tokens when the host passes them) unless the wait for a seat
bound its prediction (that TTFT measured the queue, not the prefill), every observed TPOT a
decode-step sample. A backend's rate is the median of its last ``window`` samples, so a few wild
samples (a stalled stream, a preempted request) do not move it; until ``min_samples`` are in, the
configured `Priors` hold. Once a backend's TTFT samples of requests sent with nothing queued ahead spread
over small and large work (the half with more work at least twice the other's, ``min_samples`` in each),
the overhead is learned with the rate: the line ``TTFT = overhead + work / rate`` through the medians of
the two halves (as robust to outliers as the medians), which replaces the prior overhead and the rate of
the ratio medians (those assume the overhead known: an engine step longer than the prior overhead made
short prompts look slow to prefill). A backend whose engine telemetry is stale (reported once, now older than
`BackendState.load_max_age`) is predicted from the priors alone (the configured seats too, over this
router's own requests), its engine load ignored, and the prediction says so (`Prediction.stale`).

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

from kvroute.backend import BackendState, EngineLoad
from kvroute.slo import Prediction
from kvroute.validators import expect

__all__ = ["Base", "Observation", "PredictionErrors", "Predictor", "Priors"]

#: Times this router's own requests must prove a seat count before it counts (see `Predictor._seated`).
SEEN_SEATS = 3
#: Seconds requests must be reported waiting, while the engine runs no more requests than ever seen, before the
#: engine counts as full (see `Predictor._saw`). A request sent between two engine steps waits too, with seats
#: free; the engine admits it at its next step (milliseconds, or one prefill chunk: a few hundred), so one
#: report of it proves nothing. Engines polled every few seconds prove it with two consecutive reports.
FULL_FOR_S = 1.0

_positive = expect("a positive number", v.instance_of((int, float)), v.gt(0), v.lt(math.inf), error=ValueError)
_seats = expect("a positive integer", v.instance_of(int), v.ge(1), error=ValueError)
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
    #: Batch seats per data-parallel rank (vLLM's ``max_num_seqs``): requests beyond them wait for one to free.
    #: ``None``: unknown until learned (from the engine's reported ``running``, and from this router's own requests).
    seats: int | None = attrs.field(default=None, validator=v.optional(_seats))
    #: Output tokens assumed per request (how long it holds its seat) until some requests have been seen end.
    output_tokens: float = attrs.field(default=256.0, validator=_positive)


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
    #: (prefill tokens of the work, TTFT) of the samples, for the line fit of the overhead (`_fit`), and its result.
    pairs: deque[tuple[float, float]] = attrs.field(factory=deque)
    overhead: float | None = None
    #: Seconds a request holds its batch seat (its prefill and decode): samples and their median.
    service: deque[float] = attrs.field(factory=deque)
    service_s: float | None = None
    #: Batch seats per rank seen taken at once (a lower bound of the engine's), and whether the engine was seen
    #: full (requests waiting while that many ran): only then do the seats bound the prediction.
    seats: int = 0
    saturated: bool = False
    #: From the last engine report: its requests beyond this router's in-flight count then (other routers'),
    #: this router's in-flight count then, and the report's ``observed_at``.
    others: float = 0.0
    own_at: int = 0
    load_at: float = -math.inf
    #: This router's requests here not yet forgotten, in the order they were sent; the backend's data-parallel ranks.
    order: dict[str, None] = attrs.field(factory=dict)
    ranks: int = 1
    #: Seat counts above ``seats`` that first-come order proved, and how often (see `Predictor._seated`); requests
    #: seen waiting for a seat by this router's own accounting.
    bounds: dict[int, int] = attrs.field(factory=dict)
    full_seen: int = 0
    #: `Predictor.clock` when the first engine report of the current spell of requests waiting while every seat
    #: seen was taken was read (``None`` outside one): the engine counts as full once a spell lasts `FULL_FOR_S`.
    full_since: float | None = None


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
    #: Whether the wait for a batch seat bound its predicted TTFT (its TTFT is then no prefill-rate sample).
    seat_bound: bool = False
    #: `Predictor.clock` at its first token (its seat time is measured from there to `Predictor.forget`).
    first_at: float | None = None
    #: This router's requests in flight there, sent before it, when it was sent.
    sent_behind: int = 0


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
        #: `SloChoice` reads it in place, with `base`'s own validity test.
        self._bases: dict[str, tuple[object, int, float, Base]] = {}

    # -- rates ---------------------------------------------------------------------------

    def priors_for(self, backend_id: str) -> Priors:
        """The priors of ``backend_id``: its override, else the shared ones."""
        return self.overrides.get(backend_id, self.priors)

    def _state(self, backend_id: str) -> _Rates:
        rates = self._rates.get(backend_id)
        if rates is None:
            n = self.window
            rates = self._rates[backend_id] = _Rates(
                deque(maxlen=n), deque(maxlen=n), deque(maxlen=n), pairs=deque(maxlen=n), service=deque(maxlen=n)
            )
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

    def ttft_overhead(self, backend_id: str) -> float:
        """Seconds before a first token on ``backend_id`` with nothing to prefill: learned (line fit), or its prior."""
        rates = self._rates.get(backend_id)
        learned = None if rates is None else rates.overhead
        return self.priors_for(backend_id).ttft_overhead_s if learned is None else learned

    def seat_time(self, backend_id: str) -> float | None:
        """Seconds a request holds its batch seat on ``backend_id``, as learned (``None`` before)."""
        rates = self._rates.get(backend_id)
        return None if rates is None else rates.service_s

    def seats(self, backend_id: str) -> int | None:
        """``backend_id``'s batch seats per rank once its engine was seen full, else its configured prior."""
        rates = self._rates.get(backend_id)
        if rates is not None and rates.saturated:
            return rates.seats
        return self.priors_for(backend_id).seats

    def samples(self, backend_id: str) -> int:
        """TTFT samples ``backend_id``'s prefill rate rests on (at most ``window``)."""
        rates = self._rates.get(backend_id)
        return 0 if rates is None else len(rates.prefill)

    # -- predicting ----------------------------------------------------------------------

    def _load(self, state: BackendState, rank: int | None, now: float | None) -> tuple[float, float, bool]:
        """(prefill tokens ahead, requests decoding alongside, stale) for ``state``.

        The tokens ahead include the wait for a batch seat, as the tokens the backend would prefill meanwhile
        (see `_ahead`): ``TTFT = overhead + (tokens ahead + uncached) / rate`` holds either way.
        """
        queued, decoding, seat_wait, stale = self._ahead(state, rank, now)
        if seat_wait > 0.0:
            seat_tokens = seat_wait * self._rate(state.id, stale)
            if seat_tokens > queued:
                queued = seat_tokens
        return queued, decoding, stale

    def _rate(self, backend_id: str, stale: bool) -> float:
        rates = None if stale else self._rates.get(backend_id)
        if rates is not None and rates.prefill_rate is not None:
            return rates.prefill_rate
        return self.overrides.get(backend_id, self.priors).prefill_tokens_per_s

    def _ahead(self, state: BackendState, rank: int | None, now: float | None) -> tuple[float, float, float, bool]:
        """(queued prefill tokens ahead, requests decoding alongside, seconds waiting for a seat, stale)."""
        backend_id = state.backend.id
        rates = self._rates.get(backend_id)
        own = state.in_flight
        if rates is None:
            ours, decoding = 0.0, float(own)
        else:
            ours = rates.queued_tokens
            decoding = float(max(own - rates.queued_requests, 0))
        load = state.load
        size = state.backend.data_parallel_size
        if load is not None and load.data_parallel_size is not None and load.data_parallel_size > size:
            size = load.data_parallel_size
        priors = self.overrides.get(backend_id, self.priors)
        if load is None or (time.monotonic() if now is None else now) - load.observed_at > state.load_max_age:
            # No engine report to use: the configured seats, this router's own requests (and, stale, priors only).
            stale = load is not None
            seats = rates.seats if not stale and rates is not None and rates.saturated else priors.seats
            wait = 0.0
            if seats is not None:
                wait = self._seat_wait(None if stale else rates, priors, own / size, seats, decoding)
            if size > 1:
                return ours / size, decoding / size, wait, stale
            return ours, decoding, wait, stale
        if rates is None:
            rates = self._state(backend_id)
        if load.observed_at != rates.load_at:
            self._saw(rates, load, own, size)
        ahead = own + rates.others  # requests on the backend now: this router's, and others' as last reported
        waiting: float | None = load.waiting
        running = load.running
        if rank is not None and load.ranks:
            # The named rank's own queue; this router's requests assumed spread over the ranks.
            for r in load.ranks:
                if r.rank == rank:
                    waiting, running = r.waiting, r.running
                    ahead = max(r.requests + (own - rates.own_at) / size, own / size)
                    break
            ours /= size
            size = 1
        elif size > 1:
            ahead /= size
        seats = rates.seats if rates.saturated else priors.seats
        if seats is not None and waiting is not None:
            waiting = max(ahead - seats, 0.0)  # those waiting now, rather than at the last report
        if waiting is not None:
            mean = rates.mean_uncached
            if mean is None:
                mean = priors.uncached_tokens
            if waiting * mean > ours:
                ours = waiting * mean
        if size > 1:
            ours /= size  # ranks prefill side by side
        if running is not None:
            decoding = running / size
        wait = 0.0 if seats is None else self._seat_wait(rates, priors, ahead, seats, decoding)
        return ours, decoding, wait, False

    def _saw(self, rates: _Rates, load: EngineLoad, own: int, size: int) -> None:
        """Learn from an engine report seen for the first time: seats taken, whether it was full, others' requests."""
        rates.load_at = load.observed_at
        rates.own_at = own
        total = (load.running or 0) + (load.waiting or 0)
        rates.others = float(max(total - own, 0))
        reports = [(r.running, r.waiting) for r in load.ranks] if load.ranks else [(load.running, load.waiting)]
        seats, full = rates.seats, False
        for running, waiting in reports:
            if running is None:
                continue
            per_rank = running if load.ranks else -(-running // size)
            if per_rank > rates.seats:
                rates.seats = per_rank
            if waiting and per_rank >= rates.seats and per_rank > 0:
                full = True  # requests wait while every seat seen so far is taken
        if not full or rates.seats > seats or rates.full_since is None:
            # A spell of waiting starts (or restarts: the engine ran more than ever, so it had seats free).
            rates.full_since = self.clock() if full else None
        elif self.clock() - rates.full_since >= FULL_FOR_S:
            rates.saturated = True  # requests kept waiting, and the engine ran no more, for FULL_FOR_S

    def _seat_wait(self, rates: _Rates | None, priors: Priors, ahead: float, seats: int, decoding: float) -> float:
        """Seconds until a seat frees for a request arriving behind ``ahead`` requests on ``seats`` seats.

        With every seat taken, a seat frees every ``service / seats`` seconds on average (``service``: how long a
        request holds its seat); the ``k`` requests already waiting go first, and the first seat frees half an
        interval away on average: ``(k + 1/2) * service / seats``.
        """
        beyond = ahead - seats
        if beyond < 0 or seats < 1:
            return 0.0
        service = None if rates is None else rates.service_s
        if service is None:
            service = (
                priors.ttft_overhead_s
                + priors.uncached_tokens / priors.prefill_tokens_per_s
                + priors.decode_step_s * (1.0 + priors.decode_load_weight * decoding) * priors.output_tokens
            )
        return (beyond + 0.5) * service / seats

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
        overhead = priors.ttft_overhead_s
        if rates is not None and rates.overhead is not None:
            overhead = rates.overhead
        ttft = overhead + (queued + uncached) / rate
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
        backend_id = state.backend.id
        kept = self._bases.get(backend_id)
        if kept is not None and kept[0] is load and kept[1] == state.in_flight and now <= kept[2]:
            return kept[3]
        # `_load` then `_predict` with nothing uncached, the same arithmetic in one pass (no Prediction made).
        queued, decoding, seat_wait, stale = self._ahead(state, None, now)
        priors = self.overrides.get(backend_id, self.priors)
        rate, step, overhead = priors.prefill_tokens_per_s, priors.decode_step_s, priors.ttft_overhead_s
        rates = None if stale else self._rates.get(backend_id)
        if rates is not None:
            if rates.prefill_rate is not None:
                rate = rates.prefill_rate
            if rates.decode_step is not None:
                step = rates.decode_step
            if rates.overhead is not None:
                overhead = rates.overhead
        if seat_wait > 0.0 and seat_wait * rate > queued:
            queued = seat_wait * rate
        tpot = step * (1.0 + priors.decode_load_weight * decoding)
        if self.prefill_slows_decode:
            tpot *= self._slowdown(rates, rate)
            return Base(overhead + (queued + 0.0) / rate, 1.0 / rate, tpot, stale)  # changes with time: not kept
        base = Base(overhead + (queued + 0.0) / rate, 1.0 / rate, tpot, stale)
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
        queued, decoding, seat_wait, stale = self._ahead(state, rank, now)
        seat_bound = False
        if seat_wait > 0.0:
            seat_tokens = seat_wait * self._rate(state.id, stale)
            if seat_tokens > queued:
                queued, seat_bound = seat_tokens, True
        uncached = max(uncached_tokens, 0.0)
        if prediction is None:
            prediction = self._predict(state.id, queued, uncached, decoding, stale)
        rates = self._state(state.id)
        self._bases.pop(state.id, None)
        behind = len(rates.order)
        rates.order[request_id] = None
        rates.ranks = state.data_parallel_size
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
            state.id,
            queued + uncached,
            uncached,
            float(prompt_tokens),
            decoding,
            prediction,
            slowdown,
            True,
            seat_bound,
            None,
            behind,
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
        """The request left its backend (released): drop what is kept of it.

        A request that had its first token (`observe`) teaches how long a request holds its batch seat: its
        prefill (its uncached tokens over the prefill rate, plus the overhead) and the time since that token.
        """
        pending = self._pending.pop(request_id, None)
        if pending is None:
            return
        rates = self._rates.get(pending.backend_id)
        if rates is not None:
            rates.order.pop(request_id, None)
            if pending.first_at is not None:
                decode = self.clock() - pending.first_at
                if decode >= 0:
                    overhead = rates.overhead
                    if overhead is None:
                        overhead = self.overrides.get(pending.backend_id, self.priors).ttft_overhead_s
                    prefill = pending.uncached / self.prefill_rate(pending.backend_id)
                    rates.service.append(overhead + prefill + decode)
                    rates.service_s = self._window_median(rates.service)
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
            unqueued = self._unqueue_estimate(pending, priors)
            if pending.queued:
                self._seated(rates, request_id, pending, ttft > 2.0 * unqueued)
            self._unqueue(pending)
            uncached = pending.uncached
            cached = _finite(cached_tokens)
            if cached is not None:
                uncached = max(pending.prompt - cached, 0.0)
            rates.uncached.append(uncached)
            rates.mean_uncached = self._window_median(rates.uncached)
            work = pending.work - pending.uncached + uncached
            busy = ttft - priors.ttft_overhead_s
            if work >= 1.0 and busy > 0 and not pending.seat_bound:
                rates.prefill.append(work / busy)
                rates.prefill_rate = self._window_median(rates.prefill)
            if pending.work - pending.uncached < 1.0 and not pending.seat_bound:  # nothing was queued ahead
                rates.pairs.append((work, ttft))
                fit = _fit(rates.pairs, self.min_samples)
                if fit is not None:
                    rates.overhead, rates.prefill_rate = fit
            self.errors.record(pending.predicted.ttft_s, ttft)
        if tpot is not None and tpot > 0:
            rates.decode.append(tpot / (1.0 + priors.decode_load_weight * pending.decode_load) / pending.slowdown)
            rates.decode_step = self._window_median(rates.decode)
        return Observation(pending.backend_id, pending.predicted, ttft, tpot)

    def _unqueue_estimate(self, pending: _Pending, priors: Priors) -> float:
        """The TTFT ``pending`` would have had without waiting for a seat (its work at the learned rate)."""
        rates = self._rates.get(pending.backend_id)
        if rates is None or rates.prefill_rate is None:
            return math.inf  # no rate learned yet: nothing to compare with
        overhead = priors.ttft_overhead_s if rates.overhead is None else rates.overhead
        return overhead + pending.work / rates.prefill_rate if not pending.seat_bound else math.inf

    def _seated(self, rates: _Rates, request_id: str, pending: _Pending, slow: bool) -> None:
        """A request had its first token: it holds a seat, and so (first come, first served) does every request
        sent there before it that has not finished. That many seats, at least, the backend has (one rank).

        It also shows the engine full when it was sent behind at least as many requests as the seats proved,
        fewer of them run now, and it took more than twice its prefill (``slow``): it waited for some of them to
        end. Seen `SEEN_SEATS` times, the seats bound predictions as when the engine reports requests waiting.
        """
        pending.first_at = self.clock()
        ahead = 0
        for other in rates.order:
            if other == request_id:
                break
            ahead += 1
        if slow and not rates.saturated and rates.ranks == 1 and ahead < rates.seats <= pending.sent_behind:
            rates.full_seen += 1
            if rates.full_seen >= SEEN_SEATS:
                rates.saturated = True
        seats = ahead + 1
        if seats > rates.seats and rates.ranks == 1:
            # Counted only once seen SEEN_SEATS times: a request that ended in the engine but is not released yet
            # (its last bytes on their way) makes one bound too high by one.
            seen = rates.bounds[seats] = rates.bounds.get(seats, 0) + 1
            if seen >= SEEN_SEATS:
                rates.seats = seats
                rates.bounds = {b: n for b, n in rates.bounds.items() if b > seats}

    def summary(self, backend_ids: Iterable[str] | None = None) -> dict[str, dict[str, float | int | None]]:
        """Per backend: learned rates, overhead, seat time and seats, samples and queued tokens (for a status page)."""
        ids = list(self._rates) if backend_ids is None else list(backend_ids)
        return {
            b: {
                "prefill_tokens_per_s": self.prefill_rate(b),
                "decode_step_s": self.decode_step(b),
                "ttft_overhead_s": self.ttft_overhead(b),
                "seat_s": self.seat_time(b),
                "samples": self.samples(b),
                "queued_tokens": self.queued_tokens(b),
                "seats": self.seats(b),
            }
            for b in ids
        }


def _fit(pairs: Iterable[tuple[float, float]], min_samples: int) -> tuple[float, float] | None:
    """(overhead, rate) of the line ``TTFT = overhead + work / rate`` through the medians of the samples of less
    and of more work (``pairs``: (work, TTFT)); ``None`` until each half holds ``min_samples`` and their works
    differ (at least twice as much, and a token more) and the more work took longer."""
    ordered = sorted(pairs)
    n = len(ordered)
    half = n // 2
    if half < min_samples:
        return None
    low, high = ordered[:half], ordered[n - half :]
    w0, w1 = _median(w for w, _ in low), _median(w for w, _ in high)
    t0, t1 = _median(t for _, t in low), _median(t for _, t in high)
    if w1 < 2 * w0 + 1 or t1 <= t0:
        return None
    rate = (w1 - w0) / (t1 - t0)
    return max(t0 - w0 / rate, 0.0), rate


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
