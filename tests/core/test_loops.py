"""kvroute.loops: the back-off policy and the runner that keeps a background loop alive."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import anyio
import pytest
from hypothesis import given
from hypothesis import strategies as st
from structlog.testing import capture_logs

from kvroute.loops import Backoff, KeepAlive, keep_alive


class Clock:
    """A fake monotonic clock and sleep: sleeping advances the clock and records the wait, without waiting."""

    def __init__(self) -> None:
        self.now = 0.0
        self.waits: list[float] = []

    def __call__(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.waits.append(seconds)
        self.now += seconds
        await anyio.lowlevel.checkpoint()


def failing(clock: Clock, runs: list[float | None]) -> Callable[[], Any]:
    """Work that, on its n-th run, lasts ``runs[n]`` seconds then raises OSError, or returns "done" when it is None."""
    calls = iter(runs)

    async def work() -> str:
        lasted = next(calls)
        if lasted is None:
            return "done"
        clock.now += lasted
        raise OSError("connection refused")

    return work


def keeper(clock: Clock, backoff: Backoff, **kwargs: Any) -> KeepAlive:
    return KeepAlive("test_loop", backoff, sleep=clock.sleep, clock=clock, **kwargs)


class TestBackoff:
    def test_doubles_up_to_the_cap(self) -> None:
        """Without jitter the n-th failure waits initial * 2**(n-1), capped at maximum, however many failures."""
        backoff = Backoff(initial=0.5, maximum=5, jitter=0)
        assert [backoff.delay(n) for n in range(1, 8)] == [0.5, 1.0, 2.0, 4.0, 5.0, 5.0, 5.0]
        assert backoff.delay(10_000) == 5.0

    @given(
        initial=st.floats(0.01, 10),
        jitter=st.floats(0, 0.99),
        failures=st.integers(1, 80),
        seed=st.integers(0, 2**32),
    )
    def test_jitter_stays_within_its_share_and_the_cap(
        self, initial: float, jitter: float, failures: int, seed: int
    ) -> None:
        """A jittered wait is the plain one times a factor in [1 - jitter, 1 + jitter], never above maximum."""
        backoff = Backoff(initial=initial, maximum=initial * 100, jitter=jitter)
        plain = initial * 2.0 ** (failures - 1)
        wait = backoff.delay(failures, random.Random(seed))
        assert wait <= backoff.maximum
        assert min(plain * (1 - jitter), backoff.maximum) * (1 - 1e-9) <= wait <= plain * (1 + jitter) * (1 + 1e-9)

    def test_jitter_spreads_and_a_seed_repeats_it(self) -> None:
        """The same seed gives the same waits, another seed other waits, and jitter does move them."""
        backoff = Backoff(initial=1, maximum=100, jitter=0.25)
        first = [backoff.delay(n, random.Random(7)) for n in (1, 2, 3)]
        again = [backoff.delay(n, random.Random(7)) for n in (1, 2, 3)]
        other = [backoff.delay(n, random.Random(8)) for n in (1, 2, 3)]
        assert first == again and first != other and first != [1.0, 2.0, 4.0]

    @pytest.mark.parametrize(
        ("kwargs", "message"),
        [
            ({"initial": 0}, "'initial' must be a positive number of seconds (got 0.0)."),
            ({"maximum": -1}, "'maximum' must be a positive number of seconds (got -1.0)."),
            ({"jitter": 1}, "'jitter' must be in [0, 1) (got 1.0)."),
            ({"healthy_after": -1}, "'healthy_after' must be a number of seconds >= 0 (got -1.0)."),
            ({"initial": 2, "maximum": 1}, "'maximum' must be at least 'initial' (got 1.0 < 2.0)."),
        ],
    )
    def test_rejects_bad_values(self, kwargs: dict[str, float], message: str) -> None:
        """Each bad value is refused with a message naming the field, what was expected and what was given."""
        with pytest.raises(ValueError) as caught:
            Backoff(**kwargs)
        assert str(caught.value) == message

    def test_failures_start_at_one(self) -> None:
        """Asking for the wait after zero failures is a mistake, refused."""
        with pytest.raises(ValueError, match="'failures' must be at least 1"):
            Backoff().delay(0)


@pytest.mark.anyio
class TestKeepAlive:
    async def test_retries_with_growing_capped_waits_until_the_work_returns(self) -> None:
        """Each failure in a row waits twice the one before, up to the cap; the work's value is returned."""
        clock = Clock()
        loop = keeper(clock, Backoff(initial=1, maximum=5, jitter=0))
        assert await loop.run(failing(clock, [0, 0, 0, 0, 0, None])) == "done"
        assert clock.waits == [1, 2, 4, 5, 5]

    async def test_a_healthy_run_resets_the_back_off(self) -> None:
        """A run that lasted healthy_after seconds before failing waits initial again; a shorter one does not."""
        clock = Clock()
        loop = keeper(clock, Backoff(initial=1, maximum=30, jitter=0, healthy_after=10))
        await loop.run(failing(clock, [0, 0, 0, 10, 0, 9.9, None]))
        assert clock.waits == [1, 2, 4, 1, 2, 4]

    async def test_healthy_resets_the_back_off_and_logs_the_recovery(self) -> None:
        """healthy() after failures makes the next failure wait initial, and logs background_loop_recovered once."""
        clock = Clock()
        loop = keeper(clock, Backoff(initial=1, maximum=30, jitter=0), backend="b0")
        runs = iter([True, True, False, True, None])

        async def work() -> None:
            step = next(runs)
            if step is None:
                return
            if not step:
                loop.healthy()
                loop.healthy()
            raise OSError("refused")

        with capture_logs() as logs:
            await loop.run(work)
        assert clock.waits == [1, 2, 1, 2]
        recovered = [e for e in logs if e["event"] == "background_loop_recovered"]
        assert recovered == [
            {
                "event": "background_loop_recovered",
                "loop": "test_loop",
                "after": 2,
                "backend": "b0",
                "log_level": "info",
            }
        ]

    async def test_one_log_line_per_failure(self) -> None:
        """Each failure logs background_loop_failed with the loop, attempt, wait, error and context; expected
        failures carry no traceback, others do."""
        clock = Clock()
        errors = iter([OSError("refused"), KeyError("bug")])

        async def work() -> str:
            error = next(errors, None)
            if error is None:
                return "ok"
            raise error

        with capture_logs() as logs:
            await keeper(clock, Backoff(initial=1, jitter=0), backend="b0").run(work)
        failed = [e for e in logs if e["event"] == "background_loop_failed"]
        assert failed[0] == {
            "event": "background_loop_failed",
            "loop": "test_loop",
            "attempt": 1,
            "wait_s": 1.0,
            "error": "OSError: refused",
            "backend": "b0",
            "log_level": "warning",
        }
        assert failed[1]["attempt"] == 2 and failed[1]["error"] == "KeyError: 'bug'"
        assert isinstance(failed[1]["exc_info"], KeyError)

    async def test_jitter_comes_from_the_seeded_policy(self) -> None:
        """Two loops with the same seed wait the same jittered times; the waits are not the plain ones."""
        waits = []
        for _ in range(2):
            clock = Clock()
            await keeper(clock, Backoff(initial=1, maximum=30, jitter=0.5, seed=3)).run(failing(clock, [0, 0, 0, None]))
            waits.append(clock.waits)
        assert waits[0] == waits[1] and waits[0] != [1, 2, 4]

    async def test_other_errors_are_not_retried(self) -> None:
        """A failure outside retry_on propagates at once, without a wait."""
        clock = Clock()

        async def work() -> None:
            raise KeyError("bug")

        with pytest.raises(KeyError):
            await keeper(clock, Backoff(), retry_on=OSError).run(work)
        assert clock.waits == []

    async def test_cancellation_in_the_work_propagates_at_once(self) -> None:
        """Cancelling while the work runs ends the loop without a retry, a wait or a log line."""
        clock = Clock()
        runs = 0

        async def work() -> None:
            nonlocal runs
            runs += 1
            await anyio.sleep_forever()

        with capture_logs() as logs, anyio.CancelScope() as scope:
            async with anyio.create_task_group() as tg:
                tg.start_soon(keeper(clock, Backoff()).run, work)
                await anyio.wait_all_tasks_blocked()
                scope.cancel()
        assert runs == 1 and clock.waits == [] and logs == []

    async def test_cancellation_in_the_wait_propagates(self) -> None:
        """Cancelling during the back-off ends the loop: the wait is not swallowed and the work does not run again."""
        runs = 0

        async def work() -> None:
            nonlocal runs
            runs += 1
            raise OSError("refused")

        with anyio.CancelScope() as scope:

            async def sleep(seconds: float) -> None:
                scope.cancel()
                await anyio.sleep_forever()

            await KeepAlive("test_loop", Backoff(), sleep=sleep).run(work)
        assert scope.cancelled_caught and runs == 1

    async def test_running_for_counts_from_the_current_run(self) -> None:
        """running_for is 0 before any run, then the time since the latest run began, not since the first one."""
        clock = Clock()
        clock.now = 100.0
        loop = keeper(clock, Backoff(initial=5, jitter=0))
        assert loop.running_for == 0
        seen = []

        async def work() -> None:
            clock.now += 2
            seen.append(loop.running_for)
            if len(seen) < 2:
                raise OSError("refused")

        await loop.run(work)
        assert seen == [2, 2] and clock.waits == [5]

    async def test_back_off_waits_without_counting_a_failure(self) -> None:
        """back_off(n) waits the n-th failure's delay and leaves the failure count alone."""
        clock = Clock()
        loop = keeper(clock, Backoff(initial=1, jitter=0))
        await loop.back_off(3)
        assert clock.waits == [4] and loop.failures == 0

    async def test_keep_alive_runs_work_with_the_default_sleep(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """keep_alive() retries through anyio's sleep (patched here, so nothing really waits)."""
        clock = Clock()
        monkeypatch.setattr(anyio, "sleep", clock.sleep)
        assert await keep_alive("test_loop", failing(clock, [0, 0, None]), Backoff(initial=2, jitter=0)) == "done"
        assert clock.waits == [2, 4]
