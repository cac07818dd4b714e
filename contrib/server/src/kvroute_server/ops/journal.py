"""Admin changes shared by the workers of one ``kvroute serve --workers N``.

Every worker has its own `Fleet`; an admin call reaches only the worker that accepted its
connection. So changes go through an append-only journal in the server's run directory
(one JSON object per line: ``{"seq", "action", "backend", "body"}``):

* The worker that receives a change takes an exclusive ``flock`` on the journal, applies
  what other workers wrote since it last looked, applies the change itself (a refused
  change answers 4xx and is not written), appends it, and releases the lock. The lock
  gives every change a place in one total order, and every worker applies the same changes
  in that order.
* Every worker polls the journal's size (``os.fstat``, every 20 ms) and applies new
  complete lines; it publishes how far it got in ``workers/<index>.json``.
* The receiving worker answers once every live sibling (a running worker process, announced
  by the supervisor when it started it) has published the change's sequence number (or after a bounded wait), so a
  drain has stopped new requests on every worker when the admin call returns.
* A worker started later (a restart after a crash) replays the whole journal before it
  takes its first request, so it has the same fleet as its siblings.

Only ``fcntl`` and the file system: no extra process or network port, and a worker that
misses a notification cannot fall behind for longer than one poll.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import anyio
import attrs
import structlog

__all__ = ["ONE_PROCESS", "AdminJournal", "WorkerContext", "announce"]

log = structlog.get_logger(__name__)


@attrs.frozen
class WorkerContext:
    """Where a worker of ``kvroute serve --workers N`` is: its index, the count, the shared run directory."""

    index: int
    count: int
    run_dir: str
    #: Share metrics through prometheus-client's multiprocess files (needs ``PROMETHEUS_MULTIPROC_DIR``
    #: set before prometheus-client is imported); off only for in-process tests of the journal.
    shared_metrics: bool = True

    @property
    def metrics_dir(self) -> Path:
        """prometheus-client's multiprocess directory (``PROMETHEUS_MULTIPROC_DIR``)."""
        return Path(self.run_dir) / "metrics"

    @property
    def journal_path(self) -> Path:
        """The admin journal, shared by every worker."""
        return Path(self.run_dir) / "admin.jsonl"

    @property
    def states_dir(self) -> Path:
        """Where each worker publishes its pid and how much of the journal it applied."""
        return Path(self.run_dir) / "workers"


#: The context of a proxy that is its only process (no ``--workers``): nothing is shared.
ONE_PROCESS = WorkerContext(index=0, count=1, run_dir="", shared_metrics=False)

Entry = dict[str, Any]


def _write_position(context: WorkerContext, pid: int, applied: int) -> None:
    path = context.states_dir / f"{context.index}.json"
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"pid": pid, "applied": applied}))
    os.replace(tmp, path)


def announce(context: WorkerContext, pid: int) -> None:
    """Record a worker process the moment it is started (by the supervisor, before the worker runs).

    From then on it counts as live: a change made while it starts waits for its replay.
    """
    context.states_dir.mkdir(parents=True, exist_ok=True)
    _write_position(context, pid, 0)


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, dead but not yet reaped, counts as gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as stat:
            return stat.read().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return True  # no /proc (macOS): trust kill(0)


class AdminJournal:
    """One worker's handle on the shared admin journal; ``apply(entry)`` replays a change in this worker."""

    def __init__(
        self,
        context: WorkerContext,
        apply: Callable[[Entry], None],
        *,
        poll_s: float = 0.02,
        ack_timeout_s: float = 5.0,
        lock_timeout_s: float = 10.0,
    ) -> None:
        self.context = context
        self._apply = apply
        self.poll_s = poll_s
        self.ack_timeout_s = ack_timeout_s
        self.lock_timeout_s = lock_timeout_s
        context.states_dir.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(context.journal_path, os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
        self._offset = 0
        #: Sequence number of the last change applied in this worker (0: none).
        self.applied = 0
        self._lock = anyio.Lock()

    def close(self) -> None:
        """Close the journal file (the worker is stopping)."""
        with contextlib.suppress(OSError):
            os.close(self._fd)

    # -- reading ----------------------------------------------------------------------

    def catch_up(self) -> int:
        """Apply every complete entry written since the last call; returns how many were applied."""
        size = os.fstat(self._fd).st_size
        if size <= self._offset:
            return 0
        data = os.pread(self._fd, size - self._offset, self._offset)
        end = data.rfind(b"\n") + 1  # a line still being written is left for the next call
        count = 0
        for line in data[:end].splitlines():
            entry: Entry = json.loads(line)
            seq = int(entry["seq"])
            if seq != self.applied + 1:
                log.error("admin_journal_gap", expected=self.applied + 1, got=seq, worker=self.context.index)
            try:
                self._apply(entry)
            except Exception as exc:  # a change this worker cannot make must not stop it following the rest
                log.warning(
                    "admin_change_not_applied",
                    seq=seq,
                    action=entry.get("action"),
                    backend=entry.get("backend"),
                    worker=self.context.index,
                    error=f"{type(exc).__name__}: {exc}",
                )
            self.applied = seq
            count += 1
        self._offset += end
        if count:
            self.publish()
        return count

    def publish(self) -> None:
        """Write this worker's pid and position for its siblings (atomically: write, then rename)."""
        try:
            _write_position(self.context, os.getpid(), self.applied)
        except OSError as exc:  # siblings waiting for this worker time out and say so
            log.warning("admin_position_not_published", worker=self.context.index, error=str(exc))

    async def follow(self) -> None:
        """Apply changes other workers write, until cancelled."""
        while True:
            await anyio.sleep(self.poll_s)
            self.catch_up()

    # -- writing ----------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def exclusive(self) -> AsyncIterator[None]:
        """Hold the journal lock (against this worker's other calls and every other worker), caught up."""
        import fcntl  # POSIX only, like --workers itself: kvroute_server stays importable elsewhere

        async with self._lock:
            deadline = time.monotonic() + self.lock_timeout_s
            while True:
                try:
                    fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        raise TimeoutError(
                            f"another worker held the admin journal lock for more than {self.lock_timeout_s} s"
                        ) from None
                    await anyio.sleep(0.002)
            try:
                self.catch_up()
                yield
            finally:
                fcntl.flock(self._fd, fcntl.LOCK_UN)

    def append(self, action: str, backend: str | None, body: Any) -> int:
        """Write a change this worker has just applied (inside `exclusive`); returns its sequence number."""
        seq = self.applied + 1
        line = (
            json.dumps({"seq": seq, "action": action, "backend": backend, "body": body}, separators=(",", ":")) + "\n"
        )
        data = line.encode("utf-8")
        written = os.write(self._fd, data)
        if written != len(data):
            raise OSError(f"short write to the admin journal ({written} of {len(data)} bytes)")
        self._offset += len(data)
        self.applied = seq
        self.publish()
        return seq

    # -- acknowledgements -------------------------------------------------------------

    def positions(self) -> dict[int, tuple[int, int]]:
        """Each other live worker's ``(pid, applied)``; workers not started or dead are left out."""
        out: dict[int, tuple[int, int]] = {}
        for index in range(self.context.count):
            if index == self.context.index:
                continue
            try:
                state = json.loads((self.context.states_dir / f"{index}.json").read_text())
            except (OSError, ValueError):
                continue
            pid = int(state.get("pid", 0))
            if pid > 0 and _alive(pid):
                out[index] = (pid, int(state.get("applied", 0)))
        return out

    async def wait_for_siblings(self, seq: int) -> dict[str, int]:
        """Wait (at most ``ack_timeout_s``) until every live worker applied change ``seq``.

        Returns ``{"applied": workers that applied it (this one included), "live": live workers}``.
        A worker that is not running now replays the change when it starts.
        """
        deadline = time.monotonic() + self.ack_timeout_s
        while True:
            positions = self.positions()
            acked = sum(applied >= seq for _, applied in positions.values())
            if acked == len(positions) or time.monotonic() > deadline:
                if acked < len(positions):
                    behind = sorted(i for i, (_, applied) in positions.items() if applied < seq)
                    log.warning("admin_change_not_acknowledged", seq=seq, workers=behind, waited_s=self.ack_timeout_s)
                return {"applied": acked + 1, "live": len(positions) + 1}
            await anyio.sleep(self.poll_s / 2)
