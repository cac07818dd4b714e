"""Start and stop real vLLM (CPU build) servers on loopback for end-to-end tests.

Standard library only, so that any test environment can import it; the servers themselves run under the
interpreter of the vLLM virtualenv (see setup_vllm_env.sh). Typical use from a pytest fixture::

    @pytest.fixture(scope="session")
    def vllm_fleet(tmp_path_factory):
        python = os.environ["KVROUTE_VLLM_PYTHON"]
        model = ensure_tiny_model(python, tmp_path_factory.mktemp("model"))
        with start_vllm_servers(python, model, count=2, log_dir=tmp_path_factory.mktemp("logs")) as servers:
            yield servers

Every process started here is put in its own session (process group) and is stopped, group and all, when the
context manager exits, whether by return, exception or KeyboardInterrupt; an atexit hook and a parent-death
signal cover the cases where the ``with`` block never unwinds.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tests.helpers import free_ports

HERE = Path(__file__).resolve().parent
BUILD_TINY_MODEL = HERE / "build_tiny_model.py"
SERVED_MODEL_NAME = "tiny-llama"
KV_TOPIC = "kv"

__all__ = [
    "SERVED_MODEL_NAME",
    "KV_TOPIC",
    "VllmServer",
    "VllmStartupError",
    "ensure_tiny_model",
    "free_ports",
    "start_vllm_servers",
    "get_text",
    "metric_value",
    "post_json",
    "sse_events",
    "stop_process_group",
]


class VllmStartupError(RuntimeError):
    """A vLLM server exited or did not become healthy in time; the message carries its log's tail."""


@dataclass(frozen=True)
class VllmServer:
    """One running vLLM server and how to reach it."""

    name: str
    model: str
    host: str
    port: int
    kv_events_port: int
    kv_replay_port: int
    core: int
    pid: int
    log_path: Path
    started_in_s: float = field(compare=False)

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def kv_events_endpoint(self) -> str:
        """Address a ZMQ SUB socket connects to (the engine binds it)."""
        return f"tcp://{self.host}:{self.kv_events_port}"

    @property
    def kv_replay_endpoint(self) -> str:
        """Address a ZMQ DEALER/REQ socket connects to for replaying buffered event batches."""
        return f"tcp://{self.host}:{self.kv_replay_port}"


def ensure_tiny_model(python: str | os.PathLike[str], out_dir: str | os.PathLike[str], seed: int = 0) -> Path:
    """Build the tiny random model into ``out_dir`` with the vLLM venv's interpreter (skipped if already built)."""
    out = Path(out_dir)
    subprocess.run(
        [os.fspath(python), os.fspath(BUILD_TINY_MODEL), os.fspath(out), "--seed", str(seed)],
        check=True,
        timeout=300,
        stdin=subprocess.DEVNULL,
    )
    return out


def _engine_env(core: int, extra: Mapping[str, str]) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        {
            "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB of KV cache
            "VLLM_CPU_OMP_THREADS_BIND": str(core),
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
            "TOKENIZERS_PARALLELISM": "false",
            "PYTHONUNBUFFERED": "1",
            # Keeps the engine's internal sockets (its message queue picks the host's IP otherwise) on loopback.
            "VLLM_HOST_IP": "127.0.0.1",
        }
    )
    # The test environment's own Python settings must not leak into the engine's interpreter. PYTHONHASHSEED
    # (tox sets a random one) would also change vLLM's block hash seed; without it sha256 hashes are the same
    # in every process and every run, which keeps captured fixtures comparable.
    for name in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "PYTHONHASHSEED"):
        env.pop(name, None)
    env.update(extra)
    return env


def _command(
    python: str, model_dir: Path, name: str, host: str, ports: Sequence[int], enforce_eager: bool, extra: Sequence[str]
) -> list[str]:
    port, events_port, replay_port = ports
    kv_events = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        # "*" makes the engine bind (and a subscriber connect); a concrete host would make the engine connect.
        "endpoint": f"tcp://*:{events_port}",
        "replay_endpoint": f"tcp://*:{replay_port}",
        "topic": KV_TOPIC,
    }
    cmd = [
        python,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        os.fspath(model_dir),
        "--served-model-name",
        name,
        "--host",
        host,
        "--port",
        str(port),
        "--max-model-len",
        "8192",
        "--enable-prefix-caching",
        "--enable-prompt-tokens-details",
        "--kv-events-config",
        json.dumps(kv_events, separators=(",", ":")),
    ]
    if enforce_eager:
        cmd.append("--enforce-eager")
    cmd.extend(extra)
    return cmd


def _set_parent_death_signal() -> None:
    """In the child before exec: ask Linux to SIGTERM it if the test process dies without cleaning up."""
    with contextlib.suppress(Exception):
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, signal.SIGTERM)


def _group_alive(pgid: int, proc: subprocess.Popen[bytes]) -> bool:
    proc.poll()  # reap the leader, or its zombie would keep the group "alive"
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def stop_process_group(proc: subprocess.Popen[bytes], grace_s: float = 20.0) -> None:
    """SIGTERM the process group led by ``proc`` (started with its own session), then SIGKILL what is left."""
    pgid = proc.pid  # start_new_session=True made the child the leader of a new session and process group
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
        if not _group_alive(pgid, proc):
            break
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, sig)
        deadline = time.monotonic() + wait_s
        while _group_alive(pgid, proc) and time.monotonic() < deadline:
            time.sleep(0.2)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=5)


def _log_tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError):
        return False


@contextlib.contextmanager
def start_vllm_servers(
    python: str | os.PathLike[str],
    model_dir: str | os.PathLike[str],
    count: int = 2,
    *,
    log_dir: str | os.PathLike[str],
    served_model_name: str = SERVED_MODEL_NAME,
    host: str = "127.0.0.1",
    cores: Sequence[int] | None = None,
    startup_timeout_s: float = 300.0,
    enforce_eager: bool = True,
    extra_args: Sequence[str] = (),
    extra_env: Mapping[str, str] | None = None,
) -> Iterator[list[VllmServer]]:
    """Start ``count`` vLLM servers at once, wait until every ``/health`` answers 200, yield them, stop them.

    Server ``i`` is pinned to core ``cores[i]`` (default ``i % os.cpu_count()``) and logs to
    ``log_dir/vllm-<i>.log``. ``extra_args`` are appended to every command line and ``extra_env`` is laid over
    the engine environment (e.g. ``{"VLLM_SERVER_DEV_MODE": "1"}`` for ``/reset_prefix_cache``). Raises
    VllmStartupError if a server exits early or is not healthy within ``startup_timeout_s``; the servers
    started so far are stopped before the error propagates.
    """
    python = os.fspath(python)
    model = Path(model_dir).resolve()
    logs = Path(log_dir)
    logs.mkdir(parents=True, exist_ok=True)
    ncpu = os.cpu_count() or 1
    cores = list(cores) if cores is not None else [i % ncpu for i in range(count)]
    if len(cores) != count:
        raise ValueError(f"'cores' must have one entry per server ({count}) (got {len(cores)}).")

    procs: list[subprocess.Popen[bytes]] = []
    pending: list[tuple[subprocess.Popen[bytes], list[int], int, Path]] = []

    def cleanup() -> None:
        for proc in procs:
            stop_process_group(proc)

    atexit.register(cleanup)
    began = time.monotonic()
    try:
        all_ports = free_ports(3 * count, host)
        for i in range(count):
            ports = all_ports[3 * i : 3 * i + 3]
            log_path = logs / f"vllm-{i}.log"
            cmd = _command(python, model, served_model_name, host, ports, enforce_eager, extra_args)
            with log_path.open("wb") as log_file:
                log_file.write(("$ " + " ".join(cmd) + "\n").encode())
                log_file.flush()
                proc = subprocess.Popen(
                    cmd,
                    stdin=subprocess.DEVNULL,
                    stdout=log_file,
                    stderr=subprocess.STDOUT,
                    env=_engine_env(cores[i], extra_env or {}),
                    start_new_session=True,
                    preexec_fn=_set_parent_death_signal if sys.platform == "linux" else None,
                )
            procs.append(proc)
            pending.append((proc, ports, cores[i], log_path))

        servers: dict[int, VllmServer] = {}
        deadline = began + startup_timeout_s
        while len(servers) < count:
            for i, (proc, ports, core, log_path) in enumerate(pending):
                if i in servers:
                    continue
                if proc.poll() is not None:
                    raise VllmStartupError(
                        f"vLLM server {i} exited with code {proc.returncode} during startup; "
                        f"log {log_path}:\n{_log_tail(log_path)}"
                    )
                if _healthy(f"http://{host}:{ports[0]}/health"):
                    servers[i] = VllmServer(
                        name=f"vllm-{i}",
                        model=served_model_name,
                        host=host,
                        port=ports[0],
                        kv_events_port=ports[1],
                        kv_replay_port=ports[2],
                        core=core,
                        pid=proc.pid,
                        log_path=log_path,
                        started_in_s=time.monotonic() - began,
                    )
            if len(servers) < count:
                if time.monotonic() > deadline:
                    slow = [i for i in range(count) if i not in servers]
                    tails = "\n".join(f"--- {pending[i][3]}:\n{_log_tail(pending[i][3])}" for i in slow)
                    raise VllmStartupError(
                        f"vLLM servers {slow} were not healthy within {startup_timeout_s:.0f} s\n{tails}"
                    )
                time.sleep(0.5)
        yield [servers[i] for i in range(count)]
    finally:
        cleanup()
        atexit.unregister(cleanup)


# --- small stdlib HTTP helpers for tests that talk to the servers -----------------------------------------


_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')


def get_text(url: str, timeout_s: float = 30.0) -> str:
    """GET ``url`` and return the body as text (raises urllib.error.HTTPError on a non-2xx status)."""
    with urllib.request.urlopen(url, timeout=timeout_s) as resp:
        return resp.read().decode()


def post_json(url: str, body: Mapping[str, object], timeout_s: float = 120.0) -> bytes:
    """POST ``body`` as JSON and return the raw response body (JSON, or SSE when ``"stream": true``)."""
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}, method="POST"
    )
    with urllib.request.urlopen(req, timeout=timeout_s) as resp:
        return resp.read()


def sse_events(raw: bytes) -> list[object]:
    """Decode an OpenAI-style SSE body into its JSON events; the final ``data: [DONE]`` is dropped."""
    events: list[object] = []
    for block in raw.decode().split("\n\n"):
        for line in block.splitlines():
            if line.startswith("data:"):
                data = line[len("data:") :].strip()
                if data != "[DONE]":
                    events.append(json.loads(data))
    return events


def metric_value(text: str, name: str, **labels: str) -> float:
    """The value of the sample ``name`` (exact name, not a prefix) whose labels include ``labels``.

    Enough for vLLM's own exposition (one sample per name for a single-engine server); not a general parser.
    """
    for line in text.splitlines():
        if not line.startswith(name) or line.startswith("#"):
            continue
        rest = line[len(name) :]
        if rest.startswith("{"):
            label_text, _, value = rest[1:].partition("} ")
        elif rest.startswith(" "):
            label_text, value = "", rest[1:]
        else:
            continue  # a longer name with this prefix, e.g. vllm:num_requests_waiting_by_reason
        found = dict(_LABEL.findall(label_text))
        if all(found.get(k) == v for k, v in labels.items()):
            return float(value.split()[0])
    raise LookupError(f"no sample {name!r} with labels {labels!r} in the metrics text")


def _main(argv: Sequence[str] | None = None) -> int:
    """Manual use: start servers, print their addresses as JSON, keep them up until Ctrl-C or SIGTERM."""
    import argparse

    parser = argparse.ArgumentParser(description="Start vLLM test servers and keep them running.")
    parser.add_argument("--python", default=os.environ.get("KVROUTE_VLLM_PYTHON"), required=False)
    parser.add_argument("--model", required=True, help="model directory (see build_tiny_model.py)")
    parser.add_argument("--count", type=int, default=2)
    parser.add_argument("--log-dir", default=".")
    parser.add_argument("--no-enforce-eager", action="store_true")
    args = parser.parse_args(argv)
    if not args.python:
        parser.error("--python or KVROUTE_VLLM_PYTHON is required")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    with start_vllm_servers(
        args.python, args.model, args.count, log_dir=args.log_dir, enforce_eager=not args.no_enforce_eager
    ) as servers:
        info = [
            {
                "name": s.name,
                "base_url": s.base_url,
                "kv_events": s.kv_events_endpoint,
                "kv_replay": s.kv_replay_endpoint,
                "pid": s.pid,
                "core": s.core,
                "log": str(s.log_path),
                "started_in_s": round(s.started_in_s, 1),
            }
            for s in servers
        ]
        print(json.dumps(info, indent=2), flush=True)
        try:
            while all(_healthy(s.base_url + "/health") for s in servers):
                time.sleep(5)
        except KeyboardInterrupt:
            pass
    return 0


if __name__ == "__main__":
    sys.exit(_main())
