"""The outlier detector on its own: its rules, the ejected share, the back-off, probes, and the first-byte deadline."""

from __future__ import annotations

from typing import Any

import anyio
import attrs
import pytest

from kvroute.backend import Backend
from kvroute.fleet import Fleet as CoreFleet
from kvroute_server.config import HealthConfig, OutlierConfig, TimeoutConfig
from kvroute_server.fleet.health import HealthChecker
from kvroute_server.fleet.outliers import Cause, OutlierDetector, likeness
from kvroute_server.ops.metrics import ProxyMetrics

LIKE = likeness(True, 500, None)


@attrs.define
class Fleet:
    """The detector's callbacks, recorded, with a clock the test moves."""

    ids: list[str]
    now: float = 1000.0
    ejected: list[tuple[str, str]] = attrs.field(factory=list)
    restored: list[str] = attrs.field(factory=list)
    probes: list[tuple[str, str | None, float]] = attrs.field(factory=list)
    #: What each probe answers: True (passed, in 0.01 s), False (failed), or the seconds it took.
    probe_answers: list[bool | float] = attrs.field(factory=list)

    def detector(self, **config: Any) -> OutlierDetector:
        timeouts = config.pop("timeouts", TimeoutConfig(first_byte=300.0, deadline_floor=2.0, deadline_factor=4.0))
        return OutlierDetector(
            OutlierConfig(**config),
            timeouts,
            eject=self.eject,
            restore=self.restored.append,
            probe=self.probe,
            fleet_ids=lambda: self.ids,
            clock=lambda: self.now,
        )

    def eject(self, backend_id: str, cause: str, message: str) -> bool:
        self.ejected.append((backend_id, cause))
        return True

    async def probe(self, backend_id: str, model: str | None, seconds: float) -> float | None:
        self.probes.append((backend_id, model, seconds))
        answer = self.probe_answers.pop(0)
        return answer if isinstance(answer, float) else (0.01 if answer else None)


def _traffic(d: OutlierDetector, fleet: Fleet, rounds: int, bad: dict[str, float], slow: dict[str, float]) -> None:
    """``rounds`` attempts per backend, 0.1 s apart: backends in ``bad`` fail that share, those in ``slow``
    answer that many times slower (first byte 0.2 s otherwise)."""
    for i in range(rounds):
        fleet.now += 0.1
        for b in fleet.ids:
            share = bad.get(b, 0.0)
            if share and (i % round(1 / share)) == 0:
                d.failed(b, "upstream_5xx")
            else:
                d.succeeded(b, LIKE, 0.2 * slow.get(b, 1.0) * (1 + (i % 5) / 10), "m")


class TestRules:
    def test_five_errors_in_a_row_eject(self) -> None:
        """The fifth gateway error in a row ejects (cause consecutive_errors); four do not, and a success resets."""
        fleet = Fleet(["a", "b", "c"])
        d = fleet.detector()
        for _ in range(4):
            d.failed("a", "upstream_5xx")
        d.succeeded("a", LIKE, 0.2, "m")
        for _ in range(4):
            d.failed("a", "upstream_5xx")
        assert fleet.ejected == []
        d.failed("a", "upstream_5xx")
        assert fleet.ejected == [("a", "consecutive_errors")]
        assert d.holds("a") and d.describe("a") == {
            "cause": "consecutive_errors",
            "level": 1,
            "returns_in_s": 10.0,
            "probing": False,
        }

    def test_expired_deadlines_in_a_row_eject(self) -> None:
        """Three expired first-byte deadlines in a row eject for that cause, before the error count would."""
        fleet = Fleet(["a", "b", "c"])
        d = fleet.detector()
        for _ in range(3):
            d.failed("a", "first_byte_deadline", deadline=True)
        assert fleet.ejected == [("a", str(Cause.DEADLINES))]

    def test_low_success_rate_against_the_fleet_ejects(self) -> None:
        """A backend failing a third of its attempts (never five in a row) is ejected for its success rate."""
        fleet = Fleet(["a", "b", "c", "d"])
        d = fleet.detector()
        _traffic(d, fleet, 40, bad={"a": 1 / 3}, slow={})
        assert fleet.ejected == [("a", "success_rate")]

    def test_fleet_wide_errors_eject_nobody_for_success_rate(self) -> None:
        """When every backend fails alike, none is below the rest of the fleet: no success-rate ejection."""
        fleet = Fleet(["a", "b", "c", "d"])
        d = fleet.detector()
        _traffic(d, fleet, 60, bad=dict.fromkeys(fleet.ids, 1 / 3), slow={})
        assert fleet.ejected == []

    def test_slow_first_bytes_for_like_requests_eject(self) -> None:
        """A backend whose first bytes take ten times its peers' for the same prompt size is ejected, with no error."""
        fleet = Fleet(["a", "b", "c", "d"])
        d = fleet.detector()
        _traffic(d, fleet, 40, bad={}, slow={"a": 10.0})
        assert fleet.ejected == [("a", "slow_first_byte")]

    def test_slow_only_because_its_prompts_are_larger_is_no_outlier(self) -> None:
        """First-byte times are compared within a prompt-size class: long prompts on one backend are not slowness."""
        fleet = Fleet(["a", "b", "c", "d"])
        d = fleet.detector()
        long_prompt = likeness(True, 64_000, None)
        for i in range(40):
            fleet.now += 0.1
            d.succeeded("a", long_prompt, 2.0 + (i % 5) / 10, "m")
            d.succeeded("a", LIKE, 0.2, "m")
            for b in ("b", "c", "d"):
                d.succeeded(b, LIKE, 0.2 + (i % 5) / 50, "m")
        assert fleet.ejected == []

    def test_healthy_variance_ejects_nobody(self) -> None:
        """A fleet whose times vary threefold from request to request (seeded) sees no ejection in 3,000 attempts."""
        import random

        rng = random.Random(25)
        fleet = Fleet([f"e{i}" for i in range(6)])
        d = fleet.detector()
        for _ in range(500):
            fleet.now += 0.05
            for b in fleet.ids:
                if rng.random() < 0.01:
                    d.failed(b, "upstream_5xx")
                else:
                    d.succeeded(b, likeness(True, rng.choice([200, 2000, 8000]), None), rng.uniform(0.1, 0.3), "m")
        assert fleet.ejected == []

    def test_disabled_ejects_nothing(self) -> None:
        """With outlier detection off nothing is ejected."""
        fleet = Fleet(["a", "b", "c"])
        d = fleet.detector(enabled=False)
        for _ in range(10):
            d.failed("a", "upstream_5xx")
        assert fleet.ejected == []


class TestEjection:
    def test_attempts_ending_while_ejected_do_not_count(self) -> None:
        """Attempts that were in flight at the ejection and fail later do not count against the backend once back."""
        fleet = Fleet(["a", "b", "c", "d"])
        d = fleet.detector(consecutive_errors=0, consecutive_deadlines=3, min_requests=20)
        _traffic(d, fleet, 30, bad={}, slow={})
        for _ in range(3):
            d.failed("a", "first_byte_deadline", deadline=True)
        assert fleet.ejected == [("a", "first_byte_deadlines")]
        for _ in range(20):  # the attempts it held expire one by one
            d.failed("a", "first_byte_deadline", deadline=True)
        d._records["a"].ejected = None  # as a passing probe leaves it
        _traffic(d, fleet, 30, bad={}, slow={})
        assert fleet.ejected == [("a", "first_byte_deadlines")]

    def test_max_ejected_share(self) -> None:
        """With three backends and a share of 0.5, only one is ejected at a time; the other keeps its place."""
        fleet = Fleet(["a", "b", "c"])
        d = fleet.detector(max_ejected_share=0.5)
        for _ in range(5):
            d.failed("a", "upstream_5xx")
            d.failed("b", "upstream_5xx")
        assert fleet.ejected == [("a", "consecutive_errors")]
        assert not d.holds("b")

    @pytest.mark.anyio
    async def test_back_off_doubles_and_a_passing_probe_restores(self) -> None:
        """A failed probe doubles the back-off; once the back-off is over a passing probe restores the backend."""
        fleet = Fleet(["a", "b", "c"], probe_answers=[False, True])
        d = fleet.detector(base_ejection=10.0, max_ejection=300.0)
        for _ in range(5):
            d.failed("a", "upstream_5xx")
        d.succeeded("b", LIKE, 0.2, "served-model")
        async with anyio.create_task_group() as tg:
            await tg.start(d.run)
            await anyio.sleep(0.1)
            assert fleet.probes == []  # still within its 10 s
            fleet.now += 10.0
            d._wake.set()
            with anyio.fail_after(5):
                while d.describe("a") is None or d.describe("a")["level"] < 2:  # type: ignore[index]  # noqa: ASYNC110
                    await anyio.sleep(0.01)
            assert d.describe("a")["returns_in_s"] == 20.0  # type: ignore[index]
            assert fleet.restored == []
            fleet.now += 20.0
            d._wake.set()
            with anyio.fail_after(5):
                while not fleet.restored:  # noqa: ASYNC110 - the detector's task fills it
                    await anyio.sleep(0.01)
            tg.cancel_scope.cancel()
        assert fleet.restored == ["a"] and not d.holds("a")
        assert [p[0] for p in fleet.probes] == ["a", "a"]
        assert fleet.probes[0][2] == 2.0  # the probe waits the deadline of a one-token prompt: the floor here

    @pytest.mark.anyio
    async def test_probe_slower_than_the_fleet_fails(self) -> None:
        """A probe that answers, but ten times slower than the fleet's smallest whole answers, does not restore."""
        fleet = Fleet(["a", "b", "c"], probe_answers=[2.0, 0.1])
        d = fleet.detector(base_ejection=10.0)
        for _ in range(10):
            d.succeeded("b", likeness(False, 40, 4), 0.2, "m")
            d.succeeded("c", likeness(False, 4000, 32), 1.5, "m")
        for _ in range(5):
            d.failed("a", "upstream_5xx")
        async with anyio.create_task_group() as tg:
            await tg.start(d.run)
            fleet.now += 10.0
            d._wake.set()
            with anyio.fail_after(5):
                while len(fleet.probes) < 1 or d.describe("a")["probing"]:  # type: ignore[index]  # noqa: ASYNC110
                    await anyio.sleep(0.01)
            assert fleet.restored == [] and d.describe("a")["level"] == 2  # type: ignore[index]
            fleet.now += 20.0
            d._wake.set()
            with anyio.fail_after(5):
                while not fleet.restored:  # noqa: ASYNC110 - the detector's task fills it
                    await anyio.sleep(0.01)
            tg.cancel_scope.cancel()
        assert fleet.restored == ["a"]


class TestDeadline:
    def test_floor_before_anything_like_it(self) -> None:
        """Before the fleet answered anything like the request, the deadline is the floor."""
        fleet = Fleet(["a"])
        assert fleet.detector().deadline(LIKE) == 2.0

    @pytest.mark.parametrize(
        ("seconds", "expected"), [(0.1, 2.0), (1.0, 4.0), (100.0, 300.0)], ids=["floor", "factor", "cap"]
    )
    def test_factor_times_p95_within_floor_and_cap(self, seconds: float, expected: float) -> None:
        """The deadline is four times the fleet's p95 for the class, no less than the floor, no more than the cap."""
        fleet = Fleet(["a", "b"])
        d = fleet.detector()
        for i in range(20):
            d.succeeded("ab"[i % 2], LIKE, seconds, "m")
        assert d.deadline(LIKE) == pytest.approx(expected)

    def test_class_without_data_borrows_the_slowest_like_class(self) -> None:
        """A prompt size not seen yet borrows the slowest p95 among classes of its kind (no extrapolation)."""
        fleet = Fleet(["a"])
        d = fleet.detector()
        for _ in range(10):
            d.succeeded("a", LIKE, 1.0, "m")
            d.succeeded("a", likeness(True, 40, None), 0.5, "m")
            d.succeeded("a", likeness(False, 500, 16), 30.0, "m")  # a whole answer: another kind
        assert d.deadline(likeness(True, 64_000, None)) == pytest.approx(4.0 * 1.0)
        assert d.deadline(likeness(False, 500, 16)) == pytest.approx(4.0 * 30.0)

    def test_factor_zero_is_the_hard_timeout(self) -> None:
        """``deadline_factor = 0`` turns the per-attempt deadline off: every attempt waits the hard timeout."""
        fleet = Fleet(["a"])
        d = fleet.detector(timeouts=TimeoutConfig(first_byte=30.0, deadline_factor=0.0))
        assert d.deadline(LIKE) == 30.0


class TestHealthCheckerHoldsOutliers:
    def _checker(self) -> tuple[HealthChecker, CoreFleet, ProxyMetrics]:
        fleet = CoreFleet([Backend("a", url="http://127.0.0.1:9"), Backend("b", url="http://127.0.0.1:9")])
        metrics = ProxyMetrics(fleet, "random")
        checker = HealthChecker(fleet, lambda _: None, lambda _: None, HealthConfig(), metrics)  # type: ignore[arg-type,return-value]
        return checker, fleet, metrics

    def test_already_out_is_counted_under_the_outlier_cause(self) -> None:
        """A backend already out (a connection error) that becomes an outlier is counted under the outlier's cause."""
        checker, fleet, metrics = self._checker()
        checker.connection_failed("a", "refused")
        assert not fleet.get("a").healthy
        assert checker._eject_outlier("a", "consecutive_errors", "5 errors in a row")
        assert metrics.ejections.labels("a", "consecutive_errors")._value.get() == 1
        assert metrics.ejections.labels("a", "passive")._value.get() == 1

    def test_restore_waits_for_failing_health_probes(self) -> None:
        """An outlier whose probe request passed stays out while its health probes are failing."""
        checker, fleet, _ = self._checker()
        checker._count("a").failures = checker.config.unhealthy_threshold
        fleet.set_healthy("a", False)
        checker._restore_outlier("a")
        assert not fleet.get("a").healthy
        checker._count("a").failures = 0
        checker._restore_outlier("a")
        assert fleet.get("a").healthy
