"""Proxy throughput side by side with SGLang's Rust router: req/s, p50, p99 from wrk.

Setup, all on loopback, every process started and stopped by this script (by pid):

* **Engines**: one nginx (Debian's) with eight server blocks on free ports, four answering
  ``POST /v1/chat/completions`` with a fixed chat completion (``application/json``) and four
  with a fixed stream of 18 SSE events (``text/event-stream``), so that the engines cost next
  to nothing and the routers are what is measured. ``/health`` and ``/v1/models`` answer too.
* **Client**: wrk (Debian's), one thread, 32 connections, 10 s per run, with a generated Lua
  script posting chat bodies of about 3 KB: 16 shared system prompts (the prefixes), each
  followed by its own question; ``"stream": true`` in the streaming part.
* **Targets**: nginx directly, SGLang's router (``sglang-router`` from PyPI, installed in its
  own virtual environment under the cache directory when missing) with ``cache_aware`` and
  ``round_robin``, and ``kvroute serve`` with ``bounded-load``, ``tokenizer-prefix``,
  ``bounded-load --workers 2`` and ``bounded-load`` with tracing on, every request or 1 % of them
  sampled (``--otlp-endpoint`` to an OTLP/HTTP sink in this process that answers every export 200
  unread; needs ``kvroute[tracing]``),
  every router with its default options and its log sent to /dev/null. Each run starts its target
  fresh and stops it afterwards; the targets' order rotates between rounds, so that a machine's
  drift hits them all alike.

The table gives each target's median over the rounds (req/s, and the medians of its p50 and
p99), the proxy's CPU time per request (its process and its children, from /proc), and the
ratios to SGLang's ``cache_aware``: req/s as a fraction of theirs, p99 and CPU per request as
multiples of theirs. On a machine shared with other work, req/s and latency follow the share of
the CPU each target gets; CPU per request does not, and is the steadier comparison.

Run: ``python benchmarks/bench_vs_sglang.py`` (about 9 minutes; ``tox -e bench-throughput``),
``--rounds``, ``--duration``, ``--mode whole|stream``, ``--only NAME,...`` for a subset,
``--kvroute-arg`` to pass an option to every kvroute target, ``--baseline SRC`` to run an older
kvroute_server next to the current one (before/after in one run; the baseline slot, a source tree on
PYTHONPATH, measured about 10 % less CPU per request than the installed tree for the same code, so run the
current tree as a baseline too before reading a small difference), ``--json FILE`` for raw numbers.
nginx and wrk are installed with apt-get when missing (as root), SGLang's router with pip.
Results in docs/performance.md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path

import attrs

PYTHON = sys.executable
SGLANG_ROUTER = "sglang-router==0.3.2"
ENGINES = 4
PREFIXES = 16
MODEL = "bench-model"


# -- helpers --------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_ready(url: str, proc: subprocess.Popen[bytes], timeout: float = 60.0) -> None:
    """Poll ``url`` until it answers 200; fail early when the process exits."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args!r} exited with {proc.returncode} before {url} answered")
        with contextlib.suppress(OSError), urllib.request.urlopen(url, timeout=1) as response:
            if response.status == 200:
                return
        time.sleep(0.1)
    raise TimeoutError(f"{url} did not answer 200 within {timeout} s")


@contextlib.contextmanager
def started(
    args: Sequence[str], ready_url: str, env: dict[str, str] | None = None
) -> Iterator[subprocess.Popen[bytes]]:
    """Run ``args`` in its own process group until the block ends; stop it (SIGTERM, then SIGKILL) by pid."""
    proc = subprocess.Popen(
        list(args), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True, env=env
    )
    try:
        wait_ready(ready_url, proc)
        yield proc
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=15)


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of ``pid`` and its live children (the workers of --workers N)."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="ascii", errors="replace") as stat:
                fields = stat.read().rpartition(")")[2].split()
        except OSError:
            continue
        if int(entry) == pid or int(fields[1]) == pid:
            total += (int(fields[11]) + int(fields[12])) / tick
    return total


# -- tools ----------------------------------------------------------------------------


def ensure_debian_tools() -> None:
    """nginx and wrk on PATH, installed from Debian's packages when missing (needs root)."""
    missing = [tool for tool in ("nginx", "wrk") if shutil.which(tool) is None and not Path("/usr/sbin", tool).exists()]
    if not missing:
        return
    if os.geteuid() != 0:
        raise SystemExit(f"missing {', '.join(missing)}: install them (apt-get install -y nginx wrk) or run as root")
    print(f"installing {' '.join(missing)} with apt-get", file=sys.stderr)
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    subprocess.run(["apt-get", "update", "-qq"], check=True, env=env)
    subprocess.run(["apt-get", "install", "-y", "-qq", *missing], check=True, env=env)


def nginx_binary() -> str:
    return shutil.which("nginx") or "/usr/sbin/nginx"


def ensure_sglang_router(cache: Path) -> Path:
    """The ``sglang-router`` executable from its own virtual environment under ``cache``, created when missing."""
    venv = cache / "sglang-router"
    exe = venv / "bin" / "sglang-router"
    if exe.exists():
        return exe
    print(f"installing {SGLANG_ROUTER} into {venv}", file=sys.stderr)
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
    subprocess.run([str(venv / "bin" / "pip"), "install", "-q", SGLANG_ROUTER], check=True)
    return exe


# -- engines: nginx -------------------------------------------------------------------


def completion() -> str:
    """The engines' fixed chat completion (about 350 bytes, usage last)."""
    return json.dumps(
        {
            "id": "chatcmpl-bench",
            "object": "chat.completion",
            "created": 1700000000,
            "model": MODEL,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": "The answer is in the third clause of the policy."},
                    "finish_reason": "stop",
                }
            ],
            "usage": {
                "prompt_tokens": 700,
                "completion_tokens": 16,
                "total_tokens": 716,
                "prompt_tokens_details": {"cached_tokens": 640},
            },
        },
        separators=(",", ":"),
    )


def sse_stream() -> str:
    """A chat completion stream: a role event, 16 token events, a usage event and ``[DONE]``."""

    def chunk(delta: dict[str, str], finish: str | None = None, usage: dict[str, int] | None = None) -> str:
        event = {
            "id": "chatcmpl-bench",
            "object": "chat.completion.chunk",
            "created": 1700000000,
            "model": MODEL,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}] if usage is None else [],
        }
        if usage is not None:
            event["usage"] = usage
        return "data: " + json.dumps(event, separators=(",", ":")) + "\n\n"

    text = "The answer is in the third clause of the policy as written in section four"
    events = [chunk({"role": "assistant", "content": ""})]
    events += [chunk({"content": " " + word}) for word in text.split(" ")]
    events.append(chunk({}, finish="stop"))
    events.append(chunk({}, usage={"prompt_tokens": 700, "completion_tokens": 16, "total_tokens": 716}))
    return "".join(events) + "data: [DONE]\n\n"


def _nginx_string(text: str) -> str:
    """``text`` as a single-quoted nginx string (our bodies hold no quote or backslash of that kind)."""
    assert "'" not in text and "\\" not in text
    return "'" + text.replace("\n", "\\n") + "'"


def nginx_conf(root: Path, whole_ports: Sequence[int], stream_ports: Sequence[int]) -> str:
    models = json.dumps({"object": "list", "data": [{"id": MODEL, "object": "model", "owned_by": "bench"}]})
    servers = []
    for ports, content_type, body in (
        (whole_ports, "application/json", completion()),
        (stream_ports, "text/event-stream", sse_stream()),
    ):
        for port in ports:
            servers.append(
                f"""
    server {{
        listen 127.0.0.1:{port} reuseport backlog=4096;
        keepalive_requests 1000000;
        keepalive_timeout 120s;
        location = /health {{ default_type text/plain; return 200 'ok'; }}
        location = /v1/models {{ default_type application/json; return 200 {_nginx_string(models)}; }}
        location / {{ default_type {content_type}; return 200 {_nginx_string(body)}; }}
    }}"""
            )
    return f"""
daemon off;
worker_processes 1;
pid {root}/nginx.pid;
error_log {root}/error.log warn;
events {{ worker_connections 4096; }}
http {{
    access_log off;
    client_body_buffer_size 64k;
    client_body_temp_path {root}/body;
    proxy_temp_path {root}/proxy;
    fastcgi_temp_path {root}/fastcgi;
    uwsgi_temp_path {root}/uwsgi;
    scgi_temp_path {root}/scgi;
    {"".join(servers)}
}}
"""


@contextlib.contextmanager
def engines(root: Path) -> Iterator[dict[str, list[str]]]:
    """One nginx serving four plain and four streaming "engines"; yields their base URLs by mode."""
    whole = [free_port() for _ in range(ENGINES)]
    stream = [free_port() for _ in range(ENGINES)]
    conf = root / "nginx.conf"
    conf.write_text(nginx_conf(root, whole, stream))
    args = [nginx_binary(), "-p", str(root), "-c", str(conf), "-e", str(root / "error.log")]
    urls = {"whole": [f"http://127.0.0.1:{p}" for p in whole], "stream": [f"http://127.0.0.1:{p}" for p in stream]}
    with started(args, urls["stream"][-1] + "/health"):
        for url in urls["whole"] + urls["stream"]:
            with urllib.request.urlopen(url + "/health", timeout=5) as response:
                assert response.status == 200
        yield urls


# -- client: wrk ----------------------------------------------------------------------


_LUA = r"""
-- Generated by benchmarks/bench_vs_sglang.py: chat bodies of ~3 KB over 16 shared system prompts.
local stream = "%(stream)s"
local requests = {}
local count = 0

local function prefix(p)
  local words = {}
  local k = 0
  while #table.concat(words, " ") < 2800 do
    k = k + 1
    words[#words + 1] = "policy" .. p .. "clause" .. k
  end
  return "You are support agent " .. p .. ". Follow these rules. " .. table.concat(words, " ")
end

init = function(args)
  local prefixes = {}
  for p = 1, %(prefixes)d do prefixes[p] = prefix(p) end
  local headers = { ["Content-Type"] = "application/json" }
  for i = 1, 1024 do
    local p = (i * 7) %% %(prefixes)d + 1
    local body = '{"model":"%(model)s","max_tokens":16,"stream":' .. stream ..
      ',"messages":[{"role":"system","content":"' .. prefixes[p] ..
      '"},{"role":"user","content":"Question number ' .. i .. ': which clause covers refunds for order ' ..
      (i * 7919) .. '?"}]}'
    requests[i] = wrk.format("POST", "/v1/chat/completions", headers, body)
  end
end

request = function()
  count = count %% #requests + 1
  return requests[count]
end

done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format("RESULT %%d %%d %%d %%d %%d %%d %%d\n", summary.requests, summary.duration,
    latency:percentile(50), latency:percentile(99), e.status, e.connect + e.read + e.write + e.timeout,
    summary.bytes))
end
"""


def lua_script(root: Path, stream: bool) -> Path:
    path = root / f"chat-{'stream' if stream else 'whole'}.lua"
    path.write_text(_LUA % {"stream": "true" if stream else "false", "model": MODEL, "prefixes": PREFIXES})
    return path


@attrs.frozen
class Run:
    """One wrk run against one target."""

    rps: float
    p50_ms: float
    p99_ms: float
    requests: int
    bad_status: int
    socket_errors: int
    cpu_us_per_request: float | None


def wrk(url: str, script: Path, duration: float, connections: int) -> tuple[int, float, float, float, int, int]:
    """(requests, seconds, p50 ms, p99 ms, non-2xx answers, socket errors) of one wrk run."""
    args = ["wrk", "-t1", f"-c{connections}", f"-d{duration:g}s", "--timeout", "10s", "-s", str(script), url]
    done = subprocess.run(args, capture_output=True, text=True, timeout=duration + 60)
    line = next((line for line in done.stdout.splitlines() if line.startswith("RESULT ")), None)
    if done.returncode or line is None:
        raise RuntimeError(f"wrk exited with {done.returncode} and no RESULT line:\n{done.stdout}{done.stderr}")
    requests, micros, p50, p99, bad, errors, _ = (int(x) for x in line.split()[1:])
    return requests, micros / 1e6, p50 / 1000, p99 / 1000, bad, errors


# -- targets --------------------------------------------------------------------------


@attrs.frozen
class Target:
    """A way to serve the engines: a command line (None for nginx itself) and the URL to measure."""

    name: str
    kind: str  # "nginx", "sglang" or "kvroute"
    args: tuple[str, ...] = ()
    #: For a kvroute target: another kvroute_server source tree to run (``--baseline``), first on PYTHONPATH.
    server_src: str | None = None
    #: For a kvroute target: export spans (every request sampled) to the script's OTLP sink.
    traced: bool = False

    def env(self) -> dict[str, str] | None:
        if self.server_src is None:
            return None
        path = os.pathsep.join(p for p in (self.server_src, os.environ.get("PYTHONPATH")) if p)
        return {**os.environ, "PYTHONPATH": path}

    def command(
        self, port: int, backends: Sequence[str], sglang: Path, extra: Sequence[str], otlp: str | None = None
    ) -> list[str]:
        if self.kind == "sglang":
            return [str(sglang), "launch", "--host", "127.0.0.1", "--port", str(port), "--worker-urls", *backends,
                    "--log-level", "warn", *self.args]  # fmt: skip
        command = [PYTHON, "-m", "kvroute", "serve", "--host", "127.0.0.1", "--port", str(port), *self.args, *extra]
        if self.traced:
            assert otlp is not None, "a traced target needs the OTLP sink"
            command += ["--otlp-endpoint", otlp]
        for i, url in enumerate(backends):
            command += ["--backend", f"e{i}={url}"]
        return command


TARGETS = (
    Target("nginx directly", "nginx"),
    Target("SGLang router (cache_aware)", "sglang", ("--policy", "cache_aware")),
    Target("SGLang router (round_robin)", "sglang", ("--policy", "round_robin")),
    Target("kvroute bounded-load", "kvroute", ("--strategy", "bounded-load")),
    Target("kvroute tokenizer-prefix", "kvroute", ("--strategy", "tokenizer-prefix")),
    Target("kvroute bounded-load --workers 2", "kvroute", ("--strategy", "bounded-load", "--workers", "2")),
    Target("kvroute bounded-load with tracing", "kvroute", ("--strategy", "bounded-load"), traced=True),
    Target(
        "kvroute bounded-load with tracing at 1 %",
        "kvroute",
        ("--strategy", "bounded-load", "--trace-sample-ratio", "0.01"),
        traced=True,
    ),
)
REFERENCE = TARGETS[1].name


def measure(
    target: Target,
    backends: Sequence[str],
    script: Path,
    *,
    duration: float,
    connections: int,
    warmup: float,
    sglang: Path,
    extra: Sequence[str],
    otlp: str | None = None,
) -> Run:
    """Start ``target`` in front of ``backends``, warm it up, run wrk once and stop it."""
    if target.kind == "nginx":
        requests, seconds, p50, p99, bad, errors = wrk(backends[0], script, duration, connections)
        return Run(requests / seconds, p50, p99, requests, bad, errors, None)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with started(target.command(port, backends, sglang, extra, otlp), url + "/health", target.env()) as proc:
        if warmup > 0:  # connection pools, first-use caches, the JIT-less warm-up of a Python process
            wrk(url, script, warmup, connections)
        before = cpu_seconds(proc.pid)
        requests, seconds, p50, p99, bad, errors = wrk(url, script, duration, connections)
        cpu = cpu_seconds(proc.pid) - before
    return Run(requests / seconds, p50, p99, requests, bad, errors, cpu / max(requests, 1) * 1e6)


@attrs.frozen
class Row:
    name: str
    runs: tuple[Run, ...]

    @property
    def rps(self) -> float:
        return statistics.median(r.rps for r in self.runs)

    @property
    def p50(self) -> float:
        return statistics.median(r.p50_ms for r in self.runs)

    @property
    def p99(self) -> float:
        return statistics.median(r.p99_ms for r in self.runs)

    @property
    def cpu(self) -> float | None:
        values = [r.cpu_us_per_request for r in self.runs if r.cpu_us_per_request is not None]
        return statistics.median(values) if values else None


@contextlib.contextmanager
def otlp_sink() -> Iterator[str]:
    """An OTLP/HTTP endpoint on loopback that answers every export 200 without decoding it (the traced target's
    collector: what is measured is the proxy's cost of making and exporting spans, not a collector's)."""
    import http.server
    import threading

    class Sink(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("content-length", "0")))
            self.send_response(200)
            self.send_header("content-length", "0")
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Sink)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def table(mode: str, rows: Sequence[Row]) -> str:
    reference = next((row for row in rows if row.name == REFERENCE), None)
    lines = [
        f"{mode}: median of {len(rows[0].runs)} runs",
        "| target | req/s | range | p50 | p99 | CPU/req | req/s vs cache_aware | p99 vs cache_aware "
        "| CPU/req vs cache_aware | errors |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        low, high = min(r.rps for r in row.runs), max(r.rps for r in row.runs)
        ratio = f"{row.rps / reference.rps:.2f}x" if reference else "-"
        p99_ratio = f"{row.p99 / reference.p99:.1f}x" if reference else "-"
        cpu = f"{row.cpu:.0f} µs" if row.cpu is not None else "-"
        cpu_ratio = f"{row.cpu / reference.cpu:.1f}x" if reference and reference.cpu and row.cpu else "-"
        errors = sum(r.bad_status + r.socket_errors for r in row.runs)
        lines.append(
            f"| {row.name} | {row.rps:,.0f} | {low:,.0f}-{high:,.0f} | {row.p50:.2f} ms | {row.p99:.2f} ms | {cpu} | "
            f"{ratio} | {p99_ratio} | {cpu_ratio} | {errors} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds over the targets [3]")
    parser.add_argument("--duration", type=float, default=10.0, help="seconds per wrk run [10]")
    parser.add_argument("--warmup", type=float, default=2.0, help="seconds of wrk before each measured run [2]")
    parser.add_argument("--connections", type=int, default=32, help="wrk connections [32]")
    parser.add_argument("--mode", choices=["whole", "stream", "both"], default="both")
    parser.add_argument("--only", help="comma-separated target names to run: full names, or else substrings of names")
    parser.add_argument("--kvroute-arg", action="append", default=[], help="an extra argument to every kvroute target")
    parser.add_argument(
        "--cache-dir",
        type=Path,
        default=Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "kvroute-bench",
        help="where SGLang's router gets its virtual environment [~/.cache/kvroute-bench]",
    )
    parser.add_argument("--json", type=Path, help="write every run's figures to this file")
    parser.add_argument(
        "--baseline",
        metavar="SRC",
        help="also run bounded-load (one process and --workers 2) from another kvroute_server source tree, "
        "e.g. an older commit's contrib/server/src (git archive COMMIT contrib/server/src | tar -x -C DIR)",
    )
    parser.add_argument("--from-json", type=Path, metavar="FILE", help="print the tables of an earlier --json run")
    args = parser.parse_args()
    if args.from_json:
        saved = json.loads(args.from_json.read_text())
        for mode, rows in saved.items():
            print(table(mode, [Row(name, tuple(Run(**run) for run in runs)) for name, runs in rows.items()]) + "\n")
        return

    targets = list(TARGETS)
    if args.baseline:
        src = str(Path(args.baseline).resolve())
        targets += [
            Target(f"{t.name} (baseline)", t.kind, t.args, server_src=src)
            for t in TARGETS
            if t.kind == "kvroute" and "bounded-load" in t.args
        ]
    if args.only:
        wanted = [w.strip() for w in args.only.split(",")]
        exact = [t for t in targets if t.name in wanted]  # a full name picks that target alone
        targets = exact or [t for t in targets if any(w in t.name for w in wanted)]
    ensure_debian_tools()
    sglang = ensure_sglang_router(args.cache_dir) if any(t.kind == "sglang" for t in targets) else Path()
    modes = ["whole", "stream"] if args.mode == "both" else [args.mode]
    load = os.getloadavg()[0]
    results: dict[str, list[Row]] = {}
    with (
        tempfile.TemporaryDirectory(prefix="kvroute-bench-") as tmp,
        engines(Path(tmp)) as urls,
        otlp_sink() as otlp,
    ):
        for mode in modes:
            script = lua_script(Path(tmp), stream=mode == "stream")
            runs: dict[str, list[Run]] = {t.name: [] for t in targets}
            for round_ in range(args.rounds):
                shift = round_ % len(targets)
                for target in targets[shift:] + targets[:shift]:  # rotate the order each round
                    run = measure(
                        target,
                        urls[mode],
                        script,
                        duration=args.duration,
                        connections=args.connections,
                        warmup=args.warmup,
                        sglang=sglang,
                        extra=args.kvroute_arg,
                        otlp=otlp,
                    )
                    runs[target.name].append(run)
                    print(
                        f"{mode} round {round_ + 1} {target.name}: {run.rps:,.0f} req/s, p50 {run.p50_ms:.2f} ms, "
                        f"p99 {run.p99_ms:.2f} ms, {run.bad_status} non-2xx, {run.socket_errors} socket errors",
                        file=sys.stderr,
                        flush=True,
                    )
            results[mode] = [Row(t.name, tuple(runs[t.name])) for t in targets]
    print(
        f"wrk -t1 -c{args.connections} -d{args.duration:g}s, ~3 KB chat bodies over {PREFIXES} prefixes, "
        f"{ENGINES} nginx engines; load average {load:.1f} before the runs, {os.getloadavg()[0]:.1f} after"
    )
    for mode in modes:
        print()
        print(table(mode, results[mode]))
    if args.json:
        raw = {mode: {row.name: [attrs.asdict(r) for r in row.runs] for row in rows} for mode, rows in results.items()}
        args.json.write_text(json.dumps(raw, indent=2))


if __name__ == "__main__":
    main()
