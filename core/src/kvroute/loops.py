"""Keeping a background loop alive: retry with capped, jittered exponential back-off, reset by a healthy run.

Every long-running task that must outlive failures (an engine adapter's KV event feed, a discovery
provider's watch, the proxy's restart of a crashed provider) runs its work through `KeepAlive`, so that
they all retry the same way and log the same two lines:

* ``background_loop_failed`` (warning): ``loop`` (its name), ``attempt`` (failures in a row, 1 after a
  healthy run), ``wait_s`` (the back-off before the next run), ``error`` (``Type: message``), and the
  context the loop was given (``backend=...``, ``source=...``). A failure of a type outside ``expected``
  is a bug rather than the weather: its traceback is logged too.
* ``background_loop_recovered`` (info): ``loop``, ``after`` (the failures in a row that ended), and the
  context, when the work says it is going well again (`KeepAlive.healthy`; work that only knows it by
  time calls it once `KeepAlive.running_for` reached ``healthy_after``).

The policy is a `Backoff`: the n-th failure in a row waits ``initial * 2**(n-1)`` seconds, multiplied by a
factor drawn from ``[1 - jitter, 1 + jitter]`` (so that replicas that lost the same server do not come
back in step), then capped at ``maximum``. A run that lasted ``healthy_after`` seconds before it failed,
or a call to `KeepAlive.healthy` (a poll that answered), starts the series over. Cancellation is never
retried, counted or logged: it goes straight through, from the work or from the wait.

The retry loop is tenacity's (`tenacity.AsyncRetrying`): it runs the work, tells failures from
cancellation, and calls the wait and the sleep given here. stamina, the friendlier layer over tenacity,
is not used because it cannot express this policy: it draws its jitter from the global ``random`` (not
seedable per loop), adds it in seconds rather than as a share, has no reset after a healthy run, and its
sleep cannot be injected (its testing mode zeroes every wait instead, so the waits could not be tested).
"""

from __future__ import annotations

import random
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, ParamSpec, TypeVar

import anyio
import attrs

from kvroute.logs import get_logger

if TYPE_CHECKING:
    import tenacity

__all__ = ["Backoff", "KeepAlive", "keep_alive"]

log = get_logger(__name__)

P = ParamSpec("P")
T = TypeVar("T")


def _positive(instance: object, attribute: attrs.Attribute[float], value: float) -> None:
    if not value > 0:
        raise ValueError(f"'{attribute.name}' must be a positive number of seconds (got {value!r}).")


def _not_negative(instance: object, attribute: attrs.Attribute[float], value: float) -> None:
    if not value >= 0:
        raise ValueError(f"'{attribute.name}' must be a number of seconds >= 0 (got {value!r}).")


def _fraction(instance: object, attribute: attrs.Attribute[float], value: float) -> None:
    if not 0 <= value < 1:
        raise ValueError(f"'{attribute.name}' must be in [0, 1) (got {value!r}).")


@attrs.frozen
class Backoff:
    """How a background loop waits between failed runs (see the module docstring).

    ``delay(n)`` is the wait after the n-th failure in a row: ``initial * 2**(n-1)``, times a factor
    from ``[1 - jitter, 1 + jitter]`` drawn from ``rng``, capped at ``maximum``. ``healthy_after``: a run
    that lasted this long before it failed starts the series over. ``seed`` seeds each loop's jitter
    (``None``: from the system), so that tests, and replicas given different seeds, are reproducible.
    """

    initial: float = attrs.field(default=1.0, converter=float, validator=_positive)
    maximum: float = attrs.field(default=30.0, converter=float, validator=_positive)
    jitter: float = attrs.field(default=0.2, converter=float, validator=_fraction)
    healthy_after: float = attrs.field(default=30.0, converter=float, validator=_not_negative)
    seed: int | None = None

    def __attrs_post_init__(self) -> None:
        if self.maximum < self.initial:
            raise ValueError(f"'maximum' must be at least 'initial' (got {self.maximum} < {self.initial}).")

    def delay(self, failures: int, rng: random.Random | None = None) -> float:
        """Seconds to wait after the ``failures``-th failure in a row (>= 1); jitter-free without ``rng``."""
        if failures < 1:
            raise ValueError(f"'failures' must be at least 1 (got {failures}).")
        base = self.initial * 2.0 ** min(failures - 1, 64)
        if self.jitter and rng is not None:
            base *= 1.0 + self.jitter * (2.0 * rng.random() - 1.0)
        return min(base, self.maximum)


def _describe(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    return text if len(text) <= 500 else text[:497] + "..."


class KeepAlive:
    """Runs a loop's work again after each failure, with `Backoff` between runs, until it returns.

    ``name`` is the loop's name in the log lines, ``context`` their other fields. ``retry_on``: the
    failures that are retried (anything else, and cancellation, propagates). ``expected``: the failures
    logged without a traceback. ``sleep``, ``clock`` (seconds, monotonic) and ``rng`` (the jitter) are
    injectable for tests; by default anyio's sleep and clock, and ``random.Random(backoff.seed)``.
    """

    def __init__(
        self,
        name: str,
        backoff: Backoff | None = None,
        *,
        retry_on: type[Exception] | tuple[type[Exception], ...] = Exception,
        expected: tuple[type[BaseException], ...] = (OSError,),
        sleep: Callable[[float], Awaitable[Any]] | None = None,
        clock: Callable[[], float] | None = None,
        rng: random.Random | None = None,
        **context: Any,
    ) -> None:
        self.name = name
        self.backoff = backoff if backoff is not None else Backoff()
        self.retry_on = retry_on
        self.expected = expected
        self.context = context
        # Looked up now rather than at import, so that a test's patch of anyio applies.
        self._sleep = sleep if sleep is not None else anyio.sleep
        self._clock = clock if clock is not None else anyio.current_time
        self._rng = rng if rng is not None else random.Random(self.backoff.seed)
        #: Failures in a row (0 after a healthy run or `healthy`).
        self.failures = 0
        self._began: float | None = None

    @property
    def running_for(self) -> float:
        """Seconds since the current run of the work started (0 before the first)."""
        return 0.0 if self._began is None else self._clock() - self._began

    def delay(self, failures: int) -> float:
        """The wait after the ``failures``-th failure in a row, with this loop's jitter."""
        return self.backoff.delay(failures, self._rng)

    async def back_off(self, failures: int = 1) -> None:
        """Wait as after the ``failures``-th failure in a row, counting nothing (a reconnect that must not spin)."""
        await self._sleep(self.delay(failures))

    def healthy(self) -> None:
        """The work is going well (a poll answered, a list succeeded): the next failure waits ``initial`` again."""
        if self.failures:
            log.info("background_loop_recovered", loop=self.name, after=self.failures, **self.context)
            self.failures = 0

    async def run(self, work: Callable[P, Awaitable[T]], *args: P.args, **kwargs: P.kwargs) -> T:
        """Await ``work(*args, **kwargs)`` until it returns (its value is returned), retrying failures."""

        # Imported here: `import kvroute` (the CLI's start) need not pay for it.
        import tenacity

        async def attempt() -> T:
            self._began = self._clock()
            return await work(*args, **kwargs)

        # One tenacity object per run: it keeps per-iteration state, and loops run concurrently.
        retrying = tenacity.AsyncRetrying(
            retry=tenacity.retry_if_exception_type(self.retry_on),
            stop=tenacity.stop_never,
            wait=self._wait,
            sleep=self._sleep,
            before_sleep=self._failed,
            reraise=True,
        )
        result: T = await retrying(attempt)
        return result

    def _wait(self, state: tenacity.RetryCallState) -> float:
        if self.running_for >= self.backoff.healthy_after:
            self.failures = 0  # it ran long enough to count as healthy: the series starts over
        self.failures += 1
        return self.delay(self.failures)

    def _failed(self, state: tenacity.RetryCallState) -> None:
        assert state.outcome is not None
        exc = state.outcome.exception()
        assert exc is not None
        log.warning(
            "background_loop_failed",
            loop=self.name,
            attempt=self.failures,
            wait_s=round(state.upcoming_sleep, 3),
            error=_describe(exc),
            **self.context,
            **({} if isinstance(exc, self.expected) else {"exc_info": exc}),
        )


async def keep_alive(
    name: str,
    work: Callable[[], Awaitable[T]],
    backoff: Backoff | None = None,
    *,
    retry_on: type[Exception] | tuple[type[Exception], ...] = Exception,
    expected: tuple[type[BaseException], ...] = (OSError,),
    **context: Any,
) -> T:
    """``await KeepAlive(name, backoff, ...).run(work)``: for a loop that never needs `KeepAlive.healthy`."""
    keeper = KeepAlive(name, backoff, retry_on=retry_on, expected=expected, **context)
    return await keeper.run(work)
