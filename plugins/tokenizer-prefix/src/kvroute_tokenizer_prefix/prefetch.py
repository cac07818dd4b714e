"""Hashing pending prompts ahead of time, in a background thread.

When the router sends a prompt, the strategy has hashed only as much of it as the decision
needed; the rest waits as a pending tail (see `kvroute_tokenizer_prefix.tails`). If the
prefix is asked for again, that rest must be tokenized and hashed then, under the router's
lock. The `Prefetcher` does that work before it is needed: its thread tokenizes the rest of
the prompt in batches (the ``tokenizers`` library releases the GIL while it works), hashes
it a piece at a time (handing the GIL back between pieces, at a lower OS priority where the
platform allows), and merges the resulting pieces into the strategy's memo under the
strategy's lock. A later request then finds memoized pieces instead of text to tokenize.

Only the memo changes, and a memo entry is a pure function of the prompt prefix it names:
what the router decides never depends on whether, or when, a prefetch ran.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from kvroute.logs import get_logger
from kvroute_tokenizer_prefix.blocks import PromptBlocks
from kvroute_tokenizer_prefix.memo import PieceMemo
from kvroute_tokenizer_prefix.segments import TextSegment

__all__ = ["Prefetcher"]

log = get_logger(__name__)

#: Jobs waiting at most; the oldest are dropped beyond it (the router then hashes inline if asked).
MAX_QUEUE = 256
#: The thread's niceness increment (POSIX): the request path wins when CPUs are scarce.
_NICE = 10


class Prefetcher:
    """One daemon thread hashing pending prompts into a memo.

    When it falls behind, it takes the newest job first and drops the oldest beyond
    ``max_queue`` (a request for a dropped prompt's prefix hashes it inline, as without prefetch).
    """

    def __init__(self, lock: Any, max_queue: int = MAX_QUEUE) -> None:
        self._lock = lock
        self._max_queue = max_queue
        self._jobs: deque[tuple[PromptBlocks, PieceMemo, list[tuple[TextSegment, int]], int]] = deque()
        self._cond = threading.Condition()
        self._busy = False
        self._thread: threading.Thread | None = None
        #: Jobs submitted, finished, dropped (queue full), failed; pieces merged into memos.
        self.submitted = 0
        self.finished = 0
        self.dropped = 0
        self.failed = 0
        self.pieces = 0

    def submit(self, blocks: PromptBlocks) -> bool:
        """Queue the rest of ``blocks``'s prompt; False when there is nothing to hash ahead."""
        memo = blocks.memo
        fork = blocks.fork()
        if fork is None or memo is None:
            return False
        texts = blocks.remaining_text()
        budget = fork.max_blocks * fork.block_size
        with self._cond:
            self._jobs.append((fork, memo, texts, budget))
            self.submitted += 1
            while len(self._jobs) > self._max_queue:
                self._jobs.popleft()
                self.dropped += 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="kvroute-tokenizer-prefetch", daemon=True)
                self._thread.start()
            self._cond.notify_all()
        return True

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Block until every queued job is done (benchmarks, tests); False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._jobs and not self._busy, timeout)

    def _run(self) -> None:
        with contextlib.suppress(AttributeError, OSError):  # best effort; not every platform has it
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), os.getpriority(os.PRIO_PROCESS, 0) + _NICE)
        while True:
            with self._cond:
                self._busy = False
                self._cond.notify_all()
                self._cond.wait_for(lambda: bool(self._jobs))
                job = self._jobs.pop()  # newest first: under a backlog, the likeliest to be asked again soon
                self._busy = True
            try:
                self._work(*job)
                self.finished += 1
            except Exception as exc:  # never let the thread die: the router hashes inline then
                self.failed += 1
                log.warning("tokenizer_prefetch_failed", error=f"{type(exc).__name__}: {exc}")

    def _work(self, fork: PromptBlocks, memo: PieceMemo, texts: list[tuple[TextSegment, int]], budget: int) -> None:
        for segment, start in texts:  # tokenize in batches first: the GIL is free meanwhile
            warm: Callable[[bytes, int, int], int] | None = getattr(segment.codec, "warm", None)
            if warm is not None and budget > 0:
                budget -= warm(segment.data, start, budget)
        fork.pace = True
        while fork.grow():
            time.sleep(0)  # let the request path take the GIL between two pieces
        with self._lock:
            self.pieces += memo.merge(fork.memo) if fork.memo is not None else 0
