"""Outlier detection: every attempt's outcome and first-byte time, per backend and for the fleet.

The forwarder reports each attempt (`OutlierDetector.succeeded`, `OutlierDetector.failed`); the
detector keeps, per backend, the gateway errors and expired first-byte deadlines in a row and the
outcomes and first-byte times of the last ``window`` seconds, and for the fleet the first-byte times
of like requests (`Likeness`: streamed or not, uncached prompt size, and for whole answers the
generation budget). From those it answers two questions:

- `OutlierDetector.deadline`: how long an attempt may wait for its first byte before it is cancelled
  and retried elsewhere: ``deadline_factor`` times the fleet's p95 for like requests, at least the
  floor, at most the hard first-byte timeout.
- whether a backend is an outlier, for one of the `Cause` s; it is then ejected (through the health
  checker, so the fleet and strategies see it) for an exponentially growing time, within the largest
  ejected share of the fleet, and returns only when a probe request succeeds (`OutlierDetector.run`).

Nothing here does I/O on the request path; probes run in the health checker's task group.
"""

from __future__ import annotations

import collections
import math
import time
from collections.abc import Awaitable, Callable, Iterable
from enum import StrEnum
from typing import Any

import anyio
import attrs
import structlog

from kvroute_server.config import OutlierConfig, TimeoutConfig

__all__ = ["Cause", "Likeness", "OutlierDetector", "likeness"]

log = structlog.get_logger(__name__)

#: First-byte samples kept per like-request class for the fleet, and per backend.
_FLEET_SAMPLES = 256
_BACKEND_SAMPLES = 64
#: Samples a class needs before its p95 sets a deadline.
_MIN_CLASS_SAMPLES = 8
#: Samples (in the window) a backend and the rest of the fleet each need before first-byte times are compared.
_MIN_LATENCY_SAMPLES = 8
#: A backend's first-byte time must also exceed the fleet's by this many seconds to be slow (timer jitter).
_LATENCY_SLACK_S = 0.05
#: A backend is judged at most this often (seconds) by the rate rules.
_JUDGE_EVERY_S = 1.0
#: Other backends with outcomes in the window needed before a success rate is compared with theirs.
_MIN_PEERS = 2


class Cause(StrEnum):
    """Why a backend was ejected as an outlier: the ``cause`` label of ``kvroute_ejections_total``."""

    CONSECUTIVE_ERRORS = "consecutive_errors"
    DEADLINES = "first_byte_deadlines"
    SUCCESS_RATE = "success_rate"
    SLOW_FIRST_BYTE = "slow_first_byte"


@attrs.frozen
class Likeness:
    """Requests whose first byte should take about as long: streamed or not, and size classes (log2)."""

    stream: bool
    prompt: int
    output: int


def _log2_class(n: int | None) -> int:
    return -1 if n is None else max(0, int(n)).bit_length()


def likeness(stream: bool, uncached_tokens: int, max_tokens: int | None) -> Likeness:
    """The class of a request: a whole answer's first byte comes after its generation, so its budget counts."""
    return Likeness(stream, _log2_class(uncached_tokens), -1 if stream else _log2_class(max_tokens))


def _median(values: list[float]) -> float:
    values = sorted(values)
    return values[len(values) // 2]


def _quantile(values: Iterable[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(q * len(ordered)) - 1)]


@attrs.define
class _Record:
    """What is known about one backend."""

    errors_in_a_row: int = 0
    deadlines_in_a_row: int = 0
    #: ``(time, ok)`` per attempt in the window, and how many of them are ok (kept as they come and go).
    outcomes: collections.deque[tuple[float, bool]] = attrs.field(factory=collections.deque)
    ok: int = 0
    #: ``Likeness -> (time, seconds)`` of its first bytes.
    first_bytes: dict[Likeness, collections.deque[tuple[float, float]]] = attrs.field(factory=dict)
    judged_at: float = 0.0
    #: Ejections in a row (the back-off's exponent); decays by one per ``max_ejection`` spent in rotation.
    level: int = 0
    ejected: Cause | None = None
    ejected_at: float = 0.0
    until: float = 0.0
    returned_at: float = 0.0
    probing: bool = False
    #: A model the backend served (for the probe request).
    model: str | None = None


class OutlierDetector:
    """Judges every backend on the outcomes of its attempts; ejects and probes through the given callbacks.

    ``eject(id, cause, message)`` and ``restore(id)`` change the fleet (the health checker's);
    ``probe(id, model, timeout)`` sends small completions and returns the seconds the whole one took (None
    when one failed);
    ``fleet_ids()`` lists the backends now in the fleet.
    """

    def __init__(
        self,
        config: OutlierConfig,
        timeouts: TimeoutConfig,
        *,
        eject: Callable[[str, str, str], bool],
        restore: Callable[[str], None],
        probe: Callable[[str, str | None, float], Awaitable[float | None]],
        fleet_ids: Callable[[], Iterable[str]],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.timeouts = timeouts
        self._eject = eject
        self._restore = restore
        self._probe = probe
        self._fleet_ids = fleet_ids
        self.clock = clock
        self._records: dict[str, _Record] = {}
        self._fleet: dict[Likeness, collections.deque[float]] = {}
        self._p95: dict[Likeness, tuple[int, float]] = {}
        self._added: dict[Likeness, int] = collections.Counter()
        self._wake = anyio.Event()

    def _record(self, backend_id: str) -> _Record:
        record = self._records.get(backend_id)
        if record is None:
            record = self._records[backend_id] = _Record()
        return record

    def configure(self, config: OutlierConfig, timeouts: TimeoutConfig) -> None:
        """Use these settings from now on (the proxy's, given once at start)."""
        self.config, self.timeouts = config, timeouts

    def forget(self, backend_id: str) -> None:
        """Drop what is known about a removed backend."""
        self._records.pop(backend_id, None)

    def holds(self, backend_id: str) -> bool:
        """Whether the backend is ejected as an outlier (health probes passing must not bring it back)."""
        record = self._records.get(backend_id)
        return record is not None and record.ejected is not None

    def suspects(self) -> set[str]:
        """Backends whose last attempt failed (a retry avoids them while others are left)."""
        return {b for b, r in self._records.items() if r.errors_in_a_row}

    def untrusted(self, ids: Iterable[str]) -> set[str]:
        """Of ``ids``, those not known to answer: no success in the window, or the last attempt failed."""
        records = self._records
        return {b for b in ids if (r := records.get(b)) is None or r.errors_in_a_row or not r.ok}

    # -- the deadline ---------------------------------------------------------------------

    def deadline(self, like: Likeness) -> float:
        """Seconds an attempt of this class may wait for its first byte before it is retried elsewhere.

        The fleet's p95 for the class times the factor, within ``[deadline_floor, first_byte]``. A class
        with too few samples borrows the slowest p95 of the classes that have enough, among those with its
        streaming and budget first, else among those with its streaming (never extrapolated beyond what
        was seen); before anything like it was seen, the floor.
        """
        t = self.timeouts
        if t.deadline_factor <= 0:
            return t.first_byte
        expected = self._expected(like)
        if expected is None:
            return min(t.deadline_floor, t.first_byte)
        return min(t.first_byte, max(t.deadline_floor, t.deadline_factor * expected))

    def _expected(self, like: Likeness) -> float | None:
        found = self._class_p95(like)
        if found is not None:
            return found
        same_budget: list[float] = []
        same_kind: list[float] = []
        for other in list(self._fleet):
            if other.stream != like.stream:
                continue
            p95 = self._class_p95(other)
            if p95 is not None:
                same_kind.append(p95)
                if other.output == like.output:
                    same_budget.append(p95)
        borrowed = same_budget or same_kind
        return max(borrowed) if borrowed else None

    def _class_p95(self, like: Likeness) -> float | None:
        samples = self._fleet.get(like)
        if samples is None or len(samples) < _MIN_CLASS_SAMPLES:
            return None
        added = self._added[like]
        cached = self._p95.get(like)
        if cached is None or added - cached[0] >= 16:
            cached = self._p95[like] = (added, _quantile(samples, 0.95))
        return cached[1]

    # -- outcomes ---------------------------------------------------------------------------

    def succeeded(self, backend_id: str, like: Likeness, first_byte: float | None, model: str | None) -> None:
        """An attempt answered well; ``first_byte`` seconds from sending to its first byte (None: no sample,
        as for a 4xx, which is the client's fault but says nothing of the backend's speed)."""
        now = self.clock()
        record = self._record(backend_id)
        record.model = model or record.model
        if record.ejected is not None:
            return  # an attempt that was in flight when it was ejected: its probe request decides
        record.errors_in_a_row = record.deadlines_in_a_row = 0
        record.outcomes.append((now, True))
        record.ok += 1
        if first_byte is not None:
            samples = record.first_bytes.get(like)
            if samples is None:
                samples = record.first_bytes[like] = collections.deque(maxlen=_BACKEND_SAMPLES)
            samples.append((now, first_byte))
            fleet = self._fleet.get(like)
            if fleet is None:
                fleet = self._fleet[like] = collections.deque(maxlen=_FLEET_SAMPLES)
            fleet.append(first_byte)
            self._added[like] += 1
        self._judge(backend_id, record, now)

    def failed(self, backend_id: str, reason: str, *, deadline: bool = False) -> None:
        """An attempt failed for a reason of the backend's (5xx, gateway error, bad answer, expired deadline)."""
        now = self.clock()
        record = self._record(backend_id)
        if record.ejected is not None:
            return  # an attempt that was in flight when it was ejected: its probe request decides
        record.outcomes.append((now, False))
        record.errors_in_a_row += 1
        record.deadlines_in_a_row = record.deadlines_in_a_row + 1 if deadline else 0
        config = self.config
        if deadline and 0 < config.consecutive_deadlines <= record.deadlines_in_a_row:
            self._try_eject(backend_id, record, Cause.DEADLINES, f"{record.deadlines_in_a_row} deadlines in a row")
        elif 0 < config.consecutive_errors <= record.errors_in_a_row:
            message = f"{record.errors_in_a_row} errors in a row, the last {reason}"
            self._try_eject(backend_id, record, Cause.CONSECUTIVE_ERRORS, message)
        else:
            self._judge(backend_id, record, now)

    def _judge(self, backend_id: str, record: _Record, now: float) -> None:
        """Apply the rate rules (at most every `_JUDGE_EVERY_S`)."""
        if record.ejected is not None or now - record.judged_at < _JUDGE_EVERY_S or not self.config.enabled:
            return
        record.judged_at = now
        horizon = now - self.config.window
        for other in self._records.values():
            outcomes = other.outcomes
            while outcomes and outcomes[0][0] < horizon:
                other.ok -= outcomes.popleft()[1]
        if len(record.outcomes) < self.config.min_requests:
            return
        verdict = self._success_rate(backend_id, record) or self._slow(backend_id, record, horizon)
        if verdict is not None:
            self._try_eject(backend_id, record, *verdict)

    def _success_rate(self, backend_id: str, record: _Record) -> tuple[Cause, str] | None:
        ratio = self.config.success_rate_ratio
        if ratio <= 0:
            return None
        rate = record.ok / len(record.outcomes)
        peers = [r for b, r in self._records.items() if b != backend_id and r.ejected is None and r.outcomes]
        if len(peers) < _MIN_PEERS:
            return None
        fleet_rate = sum(r.ok for r in peers) / sum(len(r.outcomes) for r in peers)
        if rate < ratio * fleet_rate:
            return Cause.SUCCESS_RATE, f"success rate {rate:.2f} against the fleet's {fleet_rate:.2f}"
        return None

    def _slow(self, backend_id: str, record: _Record, horizon: float) -> tuple[Cause, str] | None:
        """First-byte times against the rest of the fleet's for the same classes (median of per-sample ratios)."""
        factor = self.config.latency_factor
        if factor <= 0:
            return None
        ratios: list[float] = []
        excess: list[float] = []
        for like, samples in record.first_bytes.items():
            own = [s for at, s in samples if at >= horizon]
            if not own:
                continue
            others = [
                s
                for b, r in self._records.items()
                if b != backend_id
                for at, s in r.first_bytes.get(like, ())
                if at >= horizon
            ]
            if len(others) < _MIN_LATENCY_SAMPLES:
                continue
            typical = _median(others)
            ratios.extend(s / max(typical, 1e-6) for s in own)
            excess.extend(s - typical for s in own)
        if len(ratios) < _MIN_LATENCY_SAMPLES:
            return None
        ratio, extra = _median(ratios), _median(excess)
        if ratio > factor and extra > _LATENCY_SLACK_S:
            return Cause.SLOW_FIRST_BYTE, f"first byte {ratio:.1f}x the fleet's for like requests (+{extra:.3f} s)"
        return None

    # -- ejection and return ------------------------------------------------------------------

    def _try_eject(self, backend_id: str, record: _Record, cause: Cause, message: str) -> None:
        if not self.config.enabled or record.ejected is not None:
            return
        ids = list(self._fleet_ids())
        held = sum(1 for b in ids if self.holds(b))
        allowed = math.floor(self.config.max_ejected_share * len(ids))
        if held + 1 > allowed:
            log.warning("outlier_not_ejected", backend=backend_id, cause=str(cause), reason=message, ejected=held)
            record.errors_in_a_row = record.deadlines_in_a_row = 0
            return
        now = self.clock()
        duration = min(self.config.max_ejection, self.config.base_ejection * 2.0**record.level)
        if not self._eject(backend_id, str(cause), f"{message}; out for {duration:g} s"):
            return
        record.level += 1
        record.ejected, record.ejected_at, record.until = cause, now, now + duration
        record.errors_in_a_row = record.deadlines_in_a_row = 0
        record.outcomes.clear()
        record.ok = 0
        record.first_bytes.clear()
        self._wake.set()

    def describe(self, backend_id: str) -> dict[str, Any] | None:
        """The status page's view of an ejected backend (``None`` when it is not ejected as an outlier)."""
        record = self._records.get(backend_id)
        if record is None or record.ejected is None:
            return None
        return {
            "cause": str(record.ejected),
            "level": record.level,
            "returns_in_s": round(max(0.0, record.until - self.clock()), 3),
            "probing": record.probing,
        }

    async def run(self, *, task_status: Any = anyio.TASK_STATUS_IGNORED) -> None:
        """Probe each ejected backend once its back-off is over; restore it when the probe succeeds."""
        task_status.started()
        async with anyio.create_task_group() as tg:
            while True:
                now = self.clock()
                wait = self.config.max_ejection
                for backend_id, record in list(self._records.items()):
                    self._decay(record, now)
                    if record.ejected is None or record.probing:
                        continue
                    if record.until <= now:
                        record.probing = True
                        tg.start_soon(self._probe_one, backend_id, record)
                    else:
                        wait = min(wait, record.until - now)
                with anyio.move_on_after(max(wait, 0.05)):
                    await self._wake.wait()
                self._wake = anyio.Event()

    def _probe_limit(self) -> float | None:
        """The longest a probe's one-token whole answer may take: ``latency_factor`` times the fleet's median for
        its smallest class of whole answers with data (a probe is no larger), plus the slack; None when unknown."""
        if self.config.latency_factor <= 0:
            return None
        known = [
            like for like, samples in self._fleet.items() if not like.stream and len(samples) >= _MIN_CLASS_SAMPLES
        ]
        if not known:
            return None
        smallest = min(known, key=lambda like: (like.prompt, like.output))
        return self.config.latency_factor * _median(list(self._fleet[smallest])) + _LATENCY_SLACK_S

    def _decay(self, record: _Record, now: float) -> None:
        """One level of back-off is forgiven per ``max_ejection`` seconds spent back in rotation."""
        if record.ejected is None and record.level and now - record.returned_at >= self.config.max_ejection:
            record.level -= 1
            record.returned_at = now

    async def _probe_one(self, backend_id: str, record: _Record) -> None:
        timeout = self.deadline(likeness(False, 1, 1))
        try:
            seconds = await self._probe(backend_id, record.model, timeout)
        finally:
            record.probing = False
        limit = self._probe_limit()
        ok = seconds is not None and (limit is None or seconds <= limit)
        if self._records.get(backend_id) is not record:
            return  # removed meanwhile
        now = self.clock()
        if ok:
            record.outcomes.clear()  # judged afresh: nothing from before its ejection counts
            record.ok = 0
            record.first_bytes.clear()
            record.ejected = None
            record.returned_at = now
            record.judged_at = now
            log.warning("outlier_probe_passed", backend=backend_id, level=record.level)
            self._restore(backend_id)
        else:
            duration = min(self.config.max_ejection, self.config.base_ejection * 2.0**record.level)
            record.level += 1
            record.until = now + duration
            log.warning(
                "outlier_probe_failed", backend=backend_id, level=record.level, out_for_s=duration, took_s=seconds
            )
        self._wake.set()
