"""Agent traffic through the proxy: sessions on and off, router replicas, next to direct random and SGLang's router.

The traffic (seeded, the same requests for every row): coding-agent sessions that all start with one
12,000-character tools + instructions preamble (the system message), then a task of 300-1,500
characters. Each session has 4-7 turns; every turn resends the whole history with the previous answer
and a new tool output (1,000-4,000 characters) or user message (150-600 characters). A quarter of the
later turns fan out into 2-4 parallel sub-requests that share the new prefix (history + tool output)
and add their own sub-task. The answers are what the emulator generates (a function of the prompt, so
known in advance: a turn resends its predecessor's real answer, as an agent does); a turn waits for
its predecessor (all of a fan-out's sub-requests) to finish. Sessions start at Poisson times and space
their turns by 1-6 s of "tool time"; the send times are scaled so that the requests arrive at
``--rate`` per second on average (300 at 6/s: about 50 s).

The fleet: 7 ``kvroute emulate`` engines (the simulator's engine model of a 70B model on 8 x H100 in
real time), block size 32 tokens (the emulator's tokens are words; the generated text averages 8
characters a word, so a block is about 256 characters), 512 blocks each (16,384 tokens, LRU
eviction of unreferenced blocks as in vLLM): with the default traffic, one pooled LRU cache of one
engine's size would reach 0.897 where the bound is 0.920, one of the fleet's size reaches the bound.
Every row starts fresh engines and fresh routers.

Targets (rows), each with 1 and 4 router replicas (separate processes over the same engines; the
client sends each request to a replica picked at random, seeded):

* ``direct random``: the client picks an engine at random (seeded); no router.
* ``kvroute default, sessions on``: ``kvroute serve`` with its default strategy (bounded-load) and
  the session header (``--session-header``, default ``x-session-id``) sent with every request.
* ``kvroute default, no header``: the same configuration, traffic without a session id (what the
  proxy's conversation binding, on by default with sessions, gets).
* ``..., replica sync``: the same two rows with router-replica sync (``--peer`` naming every replica,
  itself included, and ``--peer-token``): the replicas share where they sent each conversation and
  session (docs/serve.md, "Several replicas"). With one replica the row is the one without sync.
* ``kvroute default, sessions off``: the same with ``--no-sessions`` (when the proxy has it) and no
  header. On a proxy without sessions (before issue 23), the three kvroute default rows are one
  configuration.
* ``kvroute tokenizer-prefix``: ``--strategy tokenizer-prefix --option block_size=32`` (its default
  tokenizer is the emulator's word vocabulary), no header; ``..., replica sync`` the same with ``--peer``
  as above (the replicas share their key holds and count each other's requests in their share windows);
  ``..., share bound off`` with ``--option share_factor=off`` (its placement before the share bound).
* ``SGLang cache_aware``: SGLang's Rust router (``sglang-router`` 0.3.2 from PyPI, installed in its own
  virtual environment under ``~/.cache/kvroute-bench/sglang-router`` when missing, as
  bench_vs_sglang.py does) with ``--policy cache_aware`` and its defaults.

Printed per row (a Markdown table): the fleet's hit rate (sum of the engines' ``hit_tokens`` over
their ``prompt_tokens``, from ``/emulator/stats``), that as a fraction of the bound, TTFT p50 and p99
(client-side: time to the first SSE event of the streamed chat completion), the busiest and idlest
engine's share of the requests (the engines' own request counts), errors, and the row's wall time.
The bound is the simulator's (``kvroute_simulator.bound.ideal_hit_tokens``): the same requests, in
their nominal order, replayed one at a time through one engine that never evicts, by the engine's own
rules (full blocks only, the last prompt token recomputed, an answer's full blocks findable by the
next turn). No routing can do better; parallel sub-requests sent together cannot all reach it (a
sibling hits its siblings' new blocks only once they are computed). The pooled-LRU reference (one
LRU cache of the fleet's 7 x 512 blocks) is printed too.

Run: ``nice -n 10 python benchmarks/bench_agents.py`` (17 rows, about 22 minutes on 2 cores);
``--only "sessions,SGLang"`` for rows whose label contains one of the substrings, ``--replicas 1``,
``--requests 60`` for a smoke run, ``--rate``, ``--seed``, ``--json FILE``, ``--proxy-args "--session-agree
off"`` for extra ``kvroute serve`` arguments on every kvroute row. Every process is started
in its own process group and stopped by its pid when its row ends, on an error or on Ctrl-C/SIGTERM.
Results in docs/performance.md ("Agent traffic through the proxy").
"""

from __future__ import annotations

import argparse
import array
import asyncio
import contextlib
import json
import os
import random
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import aiohttp
import attrs

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_proxy as bp
from bench_short_prefix import filler
from bench_vs_sglang import ensure_sglang_router

from kvroute.hashing import hash64, hash_parts
from kvroute.vocabulary import vocabulary
from kvroute_simulator.bound import ideal_hit_tokens, pooled_lru_hit_tokens
from kvroute_simulator.engine_config import EngineConfig
from kvroute_simulator.sequences import EngineRequest
from kvroute_simulator.tokens import TokenSeq

KVROUTE = [sys.executable, "-m", "kvroute"]
MODEL = "m"
BLOCK_SIZE = 32
PREAMBLE_CHARS = 12_000


# -- the workload ----------------------------------------------------------------------


@attrs.frozen
class AgentRequest:
    """One request of the workload: its body, its session, when it is due and what it waits for."""

    index: int
    session: int
    turn: int
    sibling: int
    due: float  # seconds after the start, before the wait for its predecessors
    after: tuple[int, ...]  # indices of the requests it waits for
    body: dict[str, Any]
    prompt: tuple[int, ...]  # the emulator's tokens of the prompt
    answer: tuple[int, ...]  # the tokens the emulator will generate


def emulator_answer(prompt: tuple[int, ...], count: int) -> tuple[int, ...]:
    """The tokens ``kvroute emulate`` generates for ``prompt``: a function of the prompt (its generation.py)."""
    key = hash64(array.array("q", prompt).tobytes())
    words = vocabulary().word_ids()
    return tuple(words[hash_parts(key, i) % len(words)] for i in range(count))


def workload(seed: int, requests: int, rate: float) -> list[AgentRequest]:
    """The agent sessions' requests in due order (see the module docstring)."""
    rng = random.Random(seed)
    vocab = vocabulary()
    preamble = "Tools and instructions. " + filler(rng, PREAMBLE_CHARS - 24)
    assert len(preamble) == PREAMBLE_CHARS
    # Sessions as lists of steps (one request, or a fan-out of siblings); times come later.
    sessions: list[list[list[tuple[list[dict[str, Any]], int]]]] = []
    total = 0
    while total < requests:
        s = len(sessions)
        history = [
            {"role": "system", "content": preamble},
            {"role": "user", "content": f"Session {s} task: " + filler(rng, rng.randint(300, 1500))},
        ]
        steps: list[list[tuple[list[dict[str, Any]], int]]] = []
        for turn in range(rng.randint(4, 7)):
            if turn > 0:
                prev_messages, prev_tokens = steps[-1][0]
                answer = vocab.decode(emulator_answer(vocab.render_chat(prev_messages), prev_tokens))
                if rng.random() < 0.75:  # the answer called a tool; its output follows
                    call = f"call_{s}_{turn}"
                    calls = [{"id": call, "type": "function", "function": {"name": "run", "arguments": "{}"}}]
                    text = f"Tool output {s}.{turn}: " + filler(rng, rng.randint(1000, 4000))
                    history = [
                        *prev_messages,
                        {"role": "assistant", "content": answer, "tool_calls": calls},
                        {"role": "tool", "tool_call_id": call, "content": text},
                    ]
                else:
                    text = f"User {s}.{turn}: " + filler(rng, rng.randint(150, 600))
                    history = [
                        *prev_messages,
                        {"role": "assistant", "content": answer},
                        {"role": "user", "content": text},
                    ]
            if turn > 0 and rng.random() < 0.25:
                siblings = rng.randint(2, 4)
                step = [
                    ([*history, {"role": "user", "content": f"Sub-task {j}: " + filler(rng, rng.randint(150, 400))}],
                     rng.randint(16, 32))
                    for j in range(siblings)
                ]  # fmt: skip
            else:
                step = [(history, rng.randint(24, 64))]
            steps.append(step)
            total += len(step)
        sessions.append(steps)
    # Times: sessions start at Poisson times, turns 1-6 s of tool time apart; scaled to `rate` below.
    per_session = total / len(sessions)
    timed: list[tuple[float, int, int, int, list[dict[str, Any]], int]] = []
    start = 0.0
    for s, steps in enumerate(sessions):
        start += rng.expovariate(rate / per_session)
        at = start
        for turn, step in enumerate(steps):
            if turn > 0:
                at += rng.uniform(1.0, 6.0)
            for j, (messages, max_tokens) in enumerate(step):
                timed.append((at, s, turn, j, messages, max_tokens))
    timed.sort(key=lambda t: (t[0], t[1], t[3]))
    timed = timed[:requests]
    scale = (requests / rate) / timed[-1][0] if timed[-1][0] > 0 else 1.0
    out: list[AgentRequest] = []
    last_step: dict[int, list[int]] = {}  # session -> indices of its latest step
    current: dict[int, tuple[int, list[int]]] = {}  # session -> (turn, indices)
    for i, (at, s, turn, j, messages, max_tokens) in enumerate(timed):
        if s in current and current[s][0] != turn:
            last_step[s] = current[s][1]
        if s not in current or current[s][0] != turn:
            current[s] = (turn, [])
        current[s][1].append(i)
        prompt = vocab.render_chat(messages)
        body = {
            "model": MODEL,
            "messages": messages,
            "max_tokens": max_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        after = tuple(last_step.get(s, ())) if turn > 0 else ()
        out.append(AgentRequest(i, s, turn, j, at * scale, after, body, prompt, emulator_answer(prompt, max_tokens)))
    return out


def bounds(reqs: Sequence[AgentRequest], engines: int, blocks: int) -> tuple[float, float]:
    """(ideal, pooled LRU) hit rates of the requests in due order (kvroute_simulator.bound)."""
    config = EngineConfig(block_size=BLOCK_SIZE, capacity_blocks=blocks, max_model_len=32768)
    engine_requests = [
        EngineRequest(f"r{r.index}", TokenSeq.of(r.prompt), len(r.answer), output_tokens=r.answer) for r in reqs
    ]
    hits, total = ideal_hit_tokens(engine_requests, config)
    pooled, _ = pooled_lru_hit_tokens(engine_requests, engines * blocks, config)
    return hits / total, pooled / total


# -- targets ---------------------------------------------------------------------------


@attrs.frozen
class Target:
    """A row: how requests reach the engines."""

    label: str
    kind: str  # "direct", "kvroute" or "sglang"
    args: tuple[str, ...] = ()
    session_header: bool = False
    no_sessions: bool = False
    #: Router-replica sync: every replica gets ``--peer`` for each replica (itself too) and a shared token.
    sync: bool = False


TARGETS = (
    Target("direct random", "direct"),
    Target("kvroute default, sessions on (header sent)", "kvroute", session_header=True),
    Target("kvroute default, sessions on (header sent), replica sync", "kvroute", session_header=True, sync=True),
    Target("kvroute default, no header", "kvroute"),
    Target("kvroute default, no header, replica sync", "kvroute", sync=True),
    Target("kvroute default, sessions off", "kvroute", no_sessions=True),
    Target(
        "kvroute tokenizer-prefix",
        "kvroute",
        ("--strategy", "tokenizer-prefix", "--option", f"block_size={BLOCK_SIZE}"),
    ),
    Target(
        "kvroute tokenizer-prefix, replica sync",
        "kvroute",
        ("--strategy", "tokenizer-prefix", "--option", f"block_size={BLOCK_SIZE}"),
        sync=True,
    ),
    Target(
        "kvroute tokenizer-prefix, share bound off",
        "kvroute",
        ("--strategy", "tokenizer-prefix", "--option", f"block_size={BLOCK_SIZE}", "--option", "share_factor=off"),
    ),
    Target("SGLang cache_aware", "sglang", ("--policy", "cache_aware")),
)


@contextlib.contextmanager
def started(args: Sequence[str], ready_url: str, log: Path) -> Iterator[subprocess.Popen[bytes]]:
    """Run ``args`` in its own process group (output to ``log``) until ready; stop the group by its pid after."""
    with log.open("wb") as out:
        proc = subprocess.Popen(list(args), stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            if proc.poll() is not None:
                tail = log.read_text(errors="replace")[-2000:]
                raise RuntimeError(
                    f"exited with {proc.returncode} before {ready_url} answered: {' '.join(args)}\n{tail}"
                )
            with contextlib.suppress(OSError, ValueError), urllib.request.urlopen(ready_url, timeout=2) as response:
                if response.status == 200:
                    break
            if time.monotonic() > deadline:
                raise TimeoutError(f"{ready_url} not ready after 120 s: {' '.join(args)}")
            time.sleep(0.1)
        time.sleep(0.3)  # a server that lost its port to another program exits now
        if proc.poll() is not None:
            raise RuntimeError(f"exited with {proc.returncode} (port taken?): {' '.join(args)}")
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


def proxy_has_sessions() -> bool:
    """Whether this kvroute's ``serve`` has ``--no-sessions`` (sessions landed in the proxy)."""
    done = subprocess.run([*KVROUTE, "serve", "--help"], capture_output=True, text=True, check=True)
    return "--no-sessions" in done.stdout


@contextlib.contextmanager
def fleet(
    target: Target, replicas: int, args: argparse.Namespace, sglang: Path, sessions_flag: bool
) -> Iterator[tuple[list[str], list[str]]]:
    """Fresh engines and routers; yields (the URLs the client sends to, the engines' URLs); stops them all after."""
    with contextlib.ExitStack() as stack:
        logs = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-agents-")))
        engines = []
        for _ in range(args.engines):
            port = bp.free_port()
            url = f"http://127.0.0.1:{port}"
            emulate = [*KVROUTE, "emulate", "--port", str(port), "--model", MODEL, "--time-scale", str(args.time_scale),
                       "--block-size", str(BLOCK_SIZE), "--num-gpu-blocks", str(args.blocks)]  # fmt: skip
            stack.enter_context(started(emulate, url + "/health", logs / f"engine-{len(engines)}.log"))
            engines.append(url)
        if target.kind == "direct":
            yield engines, engines
            return
        fronts = []
        ports = [bp.free_port() for _ in range(replicas)]
        peers = [a for p in ports for a in ("--peer", f"http://127.0.0.1:{p}")] if target.sync and replicas > 1 else []
        if peers:
            peers += ["--peer-token", "bench-agents-peer-token"]
        for port in ports:
            url = f"http://127.0.0.1:{port}"
            if target.kind == "sglang":
                command = [str(sglang), "launch", "--host", "127.0.0.1", "--port", str(port), "--worker-urls",
                           *engines, "--log-level", "warn", "--prometheus-host", "127.0.0.1",
                           "--prometheus-port", str(bp.free_port()), *target.args]  # fmt: skip
            else:
                command = [*KVROUTE, "serve", "--port", str(port), "--health-interval", "0", "--no-access-log",
                           "--log-level", "warning", *target.args, *shlex.split(args.proxy_args)]  # fmt: skip
                command += [a for i, e in enumerate(engines) for a in ("--backend", f"e{i}={e}")]
                if target.no_sessions and sessions_flag:
                    command.append("--no-sessions")
                command += peers
            stack.enter_context(started(command, url + "/health", logs / f"router-{len(fronts)}.log"))
            fronts.append(url)
        yield fronts, engines


# -- the client ------------------------------------------------------------------------


@attrs.define
class Outcome:
    ttft: list[float] = attrs.field(factory=list)
    errors: list[str] = attrs.field(factory=list)
    wrong_answers: int = 0


async def drive(reqs: Sequence[AgentRequest], fronts: Sequence[str], seed: int, header: str | None) -> Outcome:
    """Send every request at its due time (after its predecessors finished) to a front picked at random (seeded)."""
    pick = random.Random(seed + 1)
    front_of = [fronts[pick.randrange(len(fronts))] for _ in reqs]
    done = [asyncio.Event() for _ in reqs]
    outcome = Outcome()
    vocab = vocabulary()
    timeout = aiohttp.ClientTimeout(total=300)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as session:
        t0 = time.perf_counter()

        async def one(r: AgentRequest) -> None:
            try:
                await asyncio.sleep(max(0.0, t0 + r.due - time.perf_counter()))
                for i in r.after:
                    await done[i].wait()
                headers = {header: f"agent-session-{r.session}"} if header else {}
                sent = time.perf_counter()
                first = None
                text: list[str] = []
                url = front_of[r.index] + "/v1/chat/completions"
                async with session.post(url, json=r.body, headers=headers) as resp:
                    if resp.status != 200:
                        outcome.errors.append(f"request {r.index}: status {resp.status}: {(await resp.text())[:200]}")
                        return
                    buffer = b""
                    async for chunk in resp.content.iter_any():
                        if first is None:
                            first = time.perf_counter() - sent
                        buffer += chunk
                    for line in buffer.decode().splitlines():
                        if line.startswith("data: ") and line != "data: [DONE]":
                            event = json.loads(line[6:])
                            for choice in event.get("choices") or ():
                                text.append(choice.get("delta", {}).get("content") or "")
                if first is not None:
                    outcome.ttft.append(first)
                if "".join(text) != vocab.decode(r.answer):
                    outcome.wrong_answers += 1
            except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
                outcome.errors.append(f"request {r.index}: {type(exc).__name__}: {exc}")
            finally:
                done[r.index].set()

        async with asyncio.TaskGroup() as tg:
            for r in reqs:
                tg.create_task(one(r))
    return outcome


async def engine_stats(engines: Sequence[str]) -> list[dict[str, Any]]:
    async with aiohttp.ClientSession() as session:
        out = []
        for url in engines:
            async with session.get(url + "/emulator/stats") as resp:
                resp.raise_for_status()
                out.append(await resp.json())
        return out


def pct(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def run_row(
    target: Target, replicas: int, reqs: Sequence[AgentRequest], args: argparse.Namespace, sglang: Path, flag: bool
) -> dict[str, Any]:
    started = time.monotonic()
    load = os.getloadavg()[0]
    with fleet(target, replicas, args, sglang, flag) as (fronts, engines):

        async def bounded() -> tuple[Outcome, list[dict[str, Any]]]:
            async with asyncio.timeout(args.timeout):
                outcome = await drive(reqs, fronts, args.seed, args.session_header if target.session_header else None)
            return outcome, await engine_stats(engines)

        outcome, stats = asyncio.run(bounded())
    hit = sum(s["engine"]["hit_tokens"] for s in stats)
    prompt = sum(s["engine"]["prompt_tokens"] for s in stats)
    counts = sorted(s["requests"] for s in stats)
    return {
        "target": target.label,
        "replicas": replicas,
        "hit_rate": hit / prompt if prompt else 0.0,
        "ttft_p50_ms": pct(outcome.ttft, 0.5) * 1000,
        "ttft_p99_ms": pct(outcome.ttft, 0.99) * 1000,
        "busiest": counts[-1] / max(sum(counts), 1),
        "idlest": counts[0] / max(sum(counts), 1),
        "requests": sum(counts),
        "errors": len(outcome.errors),
        "error_samples": outcome.errors[:3],
        "wrong_answers": outcome.wrong_answers,
        "seconds": time.monotonic() - started,
        "load_before": load,
    }


def _stop_on_sigterm() -> None:
    """SIGTERM unwinds like Ctrl-C, so every started process group is stopped on the way out."""

    def handler(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, handler)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default="", help="comma-separated substrings of row labels to run (default: all)")
    parser.add_argument("--replicas", default="1,4", help="router replica counts, comma-separated [1,4]")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--rate", type=float, default=6.0, help="requests per second on average [6]")
    parser.add_argument("--engines", type=int, default=7)
    parser.add_argument("--blocks", type=int, default=512, help=f"KV blocks of {BLOCK_SIZE} tokens per engine [512]")
    parser.add_argument("--time-scale", type=float, default=1.0, help="emulators' wall s per simulated s [1]")
    parser.add_argument("--session-header", default="x-session-id", help="the header the sessions-on rows send")
    parser.add_argument("--timeout", type=float, default=600, help="seconds one row's traffic may take [600]")
    parser.add_argument(
        "--cache-dir",
        type=Path,
        default=Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "kvroute-bench",
        help="where SGLang's router gets its virtual environment [~/.cache/kvroute-bench]",
    )
    parser.add_argument("--json", type=Path, help="write the rows' figures to this file")
    parser.add_argument(
        "--proxy-args", default="", help="extra kvroute serve arguments for every kvroute row ('--session-agree off')"
    )
    args = parser.parse_args()
    _stop_on_sigterm()
    wanted = [w.strip() for w in args.only.split(",") if w.strip()]
    targets = [t for t in TARGETS if not wanted or any(w in t.label for w in wanted)]
    if not targets:
        parser.error(f"--only matched no row (got {args.only!r}; rows: {', '.join(t.label for t in TARGETS)})")
    replica_counts = [int(n) for n in args.replicas.split(",")]
    sglang = ensure_sglang_router(args.cache_dir) if any(t.kind == "sglang" for t in targets) else Path()
    flag = proxy_has_sessions()
    reqs = workload(args.seed, args.requests, args.rate)
    ideal, pooled = bounds(reqs, args.engines, args.blocks)
    sessions = len({r.session for r in reqs})
    prompt_chars = statistics.mean(sum(len(m["content"]) for m in r.body["messages"]) for r in reqs)
    print(
        f"{len(reqs)} requests of {sessions} sessions at {args.rate:g}/s (seed {args.seed}), mean prompt "
        f"{prompt_chars:,.0f} characters / {statistics.mean(len(r.prompt) for r in reqs):,.0f} tokens; "
        f"{args.engines} emulators, block {BLOCK_SIZE}, {args.blocks} blocks each, time scale {args.time_scale:g}; "
        f"bound {ideal:.3f} (pooled LRU {pooled:.3f}); proxy sessions: {'yes' if flag else 'no'}",
        flush=True,
    )
    print("| target | replicas | hit rate | of bound | TTFT p50 | TTFT p99 | busiest / idlest engine | errors | wall |")
    print("|---|---|---|---|---|---|---|---|---|", flush=True)
    rows = []
    for target in targets:
        for replicas in [1] if target.kind == "direct" else replica_counts:
            row = run_row(target, replicas, reqs, args, sglang, flag)
            rows.append(row)
            errors = str(row["errors"]) + (f" ({row['wrong_answers']} wrong answers)" if row["wrong_answers"] else "")
            print(
                f"| {row['target']} | {replicas if target.kind != 'direct' else '-'} | {row['hit_rate']:.3f} | "
                f"{row['hit_rate'] / ideal:.1%} | {row['ttft_p50_ms']:.0f} ms | {row['ttft_p99_ms']:.0f} ms | "
                f"{row['busiest']:.1%} / {row['idlest']:.1%} | {errors} | {row['seconds']:.0f} s |",
                flush=True,
            )
            for sample in row["error_samples"]:
                print(f"  error: {sample}", file=sys.stderr)
    print(f"load average after: {os.getloadavg()[0]:.1f}")
    if args.json:
        args.json.write_text(json.dumps({"bound": ideal, "pooled_lru": pooled, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
