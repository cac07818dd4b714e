"""The TTFT/TPOT predictor: rates learned online per backend, robust to outliers, priors for stale telemetry."""

from __future__ import annotations

import random
import time

import attrs
import pytest

from kvroute import Backend, BackendState, EngineLoad, Predictor, Priors
from kvroute.backend import RankLoad
from kvroute.predictor import FULL_FOR_S


def _state(backend_id: str = "b0", **kwargs: object) -> BackendState:
    return BackendState(Backend(backend_id, **kwargs))  # type: ignore[arg-type]


def _serve(predictor: Predictor, state: BackendState, rid: str, uncached: float, ttft: float) -> None:
    predictor.started(rid, state, prompt_tokens=uncached, uncached_tokens=uncached)
    predictor.observe(rid, ttft_s=ttft)
    predictor.forget(rid)


PRIORS = Priors(prefill_tokens_per_s=1000.0, ttft_overhead_s=0.0, decode_step_s=0.02, decode_load_weight=0.0)


class TestPredict:
    def test_priors_before_any_observation(self) -> None:
        """An unobserved idle backend's TTFT is the uncached tokens over the prior rate, plus the overhead."""
        predictor = Predictor(Priors(prefill_tokens_per_s=2000.0, ttft_overhead_s=0.01))
        prediction = predictor.predict(_state(), 1000)
        assert prediction.ttft_s == pytest.approx(0.51)
        assert prediction.tpot_s == pytest.approx(0.02)
        assert not prediction.stale

    def test_queue_ahead_counts(self) -> None:
        """Requests sent and still waiting for their first token add their uncached tokens to the next one's TTFT."""
        predictor = Predictor(PRIORS)
        state = _state()
        predictor.started("r1", state, 3000, 2000)
        state.in_flight += 1
        assert predictor.predict(state, 500).ttft_s == pytest.approx(2.5)
        predictor.observe("r1", ttft_s=2.0)  # its prefill is done: no longer ahead
        assert predictor.predict(state, 500).ttft_s == pytest.approx(0.5)

    def test_forget_unqueues(self) -> None:
        """A request released before its first token no longer counts as queued."""
        predictor = Predictor(PRIORS)
        state = _state()
        predictor.started("r1", state, 1000, 1000)
        assert predictor.queued_tokens("b0") == 1000
        predictor.forget("r1")
        assert predictor.queued_tokens("b0") == 0
        assert predictor.pending == 0

    def test_engine_waiting_counts(self) -> None:
        """The engine's reported waiting requests count as queued work when they exceed the router's own."""
        predictor = Predictor(PRIORS)
        state = _state()
        state.load = EngineLoad(waiting=3)
        prediction = predictor.predict(state, 0)
        assert prediction.ttft_s == pytest.approx(3 * PRIORS.uncached_tokens / 1000.0)

    def test_named_rank_queue(self) -> None:
        """A data-parallel backend's named rank is predicted from that rank's own reported queue."""
        predictor = Predictor(PRIORS)
        state = _state(data_parallel_size=2)
        state.load = EngineLoad(waiting=4, ranks=(RankLoad(0, waiting=4), RankLoad(1, waiting=0)))
        busy = predictor.predict(state, 0, rank=0).ttft_s
        idle = predictor.predict(state, 0, rank=1).ttft_s
        assert busy == pytest.approx(4.0) and idle == pytest.approx(0.0)

    def test_decode_load_raises_tpot(self) -> None:
        """TPOT grows with the requests decoding alongside."""
        predictor = Predictor(Priors(decode_step_s=0.02, decode_load_weight=0.1))
        state = _state()
        state.load = EngineLoad(running=10, waiting=0)
        assert predictor.predict(state, 0).tpot_s == pytest.approx(0.04)


class TestLearning:
    def test_converges(self) -> None:
        """Observed TTFTs of a backend twice as fast as its prior move its rate to the true one."""
        predictor = Predictor(PRIORS)
        state = _state()
        rng = random.Random(1)
        for i in range(40):
            tokens = rng.randint(200, 4000)
            _serve(predictor, state, f"r{i}", tokens, tokens / 2000.0 * rng.uniform(0.95, 1.05))
        assert predictor.prefill_rate("b0") == pytest.approx(2000.0, rel=0.05)
        assert predictor.predict(state, 2000).ttft_s == pytest.approx(1.0, rel=0.05)
        assert predictor.errors.count == 40

    def test_outliers_do_not_move_the_rate(self) -> None:
        """A fifth of wild observations (stalls 50x slower) leave the learned rate within 10 % of the true one."""
        predictor = Predictor(PRIORS)
        state = _state()
        rng = random.Random(2)
        for i in range(60):
            ttft = 1000 / 4000.0 * (50.0 if i % 5 == 0 else 1.0)
            _serve(predictor, state, f"r{i}", 1000, ttft * rng.uniform(0.98, 1.02))
        assert predictor.prefill_rate("b0") == pytest.approx(4000.0, rel=0.1)

    def test_rates_per_backend(self) -> None:
        """Two backends on different hardware learn rates of their own."""
        predictor = Predictor(PRIORS)
        fast, slow = _state("fast"), _state("slow")
        for i in range(10):
            _serve(predictor, fast, f"f{i}", 1000, 0.25)
            _serve(predictor, slow, f"s{i}", 1000, 2.0)
        assert predictor.prefill_rate("fast") == pytest.approx(4000.0)
        assert predictor.prefill_rate("slow") == pytest.approx(500.0)

    def test_priors_until_enough_samples(self) -> None:
        """The prior holds until ``min_samples`` observations are in."""
        predictor = Predictor(PRIORS, min_samples=3)
        state = _state()
        _serve(predictor, state, "a", 1000, 0.1)
        _serve(predictor, state, "b", 1000, 0.1)
        assert predictor.prefill_rate("b0") == PRIORS.prefill_tokens_per_s
        _serve(predictor, state, "c", 1000, 0.1)
        assert predictor.prefill_rate("b0") == pytest.approx(10_000.0)

    def test_cached_tokens_correct_the_work(self) -> None:
        """When the engine reports more cached tokens than predicted, the sample counts only the work done."""
        predictor = Predictor(PRIORS, min_samples=1)
        state = _state()
        predictor.started("r", state, 2000, 2000)
        predictor.observe("r", ttft_s=0.5, cached_tokens=1000)
        assert predictor.prefill_rate("b0") == pytest.approx(2000.0)

    def test_decode_step_learned(self) -> None:
        """Observed TPOTs set the backend's decode step."""
        predictor = Predictor(PRIORS)
        state = _state()
        for i in range(5):
            predictor.started(f"r{i}", state, 10, 10)
            predictor.observe(f"r{i}", tpot_s=0.05)
            predictor.forget(f"r{i}")
        assert predictor.predict(state, 0).tpot_s == pytest.approx(0.05, rel=0.01)

    def test_bad_observations_ignored(self) -> None:
        """Unknown ids and values that are not finite non-negative numbers teach nothing."""
        predictor = Predictor(PRIORS)
        state = _state()
        assert predictor.observe("nobody", ttft_s=1.0) is None
        predictor.started("r", state, 10, 10)
        assert predictor.observe("r", ttft_s=float("nan")) is None
        assert predictor.observe("r", ttft_s=-1.0) is None
        assert predictor.samples("b0") == 0
        observation = predictor.observe("r", ttft_s=0.5)
        assert observation is not None and observation.ttft_error_s == pytest.approx(0.5 - 0.01)


class TestStale:
    def test_stale_falls_back_to_priors(self) -> None:
        """A backend whose telemetry is stale is predicted from priors, its engine queue ignored, and says so."""
        predictor = Predictor(PRIORS)
        state = _state()
        for i in range(10):
            _serve(predictor, state, f"r{i}", 1000, 0.1)  # learned: 10,000 tokens/s
        state.load = EngineLoad(waiting=50, observed_at=time.monotonic() - 60)
        state.load_max_age = 10
        prediction = predictor.predict(state, 1000)
        assert prediction.stale
        assert prediction.ttft_s == pytest.approx(1.0)  # the prior rate, no queue
        state.load = EngineLoad(waiting=0)
        fresh = predictor.predict(state, 1000)
        assert not fresh.stale and fresh.ttft_s == pytest.approx(0.1)


class TestConfig:
    def test_bad_priors(self) -> None:
        """A prior that is not a positive finite number is refused, naming the field and the value."""
        with pytest.raises(ValueError, match=r"'prefill_tokens_per_s' must be a positive number \(got 0\)"):
            Priors(prefill_tokens_per_s=0)
        with pytest.raises(ValueError, match=r"'window' must be an integer from 1 to 4096 \(got 0\)"):
            Predictor(window=0)
        with pytest.raises(ValueError, match=r"'min_samples'"):
            Predictor(window=4, min_samples=5)

    def test_overrides(self) -> None:
        """A backend with priors of its own is predicted from them before it is observed."""
        predictor = Predictor(PRIORS, overrides={"big": Priors(prefill_tokens_per_s=4000.0, ttft_overhead_s=0.0)})
        assert predictor.predict(_state("big"), 1000).ttft_s == pytest.approx(0.25)
        assert predictor.predict(_state("small"), 1000).ttft_s == pytest.approx(1.0)

    def test_error_summary(self) -> None:
        """The error summary gives the median absolute error and the share within 25 %."""
        predictor = Predictor(PRIORS)
        predictor.errors.record(1.0, 1.1)
        predictor.errors.record(1.0, 2.0)
        predictor.errors.record(1.0, 1.0)
        assert predictor.errors.median_abs_error_s() == pytest.approx(0.1)
        assert predictor.errors.within(0.25) == pytest.approx(2 / 3)


class TestBase:
    def _fleet(self, rng: random.Random, predictor: Predictor) -> list[BackendState]:
        states = []
        for i in range(8):
            state = _state(f"b{i}")
            state.in_flight = rng.randrange(0, 6)
            kind = rng.randrange(4)
            if kind == 1:
                state.load = EngineLoad(running=rng.randrange(0, 30), waiting=rng.randrange(0, 5))
            elif kind == 2:
                state.load = EngineLoad(waiting=3, observed_at=0.0)  # stale
            elif kind == 3:
                state.load = EngineLoad(running=4, waiting=2, data_parallel_size=2)
            for j in range(rng.randrange(0, 3)):
                predictor.started(f"{state.id}-q{j}", state, 2000, rng.randrange(0, 2000))
            states.append(state)
        for i in range(5):  # learned rates on b0
            _serve(predictor, states[0], f"learn{i}", 1000, 0.2 + 0.01 * i)
        return states

    def test_agrees_with_predict(self) -> None:
        """``base`` is `predict`'s request-independent part: TTFT linear in the uncached tokens, the same TPOT."""
        rng = random.Random(4)
        predictor = Predictor()
        now = time.monotonic()
        for state in self._fleet(rng, predictor):
            base = predictor.base(state, now)
            for uncached in (0, 1, 777, 40_000):
                p = predictor.predict(state, uncached, now=now)
                assert base.ttft_s + uncached * base.s_per_token == pytest.approx(p.ttft_s, rel=1e-12)
                assert base.tpot_s == pytest.approx(p.tpot_s, rel=1e-12) and base.stale == p.stale

    def test_kept_until_something_changes(self) -> None:
        """A kept base follows in-flight counts, engine loads, accounting, observations and staleness."""
        predictor = Predictor(Priors(prefill_tokens_per_s=1000.0), min_samples=1)
        state = _state()
        state.load = EngineLoad(running=2, waiting=0, observed_at=100.0)

        def check(now: float = 105.0) -> None:
            base = predictor.base(state, now)
            p = predictor.predict(state, 0, now=now)
            assert (base.ttft_s, base.tpot_s, base.stale) == pytest.approx((p.ttft_s, p.tpot_s, p.stale))

        check()
        predictor.started("r1", state, 500, 500)
        check()
        state.in_flight += 1
        check()
        state.load = EngineLoad(running=9, waiting=0, observed_at=101.0)
        check()
        predictor.observe("r1", tpot_s=0.05)  # learns a decode step
        check()
        predictor.observe("r1", ttft_s=0.4)  # learns a rate; its prefill leaves the queue
        check()
        predictor.started("r2", state, 300, 300)
        check()
        check()
        predictor.forget("r2")
        check()
        state.in_flight -= 1
        check()
        check(now=200.0)  # the load is stale by now: priors only
        assert predictor.base(state, 200.0).stale
        predictor.priors = Priors(prefill_tokens_per_s=10.0)
        predictor.invalidate()
        check(now=200.0)


SEATED = Priors(
    prefill_tokens_per_s=10_000.0,
    ttft_overhead_s=0.0,
    decode_step_s=0.02,
    decode_load_weight=0.0,
    uncached_tokens=1000.0,
    output_tokens=50.0,
)


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _seen_full(predictor: Predictor, state: BackendState, clock: _Clock, **load: object) -> None:
    """Report ``load`` (requests waiting) twice, `FULL_FOR_S` apart: the engine is seen full."""
    state.load = EngineLoad(**load)  # type: ignore[arg-type]
    predictor.predict(state, 0)
    clock.now += FULL_FOR_S
    state.load = EngineLoad(**load)  # type: ignore[arg-type]


class TestSeats:
    """The wait for a batch seat: engines limited by ``max_num_seqs`` queue requests beyond their seats."""

    def test_full_engine_waits_for_a_seat(self) -> None:
        """An engine reporting requests waiting while its seats are taken predicts the wait for a seat:
        ``(waiting + 1/2) x seat time / seats``, more than the waiting requests' prefill alone."""
        clock = _Clock()
        predictor = Predictor(SEATED, clock=clock)
        state = _state()
        _seen_full(predictor, state, clock, running=8, waiting=2)
        service = 1000 / 10_000 + 0.02 * 50  # prefill plus 50 output tokens
        assert predictor.predict(state, 500).ttft_s == pytest.approx(2.5 * service / 8 + 0.05)

    def test_free_seat_means_no_wait(self) -> None:
        """With a seat free (the router's own requests finished since the report), only prefill counts."""
        clock = _Clock()
        predictor = Predictor(SEATED, clock=clock)
        state = _state()
        state.in_flight = 10
        _seen_full(predictor, state, clock, running=8, waiting=2)
        assert predictor.predict(state, 500).ttft_s > 0.3
        state.in_flight = 5  # five of them ended since the engine was read
        assert predictor.predict(state, 500).ttft_s == pytest.approx(0.05)

    def test_seats_unknown_until_seen_full(self) -> None:
        """Running requests alone, with none waiting, say nothing about the seats: no seat wait is predicted."""
        predictor = Predictor(SEATED)
        state = _state()
        state.load = EngineLoad(running=3, waiting=0)
        state.in_flight = 12
        assert predictor.predict(state, 500).ttft_s == pytest.approx(0.05)

    def test_configured_seats_without_telemetry(self) -> None:
        """Seats from configuration bound a backend whose engine reports nothing, from the router's own count."""
        predictor = Predictor(attrs.evolve(SEATED, seats=4))
        state = _state()
        state.in_flight = 4
        service = 1000 / 10_000 + 0.02 * 50
        assert predictor.predict(state, 0).ttft_s == pytest.approx(0.5 * service / 4)

    def test_seat_time_is_learned(self) -> None:
        """How long a request holds its seat is learned per backend from its first token to its end."""
        clock = _Clock()
        predictor = Predictor(attrs.evolve(SEATED, seats=1), min_samples=1, clock=clock)
        state = _state()
        predictor.started("r", state, 1000, 1000)
        clock.now = 0.1
        predictor.observe("r", ttft_s=0.1)
        clock.now = 4.1
        predictor.forget("r")
        state.in_flight = 1
        assert predictor.predict(state, 0).ttft_s == pytest.approx(0.5 * (0.1 + 4.0))

    def test_seat_bound_ttft_teaches_no_prefill_rate(self) -> None:
        """A TTFT spent waiting for a seat is no prefill-rate sample: the learned rate stays the true one."""
        predictor = Predictor(attrs.evolve(SEATED, seats=1), min_samples=1)
        state = _state()
        _serve(predictor, state, "a", 1000, 0.1)
        state.in_flight = 1
        predictor.started("b", state, 1000, 1000)
        predictor.observe("b", ttft_s=5.0)
        assert predictor.prefill_rate("b0") == pytest.approx(10_000.0)

    def test_seats_learned_from_first_come_order(self) -> None:
        """A request's first token while k earlier ones still run proves k + 1 seats, so a report of fewer running
        with one waiting (a request read between two engine steps) does not make the engine look full."""
        clock = _Clock()
        predictor = Predictor(SEATED, clock=clock)
        state = _state()
        for n in range(3):  # proved three times
            for i in range(6):
                predictor.started(f"r{n}.{i}", state, 100, 100)
            predictor.observe(f"r{n}.5", ttft_s=0.1)  # five sent before it still run: at least 6 seats
            for i in range(6):
                predictor.forget(f"r{n}.{i}")
        state.in_flight = 8
        _seen_full(predictor, state, clock, running=4, waiting=1)
        assert predictor.predict(state, 0).ttft_s < 0.05  # the waiting one's prefill only, no seat wait
        naive = Predictor(SEATED, clock=clock)  # without the router's own evidence, 4 seats: the 8 in flight wait
        _seen_full(naive, state, clock, running=4, waiting=1)
        assert naive.predict(state, 0).ttft_s > 0.2

    def test_stale_telemetry_uses_configured_seats(self) -> None:
        """With stale telemetry the learned seats are not used; the configured ones are."""
        clock = _Clock()
        predictor = Predictor(SEATED, clock=clock)
        state = _state()
        state.in_flight = 3
        _seen_full(predictor, state, clock, running=2, waiting=5)
        assert predictor.predict(state, 0).ttft_s > 0.0
        state.load = EngineLoad(running=2, waiting=5, observed_at=time.monotonic() - 60)
        stale = predictor.predict(state, 0)
        assert stale.stale and stale.ttft_s == pytest.approx(0.0)

    def test_waiting_with_none_running_learns_no_seats(self) -> None:
        """An engine reporting requests waiting and none running (between two steps) says nothing about its seats."""
        predictor = Predictor(SEATED)
        state = _state()
        state.load = EngineLoad(running=0, waiting=3)
        state.in_flight = 3
        assert predictor.predict(state, 0).ttft_s == pytest.approx(3 * 1000 / 10_000)  # their prefill only
        assert predictor.seats("b0") is None

    def test_one_report_of_waiting_is_not_full(self) -> None:
        """A request read between two engine steps waits with seats free: one report of it, or a spell in which
        the engine ran more requests than before, does not make the engine full (no seat wait predicted)."""
        clock = _Clock()
        predictor = Predictor(SEATED, clock=clock)
        state = _state()
        state.in_flight = 6
        state.load = EngineLoad(running=1, waiting=1)  # the first request, read before the engine's next step
        assert predictor.predict(state, 0).ttft_s == pytest.approx(0.1)  # the waiting one's prefill only
        for running in range(2, 6):  # the engine keeps admitting: every report runs more than ever before
            clock.now += FULL_FOR_S
            state.load = EngineLoad(running=running, waiting=1)
            assert predictor.predict(state, 0).ttft_s == pytest.approx(0.1)
        clock.now += FULL_FOR_S / 2
        state.load = EngineLoad(running=5, waiting=1)  # a spell, but shorter than FULL_FOR_S
        assert predictor.predict(state, 0).ttft_s == pytest.approx(0.1)
        clock.now += FULL_FOR_S / 2
        state.load = EngineLoad(running=5, waiting=1)  # still waiting, no more running: full, at 5 seats
        service = 1000 / 10_000 + 0.02 * 50
        assert predictor.predict(state, 0).ttft_s == pytest.approx(max(1.5 * service / 5, 0.1))

    def test_bad_seats(self) -> None:
        """Seats that are not a positive integer are refused."""
        with pytest.raises(ValueError, match=r"'seats' must be a positive integer \(got 0\)"):
            Priors(seats=0)


class TestOverhead:
    def test_overhead_learned_with_the_rate(self) -> None:
        """Short and long prompts on an engine whose step is longer than the prior overhead: the overhead and the
        rate are learned together, so both kinds are predicted within a few percent."""
        predictor = Predictor(PRIORS)  # prior overhead 0
        state = _state()
        rng = random.Random(3)
        for i in range(40):
            tokens = 60 if i % 2 else 1500
            _serve(predictor, state, f"r{i}", tokens, (0.1 + tokens / 5000.0) * rng.uniform(0.97, 1.03))
        assert predictor.ttft_overhead("b0") == pytest.approx(0.1, rel=0.1)
        assert predictor.prefill_rate("b0") == pytest.approx(5000.0, rel=0.1)
        assert predictor.predict(state, 60).ttft_s == pytest.approx(0.112, rel=0.05)
        assert predictor.predict(state, 1500).ttft_s == pytest.approx(0.4, rel=0.05)

    def test_same_work_keeps_the_prior_overhead(self) -> None:
        """Samples that all did the same work cannot separate overhead from rate: the prior overhead stays."""
        predictor = Predictor(PRIORS)
        state = _state()
        for i in range(20):
            _serve(predictor, state, f"r{i}", 1000, 0.5)
        assert predictor.ttft_overhead("b0") == PRIORS.ttft_overhead_s
        assert predictor.prefill_rate("b0") == pytest.approx(2000.0)


class TestSeenFull:
    def test_seen_full_by_own_requests(self) -> None:
        """Without engine telemetry, requests that were sent behind the proved seats and waited for earlier ones
        to end (first token after more than twice their prefill) show the engine full: seats then bound."""
        predictor = Predictor(SEATED, min_samples=1)
        state = _state()
        _serve(predictor, state, "warm", 1000, 0.1)  # the prefill rate: 10,000 tokens/s
        for n in range(3):  # two seats proved three times
            predictor.started(f"a{n}", state, 1000, 1000)
            predictor.started(f"b{n}", state, 1000, 1000)
            predictor.observe(f"a{n}", ttft_s=0.1)
            predictor.observe(f"b{n}", ttft_s=0.1)
            if n < 2:
                predictor.forget(f"a{n}")
                predictor.forget(f"b{n}")
        state.in_flight = 2
        assert predictor.predict(state, 0).ttft_s == pytest.approx(0.0)  # not known full: no seat wait
        for n in range(3):  # sent behind the two running, seated only once one of them ended, after 1 s
            predictor.started(f"c{n}", state, 1000, 1000)
            predictor.forget("a2" if n == 0 else f"c{n - 1}")
            predictor.observe(f"c{n}", ttft_s=1.0)
        assert predictor.seats("b0") == 2
        assert predictor.predict(state, 0).ttft_s > 0.0
