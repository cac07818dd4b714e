"""``kvroute serve --workers N``: N proxy processes behind one listening socket, and their supervisor.

The supervisor (the process the user started) binds the listening socket once, then starts N
workers, each a fresh interpreter (``python -c``) that inherits the socket's descriptor and
serves it with uvicorn: the kernel hands each new connection to one of the workers. The
supervisor

* gives each worker its settings through a pipe on its stdin and keeps the pipe open: a
  worker whose stdin reaches end-of-file knows the supervisor is gone (even after a
  SIGKILL, which no handler sees) and stops itself, so workers are never orphaned;
* restarts a worker that dies (with a growing delay when it keeps dying at once, and gives
  up after five quick deaths in a row), and tells prometheus-client the dead one is gone;
* stops every worker on SIGTERM, SIGINT or SIGHUP: SIGTERM to each, the shutdown timeout for
  requests in flight, then SIGKILL; and removes the run directory.

Why one inherited socket rather than ``SO_REUSEPORT`` (one socket per worker): connections
queued for a worker that dies stay queued for the others instead of being reset, the port is
held by the supervisor from the start (clients queue while workers start, nothing else can
bind it), and it works the same on every Unix. Why fresh interpreters rather than ``fork``:
prometheus-client picks its multiprocess mode when it is imported, and a forked child would
inherit the supervisor's imported state, locks and loggers.

The run directory (``tempfile.mkdtemp``, mode 0700) holds prometheus-client's multiprocess
files and the admin journal (`kvroute_server.ops.journal`).
"""

from __future__ import annotations

import contextlib
import os
import pickle
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import MutableMapping
from typing import IO, Any

import attrs
import structlog

from kvroute.errors import ConfigError
from kvroute_server.config import ServerConfig
from kvroute_server.ops.journal import WorkerContext, announce
from kvroute_server.ops.metrics import MULTIPROC_ENV

__all__ = ["Supervisor", "WorkerContext", "bind_socket", "worker_main"]

log = structlog.get_logger(__name__)

_WORKER_CODE = "from kvroute_server.ops.workers import worker_main; worker_main()"
#: A worker that dies within this many seconds of its start counts as a quick death.
_QUICK_DEATH_S = 10.0
#: Quick deaths in a row (one worker slot) after which the supervisor gives up.
_MAX_QUICK_DEATHS = 5
#: Extra seconds, beyond the shutdown timeout, before a worker that does not stop is killed.
_KILL_GRACE_S = 5.0


@attrs.frozen
class _WorkerSpec:
    """What a worker needs, sent pickled through its stdin."""

    context: WorkerContext
    config: ServerConfig
    fd: int
    log_level: str
    log_format: str
    http: str = "kvroute"


def bind_socket(host: str, port: int, backlog: int = 4096) -> socket.socket:
    """A listening TCP socket on ``host:port`` that child processes can inherit."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(backlog)
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


@attrs.define
class _Slot:
    index: int
    proc: subprocess.Popen[bytes] | None = None
    started: float = 0.0
    quick_deaths: int = 0
    restart_at: float = 0.0


class Supervisor:
    """Runs ``config.workers`` proxy workers on one socket until a stop signal (see the module docstring).

    ``http`` names the HTTP protocol every worker serves with (`kvroute_server.http.runner.HTTP_PROTOCOLS`).
    """

    def __init__(
        self, config: ServerConfig, *, log_level: str = "info", log_format: str = "json", http: str = "kvroute"
    ) -> None:
        from kvroute_server.http.runner import HTTP_PROTOCOLS

        if http not in HTTP_PROTOCOLS:  # here, not as a crash loop of every worker
            raise ConfigError(f"'http' must be one of {', '.join(HTTP_PROTOCOLS)} (got {http!r}).")
        self.config = config
        self.log_level = log_level
        self.log_format = log_format
        self.http = http
        self.run_dir = ""
        self.socket: socket.socket | None = None
        self._slots = [_Slot(i) for i in range(config.workers)]
        self._stop: int | None = None
        self._failed = False

    @property
    def address(self) -> tuple[str, int]:
        """The bound host and port (after `start`)."""
        assert self.socket is not None, "not started"
        host, port = self.socket.getsockname()[:2]
        return str(host), int(port)

    def worker_pids(self) -> list[int]:
        """The pids of the workers running now."""
        return [s.proc.pid for s in self._slots if s.proc is not None and s.proc.poll() is None]

    # -- lifecycle ----------------------------------------------------------------------

    def start(self) -> None:
        """Bind the socket, create the run directory and start every worker."""
        try:
            self.socket = bind_socket(self.config.host, self.config.port)
        except OSError as exc:
            raise ConfigError(f"cannot listen on {self.config.host}:{self.config.port}: {exc}") from None
        self.run_dir = tempfile.mkdtemp(prefix="kvroute-serve-")
        os.mkdir(os.path.join(self.run_dir, "metrics"))
        host, port = self.address
        log.info("workers_starting", host=host, port=port, workers=len(self._slots), run_dir=self.run_dir)
        for slot in self._slots:
            self._spawn(slot)

    def run(self) -> int:
        """Start, supervise until SIGTERM/SIGINT/SIGHUP, stop everything; returns the exit status."""
        previous = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
        try:
            self.start()
            while self._stop is None and not self._failed:
                self.check()
                time.sleep(0.05)
        finally:
            self.stop()
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        if self._stop is not None:
            log.info("workers_stopped", signal=signal.Signals(self._stop).name)
        return 1 if self._failed else 0

    def _on_signal(self, signum: int, frame: Any) -> None:
        self._stop = signum

    def check(self) -> None:
        """Notice workers that exited and restart them when their delay is over."""
        now = time.monotonic()
        for slot in self._slots:
            proc = slot.proc
            if proc is not None and proc.poll() is not None:
                self._exited(slot, proc, now)
            if slot.proc is None and now >= slot.restart_at and not self._failed:
                self._spawn(slot)

    def _exited(self, slot: _Slot, proc: subprocess.Popen[bytes], now: float) -> None:
        slot.proc = None
        self._forget(proc)
        lived = now - slot.started
        slot.quick_deaths = slot.quick_deaths + 1 if lived < _QUICK_DEATH_S else 0
        delay = min(0.25 * 2 ** (slot.quick_deaths - 1), 8.0) if slot.quick_deaths else 0.0
        slot.restart_at = now + delay
        log.warning(
            "worker_exited",
            worker=slot.index,
            pid=proc.pid,
            returncode=proc.returncode,
            lived_s=round(lived, 3),
            restart_in_s=delay,
        )
        if slot.quick_deaths >= _MAX_QUICK_DEATHS:
            log.error("worker_crash_loop", worker=slot.index, deaths=slot.quick_deaths, within_s=_QUICK_DEATH_S)
            self._failed = True

    def _forget(self, proc: subprocess.Popen[bytes]) -> None:
        """Close the worker's pipe and drop its live gauges from the shared metrics."""
        if proc.stdin is not None:
            with contextlib.suppress(OSError):
                proc.stdin.close()
        from prometheus_client.multiprocess import mark_process_dead

        with contextlib.suppress(OSError):
            mark_process_dead(proc.pid, os.path.join(self.run_dir, "metrics"))  # type: ignore[no-untyped-call]

    def _spawn(self, slot: _Slot) -> None:
        assert self.socket is not None
        fd = self.socket.fileno()
        context = WorkerContext(index=slot.index, count=len(self._slots), run_dir=self.run_dir)
        spec = _WorkerSpec(context, self.config, fd, self.log_level, self.log_format, self.http)
        env = {**os.environ, MULTIPROC_ENV: str(context.metrics_dir)}
        proc = subprocess.Popen([sys.executable, "-c", _WORKER_CODE], stdin=subprocess.PIPE, pass_fds=(fd,), env=env)
        assert proc.stdin is not None
        announce(context, proc.pid)  # before it can take a connection: admin changes wait for its replay
        payload = pickle.dumps(spec)
        try:
            proc.stdin.write(len(payload).to_bytes(8, "big") + payload)
            proc.stdin.flush()
        except OSError as exc:  # it died at once; check() restarts it
            log.warning("worker_spec_not_sent", worker=slot.index, error=str(exc))
        slot.proc = proc
        slot.started = time.monotonic()
        log.info("worker_started", worker=slot.index, pid=proc.pid)

    def stop(self) -> None:
        """SIGTERM every worker, wait up to the shutdown timeout (+5 s), SIGKILL what is left; clean up."""
        running = [(s, s.proc) for s in self._slots if s.proc is not None]
        for _, proc in running:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + self.config.shutdown_timeout + _KILL_GRACE_S
        for slot, proc in running:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.error("worker_killed", worker=slot.index, pid=proc.pid, after_s=self.config.shutdown_timeout)
                proc.kill()
                proc.wait()
            self._forget(proc)
            slot.proc = None
        if self.socket is not None:
            self.socket.close()
        if self.run_dir:
            shutil.rmtree(self.run_dir, ignore_errors=True)


# -- the worker side --------------------------------------------------------------------


def _read_spec(stream: IO[bytes]) -> _WorkerSpec:
    header = stream.read(8)
    if len(header) != 8:
        raise SystemExit("kvroute worker: no settings on stdin (workers are started by kvroute serve --workers)")
    payload = stream.read(int.from_bytes(header, "big"))
    spec = pickle.loads(payload)
    if not isinstance(spec, _WorkerSpec):
        raise SystemExit(f"kvroute worker: unexpected settings {type(spec).__name__}")
    return spec


_supervisor_gone = threading.Event()


def _watch_supervisor(fd: int, grace_s: float) -> None:
    """Block until the supervisor's pipe closes, then stop this worker (hard after ``grace_s``).

    It reads the raw descriptor, not ``sys.stdin.buffer``: a daemon thread blocked inside a buffered
    reader holds that reader's lock, and the interpreter's shutdown then aborts with "Fatal Python
    error: _enter_buffered_busy" when it closes stdin.
    """
    with contextlib.suppress(OSError):
        while os.read(fd, 65536):
            pass
    _supervisor_gone.set()
    log.warning("supervisor_gone", pid=os.getpid())
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(grace_s)
    os._exit(70)


def _stop_now(signum: int, frame: Any) -> None:
    raise SystemExit(0)


def worker_main() -> None:
    """Entry point of a worker process (started by `Supervisor` with its settings on stdin)."""
    # Until uvicorn takes them over, SIGTERM and SIGINT stop the worker at once; afterwards
    # uvicorn re-raises the signal that stopped it, and this handler turns it into a normal
    # exit, so the clean-up below runs.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _stop_now)
    spec = _read_spec(sys.stdin.buffer)
    config = spec.config
    threading.Thread(
        target=_watch_supervisor,
        args=(sys.stdin.fileno(), config.shutdown_timeout + _KILL_GRACE_S),
        name="kvroute-supervisor-watch",
        daemon=True,
    ).start()

    from kvroute.cli import configure_logging

    configure_logging(spec.log_level, spec.log_format)
    index = spec.context.index

    def add_worker(logger: Any, name: str, event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
        event.setdefault("worker", index)
        return event

    processors = structlog.get_config()["processors"]
    structlog.configure(processors=[add_worker, *processors])

    from kvroute_server.http.runner import ProcessServer, make_uvicorn_config
    from kvroute_server.proxy.app import ProxyApp

    app = ProxyApp(config, worker=spec.context)
    sock = socket.socket(fileno=spec.fd)
    level = spec.log_level if spec.log_level != "info" else "warning"
    uvicorn_config = make_uvicorn_config(
        app,
        config.host,
        config.port,
        log_level=level,
        http=spec.http,
        timeout_graceful_shutdown=config.shutdown_timeout,
    )
    try:
        ProcessServer(uvicorn_config).run(sockets=[sock])
    finally:
        if _supervisor_gone.is_set():
            # Nobody else will remove the run directory. Siblings still stopping keep their open files.
            shutil.rmtree(spec.context.run_dir, ignore_errors=True)
