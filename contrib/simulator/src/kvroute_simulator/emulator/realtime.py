"""The simulator's engine model (`kvroute_simulator.engine.Engine`) driven by the wall clock.

Virtual time is ``(monotonic() - start) / time_scale``: with ``time_scale = 0.1`` the
emulator runs ten times faster than the hardware its cost model describes. Steps are
simulated one at a time (``coalesce_decodes=False``), so every decode step hands each
running request its next token at the step's end, as a real engine streams.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import attrs

from kvroute_simulator.engine import DataParallelEngine, Engine, EngineRequest, EngineSequence

__all__ = ["RealTimeEngine", "Stream"]


@attrs.define(eq=False)
class Stream:
    """Tokens of one request as the engine produces them."""

    seq: EngineSequence
    submitted_at: float
    #: The data-parallel rank serving it.
    rank: int = 0
    emitted: int = 0
    ready: int = 0
    done: bool = False
    first_token_at: float | None = None
    event: asyncio.Event = attrs.field(factory=asyncio.Event)

    @property
    def cached_tokens(self) -> int:
        return self.seq.cached_tokens or 0

    async def next_tokens(self) -> tuple[int, int]:
        """Wait for new tokens; returns ``(start, end)`` indexes of output tokens now available."""
        while self.ready == self.emitted and not self.done:
            self.event.clear()
            await self.event.wait()
        start, self.emitted = self.emitted, self.ready
        return start, self.ready


class RealTimeEngine:
    """Runs an `Engine` (or a `DataParallelEngine`) in real time on the current asyncio loop (start ``run()``).

    ``after_step`` is called after every engine step (the KV event publisher flushes there).
    """

    def __init__(
        self,
        engine: Engine | DataParallelEngine,
        time_scale: float = 1.0,
        *,
        after_step: Callable[[], None] | None = None,
    ) -> None:
        if not time_scale > 0:
            raise ValueError(f"'time_scale' must be > 0 (got {time_scale!r}).")
        self.engine = engine
        self.after_step = after_step
        self.time_scale = time_scale
        self._start = time.monotonic()
        self._streams: dict[int, Stream] = {}
        self._wake = asyncio.Event()

    def now(self) -> float:
        """Current virtual time in seconds."""
        return (time.monotonic() - self._start) / self.time_scale

    def submit(self, request: EngineRequest, rank: int | None = None) -> Stream:
        """Queue a request now on ``rank`` (None: the engine's balancer picks); ``ValueError`` when it cannot."""
        now = self.now()
        self._catch_up(now)
        engine = self.engine
        if isinstance(engine, DataParallelEngine):
            rank, seq = engine.place(request, now, rank)
        else:
            seq = engine.submit(request, now, rank)
            rank = 0
        stream = Stream(seq, time.monotonic(), rank)
        self._streams[id(seq)] = stream
        self._wake.set()
        return stream

    def detach(self, stream: Stream) -> None:
        """Stop delivering tokens to a stream (the engine still finishes its sequence)."""
        self._streams.pop(id(stream.seq), None)

    def abort(self, stream: Stream) -> bool:
        """Abort the stream's request in the engine now (its client left), as vLLM does.

        Its blocks are released at once and it stops taking batch seats and step time.
        Returns False when the engine had already finished it.
        """
        self._streams.pop(id(stream.seq), None)
        if stream.done:
            return False
        now = self.now()
        self._catch_up(now)
        aborted = self.engine.abort(stream.seq, now)
        self._wake.set()
        return aborted

    async def run(self) -> None:
        """Step the engine whenever the wall clock reaches its next event (runs until cancelled)."""
        while True:
            t = self.engine.next_event_time()
            if t is None:
                self._wake.clear()
                await self._wake.wait()
                continue
            delay = t * self.time_scale - (time.monotonic() - self._start)
            # Sleep even when late (sleep(0) yields): when steps take longer to compute than
            # they last in scaled time, requests must still be accepted between catch-ups.
            await asyncio.sleep(max(delay, 0.0))
            self._catch_up(self.now())

    def _catch_up(self, now: float) -> None:
        engine = self.engine
        while True:
            t = engine.next_event_time()
            if t is None or t > now:
                return
            result = engine.step(t)
            if self.after_step is not None:
                self.after_step()
            if result.first_tokens or result.decode_tokens or result.finished:
                self._dispatch()

    def _dispatch(self) -> None:
        wall = time.monotonic()
        finished: list[int] = []
        for key, stream in self._streams.items():
            seq = stream.seq
            if seq.generated != stream.ready or seq.finished:
                if stream.first_token_at is None and seq.generated:
                    stream.first_token_at = wall
                stream.ready = min(seq.generated, seq.request.output_len)
                if seq.finished:
                    stream.done = True
                    finished.append(key)
                stream.event.set()
        for key in finished:
            del self._streams[key]
