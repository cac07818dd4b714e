"""The SLO-aware choice: the strategy's home kept when it meets the objectives, moved when another candidate does."""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import pytest

from kvroute import (
    Backend,
    BackendState,
    BaseStrategy,
    Decision,
    Fleet,
    Objectives,
    Predictor,
    Priors,
    Router,
    RouteRequest,
)
from kvroute.hashing import hash64
from kvroute.slo_choice import SLO_REASON, SloChoice

PRIORS = Priors(prefill_tokens_per_s=1000.0, ttft_overhead_s=0.0, decode_step_s=0.02, decode_load_weight=0.0)


class Home(BaseStrategy):
    """Always picks backend ``b0`` (a prefix strategy's cache home, as far as these tests care)."""

    name = "home"

    def pick(self, request: RouteRequest, candidates: Sequence[BackendState]) -> Decision:
        state = next((c for c in candidates if c.id == "b0"), candidates[0])
        return Decision(state.backend, reason="hash", key=7)


def _router(n: int = 3, **kwargs: object) -> Router:
    fleet = Fleet()
    for i in range(n):
        fleet.add(Backend(f"b{i}"))
    return Router(fleet, Home(), slo=SloChoice(Predictor(PRIORS), **kwargs))  # type: ignore[arg-type]


def _request(rid: str, words: int = 400, objectives: Objectives | None = None, prefix: str = "shared") -> RouteRequest:
    text = " ".join(f"{prefix}{i}" for i in range(words))
    return attrs.evolve(RouteRequest.from_text(text, model="m", request_id=rid), objectives=objectives)


def _queue(router: Router, backend_id: str, tokens: float) -> None:
    """Put ``tokens`` of prefill work ahead on ``backend_id`` (a request sent there earlier, no first token yet)."""
    state = router.fleet.get(backend_id)
    assert router.slo is not None
    router.slo.predictor.started(f"queued-{backend_id}", state, tokens, tokens)


class TestChoice:
    def test_home_kept_when_it_meets(self) -> None:
        """A request whose home is predicted to meet its objective stays there, with the prediction attached."""
        router = _router()
        request = _request("r1", objectives=Objectives(ttft_s=5.0))
        decision, _ = router.decide(request)
        assert decision.backend.id == "b0" and decision.reason == "hash"
        assert decision.prediction is not None and decision.prediction.meets(request.objectives)
        assert "predicted_ttft_ms" in decision.detail

    def test_moved_when_home_misses_and_another_meets(self) -> None:
        """A home whose queue makes it miss the TTFT objective loses the request to a candidate that meets it."""
        router = _router()
        _queue(router, "b0", 4000)  # 4 s ahead at 1,000 tokens/s
        _queue(router, "b1", 1500)
        request = _request("r1", objectives=Objectives(ttft_s=1.0))
        decision, _ = router.decide(request)
        assert decision.backend.id == "b2"
        assert decision.reason == SLO_REASON and decision.spilled and decision.spill_reason == SLO_REASON
        assert decision.detail["home"] == "b0"
        assert decision.prediction is not None and decision.prediction.meets(request.objectives)
        assert "slo" in decision.explain() and "home=b0" in decision.explain()

    def test_nothing_meets(self) -> None:
        """When no candidate can meet the objective, the prediction says so (the admission contract)."""
        router = _router(unmet="cheapest")
        for b, tokens in (("b0", 4000), ("b1", 3000), ("b2", 5000)):
            _queue(router, b, tokens)
        request = _request("r1", objectives=Objectives(ttft_s=1.0))
        decision, _ = router.decide(request)
        assert decision.prediction is not None and decision.prediction.meets(request.objectives) is False
        assert decision.backend.id == "b1"  # the least bad
        assert router.slo is not None and router.slo.unmet == 0  # a dry run counts nothing
        router.release(router.acquire(_request("r2", objectives=Objectives(ttft_s=1.0))))
        assert router.slo.unmet == 1

    def test_cache_keeps_home_without_objective(self) -> None:
        """Without objectives the lowest predicted cost wins: a home holding the prompt beats idle cold backends."""
        router = _router()
        first = router.acquire(_request("warm"))
        assert first.backend.id == "b0"
        router.release(first)
        _queue(router, "b0", 100)
        decision, _ = router.decide(_request("again"))
        assert decision.backend.id == "b0"
        _queue(router, "b0", 5000)
        decision, _ = router.decide(_request("again"))
        assert decision.backend.id != "b0" and decision.reason == SLO_REASON

    def test_load_bound(self) -> None:
        """A candidate at its load bound is never chosen over the home, however fast it is predicted to be."""
        router = _router(2, min_capacity=1, load_factor=1.0)
        _queue(router, "b0", 4000)
        router.fleet.get("b1").in_flight = 5
        decision, _ = router.decide(_request("r", objectives=Objectives(ttft_s=1.0)))
        assert decision.backend.id == "b0"

    def test_not_aware_only_predicts(self) -> None:
        """With ``aware=False`` the strategy's pick stands and carries its prediction."""
        router = _router(aware=False)
        _queue(router, "b0", 4000)
        decision, _ = router.decide(_request("r", objectives=Objectives(ttft_s=1.0)))
        assert decision.backend.id == "b0" and decision.prediction is not None
        assert decision.prediction.ttft_s > 4.0

    def test_stale_shown(self) -> None:
        """A decision predicted from priors because of stale telemetry says so in explain()."""
        from kvroute import EngineLoad

        router = _router(1)
        state = router.fleet.get("b0")
        state.load = EngineLoad(waiting=2, observed_at=0.0)
        decision, _ = router.decide(_request("r"))
        assert decision.prediction is not None and decision.prediction.stale
        assert "stale=True" in decision.explain()

    @pytest.mark.parametrize(("unmet", "chosen"), [("home", "b0"), ("cheapest", "b1"), ("sink", "b2")])
    def test_unmet_policies(self, unmet: str, chosen: str) -> None:
        """A request nothing can serve in time stays home, goes to the least bad, or to the worst (the sink)."""
        router = _router(unmet=unmet)
        for b, tokens in (("b0", 4000), ("b1", 3000), ("b2", 5000)):
            _queue(router, b, tokens)
        decision, _ = router.decide(_request("r1", objectives=Objectives(ttft_s=1.0)))
        assert decision.backend.id == chosen
        assert decision.prediction is not None and decision.prediction.meets(Objectives(ttft_s=1.0)) is False


class TestAccounting:
    def test_lease_queues_and_release_forgets(self) -> None:
        """A lease queues its prefill on its backend; observing the first token and releasing clear it."""
        router = _router()
        lease = router.acquire(_request("r1", words=1000))
        predictor = router.predictor
        assert predictor is not None
        assert predictor.queued_tokens("b0") > 0
        observation = predictor.observe("r1", ttft_s=0.8)
        assert observation is not None and observation.backend_id == "b0"
        assert predictor.queued_tokens("b0") == 0
        router.release(lease)
        assert predictor.pending == 0

    def test_failed_start_leaves_nothing(self) -> None:
        """A strategy whose on_request_start raises leaves no queued prefill behind."""

        class Broken(Home):
            def on_request_start(self, request: RouteRequest, decision: Decision) -> None:
                raise RuntimeError("boom")

        fleet = Fleet()
        fleet.add(Backend("b0"))
        router = Router(fleet, Broken(), slo=SloChoice(Predictor(PRIORS)))
        with pytest.raises(Exception, match="boom"):
            router.acquire(_request("r1"))
        assert router.predictor is not None and router.predictor.pending == 0
        assert router.predictor.queued_tokens("b0") == 0

    def test_dry_run_and_lease_hash_the_prompt_once(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """A dry run (`Router.decide`, as admission does) and the lease of the same request hash its blocks once."""
        import kvroute.cache_view

        calls: list[int] = []
        real = kvroute.cache_view._xxh3

        def counted(data: object, seed: int = 0) -> int:
            calls.append(seed)
            return real(data, seed)  # type: ignore[arg-type]

        monkeypatch.setattr(kvroute.cache_view, "_xxh3", counted)
        router = _router()
        r = _request("r1", words=1000, objectives=Objectives(ttft_s=1e-6))  # nothing meets it: every candidate read
        dry, _ = router.decide(r)
        hashed = len(calls)
        assert hashed > 0
        lease = router.acquire(r)
        assert len(calls) == hashed
        assert lease.decision.prediction == dry.prediction
        router.release(lease)

    def test_bad_options(self) -> None:
        """Options out of range are refused with the value named."""
        with pytest.raises(ValueError, match=r"'tpot_weight' must be a non-negative number \(got -1\)"):
            SloChoice(tpot_weight=-1)
        with pytest.raises(ValueError, match=r"'load_factor' must be a number of at least 1 \(got 0.5\)"):
            SloChoice(load_factor=0.5)


class TestFastPath:
    def test_kept_decision_copies_every_field(self) -> None:
        """The kept decision copies every field of the strategy's (fails when `Decision` gains one it drops)."""
        from kvroute import Backend, Prediction

        fields = {a.name for a in attrs.fields(Decision)}
        original = Decision(
            Backend("b0"),
            reason="r",
            strategy="s",
            key=3,
            spilled=True,
            detail={"x": 1},
            duration_s=0.5,
            spill_reason="why",
            data_parallel_rank=2,
        )
        kept = SloChoice._with(original, Prediction(0.25))
        for name in fields - {"detail", "prediction"}:
            assert getattr(kept, name) == getattr(original, name), name
        assert kept.detail == {"x": 1, "predicted_ttft_ms": 250.0}
        assert kept.prediction == Prediction(0.25)

    def test_choice_stamps_the_router_fields(self) -> None:
        """Kept or moved, the choice's decision carries the router's strategy name and the decision's duration."""
        router = _router()
        kept, _ = router.decide(_request("r1", objectives=Objectives(ttft_s=5.0)))
        _queue(router, "b0", 4000)
        moved, _ = router.decide(_request("r2", objectives=Objectives(ttft_s=1.0)))
        assert kept.reason == "hash" and moved.reason == SLO_REASON
        for decision in (kept, moved):
            assert decision.strategy == router.strategy_name and decision.duration_s > 0

    def test_choose_without_a_stamp_keeps_the_strategy_fields(self) -> None:
        """Called without the router's stamp, `choose` keeps the strategy's name and duration."""
        router = _router()
        state = router.fleet.get("b0")
        pick = Decision(state.backend, reason="hash", strategy="mine", duration_s=0.25)
        assert router.slo is not None
        decision, _ = router.slo.choose(_request("r1"), pick, state, router.fleet.candidates("m"))
        assert decision.strategy == "mine" and decision.duration_s == 0.25


class TestLargeFleet:
    def test_meeting_candidate_found_outside_the_window(self) -> None:
        """On a fleet larger than the scan window, a candidate that meets is found wherever it is."""
        router = _router(12, scan=2)
        for i in range(12):
            if i != 7:
                _queue(router, f"b{i}", 5000 + i)
        for rid in ("r1", "r2", "r3", "r4"):
            decision, _ = router.decide(_request(rid, objectives=Objectives(ttft_s=1.5)))
            assert decision.backend.id == "b7", rid
            assert decision.prediction is not None and decision.prediction.meets(Objectives(ttft_s=1.5))


def _reference(slo: SloChoice, request: RouteRequest, home_id: str, candidates: Sequence[BackendState]) -> str:
    """The choice written plainly: every candidate predicted with `Predictor.predict` (the simple model)."""
    import math

    predictor, view = slo.predictor, slo.view
    now = slo.clock()
    blocks = view.blocks(request)
    by_id = {c.id: c for c in candidates}
    home_state = by_id[home_id]

    def predict(c: BackendState) -> tuple[float, float]:
        p = predictor.predict(c, max(blocks.units - view.matched(c.id, blocks), 0), now=now)
        return p.ttft_s, p.tpot_s or 0.0

    objectives = request.objectives
    wants = objectives is not None and objectives.any
    ttft_goal = math.inf if not wants or objectives.ttft_s is None else objectives.ttft_s  # type: ignore[union-attr]
    tpot_goal = math.inf if not wants or objectives.tpot_s is None else objectives.tpot_s  # type: ignore[union-attr]

    def meets(p: tuple[float, float]) -> bool:
        return p[0] <= ttft_goal and p[1] <= tpot_goal

    def cost(p: tuple[float, float]) -> float:
        return p[0] + slo.tpot_weight * p[1]

    home = predict(home_state)
    if len(candidates) == 1 or (wants and meets(home)):
        return home_id
    fair = (sum(c.in_flight for c in candidates) + 1) / sum(c.weight for c in candidates)

    def within(c: BackendState) -> bool:
        return c.in_flight < max(slo.min_capacity, math.ceil(slo.load_factor * c.weight * fair))

    n = len(candidates)
    order = list(candidates)
    if n - 1 > slo.scan:
        start = hash64(request.request_id) % n
        order = order[start:] + order[:start]
    windows = [order[: slo.scan + 1], order[slo.scan + 1 :]] if n - 1 > slo.scan else [order]
    if not wants:
        windows = windows[:1]
    best, best_key = home_id, (wants and meets(home), -cost(home))
    for k, window in enumerate(windows):
        if k and best_key[0]:
            break
        for c in window:
            if c.id != home_id and within(c):
                p = predict(c)
                key = (wants and meets(p), -cost(p))
                if key > best_key:
                    best, best_key = c.id, key
    if wants and not best_key[0]:
        if slo.unmet_policy == "home":
            return home_id
        if slo.unmet_policy == "sink":
            ttfts = [(predict(c)[0], c.id) for c in order]
            worst = max(t for t, _ in ttfts)
            return home_id if home[0] >= worst else next(i for t, i in ttfts if t == worst)
    return best


class TestAgainstReference:
    @pytest.mark.parametrize("seed", range(40))
    def test_same_choice_as_predicting_every_candidate(self, seed: int) -> None:
        """The pruned choice (kept bases, bounds before cache lookups) picks what predicting every candidate does."""
        import random

        from kvroute import EngineLoad

        rng = random.Random(seed)
        n = rng.choice([2, 3, 5, 12, 20])
        fleet = Fleet()
        for i in range(n):
            fleet.add(Backend(f"b{i}", weight=rng.choice([1.0, 1.0, 2.0])))
        slo = SloChoice(
            Predictor(PRIORS),
            unmet=rng.choice(["home", "cheapest", "sink"]),
            scan=rng.choice([2, 4, 8]),
            min_capacity=rng.choice([0, 1, 4]),
            tpot_weight=rng.choice([0.0, 50.0]),
        )
        router = Router(fleet, Home(), slo=slo)
        for i in range(rng.randrange(0, 3 * n)):  # some prompts held by some backends
            lease = router.acquire(_request(f"w{i}", words=rng.choice([200, 800]), prefix=f"p{rng.randrange(4)}"))
            if rng.random() < 0.5:
                router.release(lease)
        for state in fleet:
            if rng.random() < 0.5:
                _queue(router, state.id, rng.randrange(0, 6000))
            if rng.random() < 0.3:
                state.load = EngineLoad(running=rng.randrange(0, 60), waiting=rng.randrange(0, 4))
        for j in range(6):
            objectives = rng.choice(
                [None, Objectives(ttft_s=rng.choice([0.5, 1.0, 3.0])), Objectives(ttft_s=2.0, tpot_s=0.021)]
            )
            request = _request(
                f"q{seed}-{j}", words=rng.choice([200, 800]), objectives=objectives, prefix=f"p{rng.randrange(4)}"
            )
            candidates = fleet.candidates(request.model)
            expected = _reference(slo, request, "b0", candidates)
            decision, state = router.decide(request)
            assert decision.backend.id == expected == state.id
            assert decision.prediction is not None
            p = slo.predictor.predict(
                state, max(slo.view.blocks(request).units - slo.view.matched(state.id, slo.view.blocks(request)), 0)
            )
            assert decision.prediction.ttft_s == pytest.approx(
                p.ttft_s
            ) and decision.prediction.tpot_s == pytest.approx(p.tpot_s)
