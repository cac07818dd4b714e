"""Benchmark strategy pick latency, membership-change cost and hash placements (not a test).

Usage: python benchmarks/bench_strategies.py [--quick] [--only pick,change,placement,fleet7,sessions,slo] [--json FILE]

Sections (numbers go to docs/performance.md, "Strategy pick latency"):

* ``pick``: ``strategy.pick(request, candidates)`` for every installed strategy that builds with
  its default options, at 8, 64 and 1,024 backends, with 32 KB of routing text per request
  (the key hashes the first 4,096 characters). ``cold``: every request has a prefix never
  seen (no memoized placement); ``warm``: requests cycle over 200 prefixes. Backends carry a
  random in-flight load of 0-7, so bounded-load computes its caps (with
  ``bounded-load:min_capacity=16`` it skips them at such loads). Median and p99 in microseconds.
* ``change``: cost of one membership change (add, then remove, a backend) at 1,024 backends,
  through a `Router` (so it includes the strategy's ``on_fleet_change``), and of the first pick after it.
* ``placement``: the three hash placements considered for consistent-hash, on equal weights:
  a ring with 256 virtual nodes per backend (KubeAI's setting), Maglev (table size a prime
  >= 100 x backends, kept when one backend comes or goes) and weighted rendezvous (the one
  shipped). Balance: the exact share of the key space each backend owns (ring arcs, Maglev
  slots; rendezvous is exactly 1/N by construction), largest and smallest over the mean, and
  the same measured over 100,000 random keys (whose own sampling deviation is shown); keys
  moved by adding and by removing a backend, and how many of them moved between *other*
  backends; lookup time; build time.
* ``sessions`` (only when named): ``Router.acquire`` + ``release`` for bounded-load over 64 backends with
  sessions off, on without session ids (conversations bound), and on with a session id per request.
* ``slo`` (only when named): the decision time (`Decision.duration_s`: the strategy's pick plus the
  router's SLO-aware choice, `kvroute.slo_choice`) of bounded-load through ``Router.acquire``, at 16
  and 64 backends, without the choice and with it in four cases: ``meets`` (objectives the home
  meets: one prediction), ``misses`` (a 1 ms TTFT objective no backend meets: every candidate
  predicted, the ``sink`` policy), ``misses, unmet=home`` (the same with the default policy: the
  request stays on its home once every candidate was predicted to miss), ``none`` (no objectives:
  the scan window's candidates within the load bound predicted). 32 KB routing text, 200 prefixes
  cycling, fresh engine loads, 0-7 requests in flight.
  Wall clock (``Decision.duration_s``) and the CPU time of the whole ``acquire`` (the choice's
  accounting included) in this thread, which a shared machine's other processes do not inflate.
  ``meets, dry run first``: as ``meets``, after a dry run of the same request (``Router.decide``, as
  the proxy's admission judges a request before its lease); the figures are the lease's.
  The rows above cycle over 200 prompts, each repeated whole. Two ``meets`` rows check that this does
  not flatter the choice: ``growing conversations`` (200 conversations; turn t is the first 16 KB + t x
  256 characters of the text, t cycling over 64 turns, so a turn extends the previous one) and ``every
  prompt new`` (no two prompts share a first block; the strategy's pick then memoizes nothing and
  slows down, the choice does the same work). ``pick``:
  the strategy's own pick (wall clock; it slows down when the choice's moves change the strategy's
  state, as in ``misses`` and ``none``, where the choice sends most requests off their home).
  ``added``: per decision, its time less its pick's (what the choice adds to that decision).
  ``choice cpu``: this thread's CPU time of ``SloChoice.choose`` alone (the two clock reads around it
  are counted in, and in the other columns' slo rows). An untimed pass runs first, so the first row
  is not measured on a cold process.
* ``fleet7``: consistent-hash over 7 instances (SageMaker's published setup): spread of shares
  over 140,000 prompts, keys moved on 7 -> 8 and 7 -> 6, and how the orphans spread.
"""

from __future__ import annotations

import argparse
import bisect
import gc
import json
import logging
import random
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import structlog
import xxhash
from kvroute_consistent_hash import Rendezvous

import kvroute
from kvroute import Backend, BackendState, Fleet, PluginManager, Router, RouteRequest, Sessions
from kvroute.testing import Movement, assign, sample_requests

structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))

SIZES = (8, 64, 1024)
TEXT_CHARS = 32 * 1024
_h = xxhash.xxh3_64_intdigest


def percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def summary(samples_ns: Sequence[int]) -> dict[str, float]:
    us = [s / 1000 for s in samples_ns]
    return {"median_us": round(statistics.median(us), 2), "p99_us": round(percentile(us, 0.99), 2), "n": len(us)}


def base_text(seed: int = 1) -> str:
    rng = random.Random(seed)
    words = ["the", "model", "cache", "prefix", "router", "token", "request", "system", "you", "are", "a", "helpful"]
    out: list[str] = []
    size = 0
    while size < TEXT_CHARS:
        w = rng.choice(words)
        out.append(w)
        size += len(w) + 1
    return " ".join(out)[:TEXT_CHARS]


# -- pick ------------------------------------------------------------------------------


def fleet_of(n: int, seed: int = 0) -> Fleet:
    rng = random.Random(seed)
    fleet = Fleet([Backend(f"backend-{i:04d}") for i in range(n)])
    for state in fleet:
        state.in_flight = rng.randrange(0, 8)
    return fleet


def parse_strategy(spec: str) -> tuple[str, dict[str, str]]:
    """``name`` or ``name:key=value;key=value`` (a strategy with options)."""
    name, _, rest = spec.partition(":")
    return name, dict(part.split("=", 1) for part in rest.split(";") if part)


def bench_pick(strategies: Sequence[str], quick: bool) -> list[dict[str, Any]]:
    plugins = PluginManager()
    text = base_text()
    rows: list[dict[str, Any]] = []
    for spec in strategies:
        name, options = parse_strategy(spec)
        for n in SIZES:
            fleet = fleet_of(n)
            try:
                router = Router(fleet, plugins.create_strategy(name, options), strategy_name=name)
            except kvroute.KvrouteError as exc:
                print(f"skip {name}: {exc}", file=sys.stderr)
                break
            candidates = fleet.candidates()
            strategy = router.strategy
            for mode in ("cold", "warm"):
                count = (600 if n == 1024 else 3000) if quick else (3000 if n == 1024 else 20000)
                pool = 200
                samples: list[int] = []
                for i in range(count):
                    tag = f"{mode}-{i if mode == 'cold' else i % pool:08d}|"
                    request = RouteRequest.from_text(tag + text[len(tag) :], model="model", request_id="r")
                    t0 = time.perf_counter_ns()
                    strategy.pick(request, candidates)
                    samples.append(time.perf_counter_ns() - t0)
                if mode == "warm":
                    samples = samples[pool:]  # the first sighting of each warm prefix is a cold pick
                rows.append({"strategy": spec, "backends": n, "mode": mode, **summary(samples)})
            router.close()
    return rows


# -- SLO-aware choice ------------------------------------------------------------------


def bench_slo(quick: bool) -> list[dict[str, Any]]:
    import attrs

    from kvroute import EngineLoad, Objectives, Predictor
    from kvroute.slo_choice import SloChoice

    class _TimedChoice(SloChoice):
        """Records this thread's CPU time of each `choose`: the part the choice adds to a decision."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.cpu_ns: list[int] = []

        def choose(self, *args: Any, **kwargs: Any) -> Any:
            t0 = time.thread_time_ns()
            try:
                return super().choose(*args, **kwargs)
            finally:
                self.cpu_ns.append(time.thread_time_ns() - t0)

    plugins = PluginManager()
    text = base_text(3)
    rows: list[dict[str, Any]] = []
    meets = Objectives(ttft_s=3600.0, tpot_s=3600.0)
    cases: list[tuple[str, Objectives | None, bool]] = [
        ("off", None, False),
        ("meets", meets, True),
        ("misses", Objectives(ttft_s=0.001), True),
        ("misses, unmet=home", Objectives(ttft_s=0.001), True),
        ("none", None, True),
        ("meets, dry run first", meets, True),
        ("meets, growing conversations", meets, True),
        ("meets, every prompt new", meets, True),
    ]

    def run(n: int, case: str, objectives: Objectives | None, on: bool, count: int) -> dict[str, Any]:
        fleet = fleet_of(n)
        rng = random.Random(n)
        for state in fleet:
            state.load = EngineLoad(running=rng.randrange(0, 40), waiting=rng.randrange(0, 4), observed_at=1e18)
        unmet = "home" if case.endswith("unmet=home") else "sink"
        slo = _TimedChoice(Predictor(), unmet=unmet) if on else None
        router = Router(fleet, plugins.create_strategy("bounded-load"), strategy_name="bounded-load", slo=slo)
        strategy_pick = router.strategy.pick
        pick_ns: list[int] = []

        def timed_pick(request: RouteRequest, candidates: Sequence[BackendState]) -> Any:
            t0 = time.perf_counter_ns()
            try:
                return strategy_pick(request, candidates)
            finally:
                pick_ns.append(time.perf_counter_ns() - t0)

        router.strategy.pick = timed_pick  # type: ignore[method-assign]
        samples: list[int] = []
        cpu: list[int] = []
        gc.collect()
        for i in range(count):
            if case.endswith("growing conversations"):  # turn t of conversation i % 200: 16 KB + t x 256 chars
                tag, end = f"slo-{i % 200:08d}|", TEXT_CHARS // 2 + (i // 200) % 64 * 256
            elif case.endswith("every prompt new"):  # no prompt shares a first block with another
                tag, end = f"slo-{i:08d}|", TEXT_CHARS
            else:  # 200 prompts, each repeated
                tag, end = f"slo-{i % 200:08d}|", TEXT_CHARS
            request = RouteRequest.from_text(tag + text[len(tag) : end], model="model", request_id=f"r{i}")
            if objectives is not None:
                request = attrs.evolve(request, objectives=objectives)
            if case.endswith("dry run first"):
                router.decide(request)  # admission's judgement (kvroute_server.proxy.admission.judge)
            t0 = time.thread_time_ns()
            lease = router.acquire(request)
            cpu.append(time.thread_time_ns() - t0)
            samples.append(int(lease.decision.duration_s * 1e9))
            router.release(lease)
        router.close()
        if case.endswith("dry run first"):  # the lease's pick and choice are every second one
            pick_ns = pick_ns[1::2]
        wall, used, picked = summary(samples[200:]), summary(cpu[200:]), summary(pick_ns[200:])
        added = summary([d - p for d, p in zip(samples[200:], pick_ns[200:], strict=True)])
        choice: dict[str, Any] = {"median_us": "", "p99_us": ""}
        if slo is not None:
            choice = summary((slo.cpu_ns[1::2] if case.endswith("dry run first") else slo.cpu_ns)[200:])
        return {
            "backends": n,
            "slo": case,
            "decision median_us": wall["median_us"],
            "decision p99_us": wall["p99_us"],
            "pick median_us": picked["median_us"],
            "pick p99_us": picked["p99_us"],
            "added median_us": added["median_us"],
            "added p99_us": added["p99_us"],
            "acquire cpu median_us": used["median_us"],
            "acquire cpu p99_us": used["p99_us"],
            "choice cpu median_us": choice["median_us"],
            "choice cpu p99_us": choice["p99_us"],
            "n": wall["n"],
        }

    count = 2000 if quick else 20000
    run(16, "warm-up", None, True, count // 4)  # untimed: the first row is not measured on a cold process
    for n in (16, 64):
        for case, objectives, on in cases:
            rows.append(run(n, case, objectives, on, count))
    return rows


# -- membership change -----------------------------------------------------------------


def bench_change(strategies: Sequence[str], quick: bool) -> list[dict[str, Any]]:
    plugins = PluginManager()
    text = base_text(2)
    rows: list[dict[str, Any]] = []
    rounds = 10 if quick else 40
    for spec in strategies:
        name, options = parse_strategy(spec)
        fleet = fleet_of(1024)
        try:
            router = Router(fleet, plugins.create_strategy(name, options), strategy_name=name)
        except kvroute.KvrouteError:
            continue
        strategy = router.strategy
        add: list[int] = []
        remove: list[int] = []
        first: list[int] = []
        for i in range(rounds):
            t0 = time.perf_counter_ns()
            fleet.add(Backend(f"extra-{i}"))
            add.append(time.perf_counter_ns() - t0)
            request = RouteRequest.from_text(f"{i}|" + text, model="model", request_id="r")
            candidates = fleet.candidates()
            t0 = time.perf_counter_ns()
            strategy.pick(request, candidates)
            first.append(time.perf_counter_ns() - t0)
            t0 = time.perf_counter_ns()
            fleet.remove(f"extra-{i}")
            remove.append(time.perf_counter_ns() - t0)
        rows.append(
            {
                "strategy": spec,
                "add_median_us": summary(add)["median_us"],
                "add_p99_us": summary(add)["p99_us"],
                "remove_median_us": summary(remove)["median_us"],
                "first_pick_median_us": summary(first)["median_us"],
            }
        )
        router.close()
    return rows


# -- placement comparison --------------------------------------------------------------


class Ring:
    """Consistent hashing ring, ``vnodes`` points per backend; lookup by bisection."""

    def __init__(self, ids: Sequence[str], vnodes: int = 256) -> None:
        points = sorted((_h(f"{b}#{v}".encode()), b) for b in ids for v in range(vnodes))
        self.points = [p for p, _ in points]
        self.owners = [b for _, b in points]

    def expected_shares(self) -> dict[str, float]:
        """Each backend's exact share of the key space: the arcs ending at its points."""
        out: Counter[str] = Counter()
        previous = self.points[-1] - 2**64
        for point, owner in zip(self.points, self.owners, strict=True):
            out[owner] += (point - previous) / 2**64
            previous = point
        return dict(out)

    def lookup(self, key: int) -> str:
        i = bisect.bisect(self.points, key)
        return self.owners[i if i < len(self.points) else 0]


def _next_prime(n: int) -> int:
    def prime(m: int) -> bool:
        return m > 1 and all(m % d for d in range(2, int(m**0.5) + 1))

    while not prime(n):
        n += 1
    return n


class Maglev:
    """Maglev hashing (Eisenbud et al., 2016): a lookup table filled by per-backend permutations."""

    def __init__(self, ids: Sequence[str], size: int | None = None) -> None:
        m = size or _next_prime(max(65537, 100 * len(ids)))
        ordered = sorted(ids)
        offsets = [_h(b.encode(), 1) % m for b in ordered]
        skips = [_h(b.encode(), 2) % (m - 1) + 1 for b in ordered]
        nexts = [0] * len(ordered)
        table: list[int] = [-1] * m
        filled = 0
        while True:
            for i in range(len(ordered)):
                c = (offsets[i] + nexts[i] * skips[i]) % m
                while table[c] >= 0:
                    nexts[i] += 1
                    c = (offsets[i] + nexts[i] * skips[i]) % m
                table[c] = i
                nexts[i] += 1
                filled += 1
                if filled == m:
                    self.table = [ordered[t] for t in table]
                    self.m = m
                    return

    def lookup(self, key: int) -> str:
        return self.table[key % self.m]

    def expected_shares(self) -> dict[str, float]:
        """Each backend's exact share: its table slots."""
        return {b: n / self.m for b, n in Counter(self.table).items()}


class Hrw:
    """The shipped placement (kvroute_consistent_hash.Rendezvous), without its memo cache."""

    def __init__(self, ids: Sequence[str]) -> None:
        self.placement = Rendezvous([BackendState(Backend(b)) for b in ids], cache_size=0)

    def lookup(self, key: int) -> str:
        home = self.placement.home(key)
        assert home is not None
        return self.placement.states[home].id

    def expected_shares(self) -> dict[str, float]:
        """Exactly weight / total weight for every backend (the minimum of exponentials)."""
        return {s.id: 1 / len(self.placement) for s in self.placement.states}


def bench_placement(quick: bool) -> list[dict[str, Any]]:
    rng = random.Random(11)
    count = 20000 if quick else 100000
    keys = [rng.getrandbits(64) for _ in range(count)]
    rows: list[dict[str, Any]] = []
    for n in SIZES:
        ids = [f"backend-{i:04d}" for i in range(n)]
        table_size = _next_prime(max(65537, 100 * n))  # Maglev keeps its table size when one backend comes or goes
        builders: dict[str, Callable[[Sequence[str]], Any]] = {
            "ring-256": Ring,
            "maglev": lambda members, m=table_size: Maglev(members, m),
            "rendezvous": Hrw,
        }
        for name, build in builders.items():
            t0 = time.perf_counter()
            placement = build(ids)
            build_ms = (time.perf_counter() - t0) * 1000
            lookup = placement.lookup
            t0 = time.perf_counter_ns()
            base = [lookup(k) for k in keys]
            lookup_us = (time.perf_counter_ns() - t0) / count / 1000
            shares = Counter(base)
            mean = count / n
            exact = placement.expected_shares()
            grown_lookup = build([*ids, "backend-new"]).lookup
            shrunk_lookup = build(ids[1:]).lookup
            grown = [grown_lookup(k) for k in keys]
            shrunk = [shrunk_lookup(k) for k in keys]
            out = Movement(tuple(base), tuple(grown))
            in_ = Movement(tuple(base), tuple(shrunk))
            rows.append(
                {
                    "placement": name,
                    "backends": n,
                    "max_share_over_mean": round(max(shares[b] for b in ids) / mean, 3),
                    "min_share_over_mean": round(min(shares[b] for b in ids) / mean, 3),
                    "exact_max_over_mean": round(max(exact.values()) * n, 3),
                    "exact_min_over_mean": round(min(exact.get(b, 0.0) for b in ids) * n, 3),
                    "sampling_sd": round((1 / mean) ** 0.5, 3),
                    "add_moved": round(out.fraction, 4),
                    "add_ideal": round(1 / (n + 1), 4),
                    "add_moved_elsewhere": sum(1 for i in out.moved if grown[i] != "backend-new"),
                    "remove_moved": round(in_.fraction, 4),
                    "remove_moved_not_owned": sum(1 for i in in_.moved if base[i] != ids[0]),
                    "lookup_us": round(lookup_us, 2),
                    "build_ms": round(build_ms, 1),
                }
            )
            gc.collect()
    return rows


# -- seven instances -------------------------------------------------------------------


def bench_fleet7(quick: bool) -> dict[str, Any]:
    count = 35000 if quick else 140000
    requests = sample_requests(count, seed=17)
    router = Router.create(Fleet([Backend(f"instance-{i}") for i in range(7)]), "consistent-hash")
    base = assign(router.strategy, requests, router.fleet.candidates())
    shares = {b: n / count for b, n in Counter(base).items()}
    router.fleet.add(Backend("instance-7"))
    grown = assign(router.strategy, requests, router.fleet.candidates())
    router.fleet.remove("instance-7")
    router.fleet.remove("instance-3")
    shrunk = assign(router.strategy, requests, router.fleet.candidates())
    out, in_ = Movement(base, grown), Movement(base, shrunk)
    survivors = {f"instance-{i}": 1 / 6 for i in range(7) if i != 3}
    return {
        "keys": count,
        "min_share_pct": round(100 * min(shares.values()), 2),
        "max_share_pct": round(100 * max(shares.values()), 2),
        "ideal_pct": round(100 / 7, 2),
        "scale_out_moved_pct": round(100 * out.fraction, 2),
        "scale_out_ideal_pct": round(100 / 8, 2),
        "scale_out_moved_elsewhere": sum(1 for i in out.moved if grown[i] != "instance-7"),
        "scale_in_moved_pct": round(100 * in_.fraction, 2),
        "scale_in_moved_not_owned": sum(1 for i in in_.moved if base[i] != "instance-3"),
        "scale_in_worst_survivor_over_fair": round(in_.worst_spread(survivors), 3),
    }


# -- sessions ---------------------------------------------------------------------------


def _agent_turn(session: int, turns: int, preamble: str) -> dict[str, Any]:
    messages: list[dict[str, Any]] = [{"role": "system", "content": preamble}]
    for t in range(turns):
        if t:
            messages.append({"role": "assistant", "content": f"done step {t}"})
        messages.append({"role": "user", "content": f"session {session}: step {t} of the task"})
    return {"model": "m", "messages": messages}


def bench_sessions(quick: bool) -> list[dict[str, Any]]:
    """``Router.acquire`` + ``release`` with bounded-load over 64 backends: sessions off, on, and per kind of request.

    Chat requests under one 12,000-character preamble, 2-6 turns, 2,000 conversations cycled (so most
    requests find a binding); ``session id`` rows send ``x-session-id``.
    """
    preamble = base_text(3)[:12_000]
    n = 3_000 if quick else 30_000
    bodies = [_agent_turn(i % 2000, 2 + i % 5, preamble) for i in range(4000)]
    rows = []
    for label, sessions, with_id in (
        ("sessions off", False, False),
        ("sessions on, no session id (conversations)", True, False),
        ("sessions on, session id", True, True),
    ):
        fleet = fleet_of(64)
        router = Router.create(fleet, "bounded-load", {}, sessions=Sessions() if sessions else None)
        requests = [
            RouteRequest.from_openai(b, headers={"x-session-id": f"s{i % 2000}"} if with_id else {})
            for i, b in enumerate(bodies)
        ]
        samples = []
        for i in range(n):
            request = requests[i % len(requests)]
            t0 = time.perf_counter_ns()
            lease = router.acquire(request)
            router.release(lease)
            samples.append(time.perf_counter_ns() - t0)
        rows.append({"router": label, **summary(samples[n // 10 :])})
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return "(none)"
    heads = list(rows[0])
    lines = ["| " + " | ".join(heads) + " |", "|" + "---|" * len(heads)]
    lines += ["| " + " | ".join(str(r[h]) for h in heads) + " |" for r in rows]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer samples (a smoke run)")
    parser.add_argument("--only", default="pick,change,placement,fleet7", help="comma-separated sections")
    parser.add_argument(
        "--strategies",
        default="random,least-outstanding,consistent-hash,bounded-load,bounded-load:min_capacity=16",
        help="comma-separated; NAME:key=value;key=value for options",
    )
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args()
    sections = set(args.only.split(","))
    strategies = [s for s in args.strategies.split(",") if s]
    results: dict[str, Any] = {"python": sys.version.split()[0]}
    if "pick" in sections:
        results["pick"] = bench_pick(strategies, args.quick)
        print("## pick latency (32 KB routing text)\n" + table(results["pick"]) + "\n", flush=True)
    if "change" in sections:
        results["change"] = bench_change(strategies, args.quick)
        print("## membership change at 1,024 backends\n" + table(results["change"]) + "\n", flush=True)
    if "placement" in sections:
        results["placement"] = bench_placement(args.quick)
        print("## placements compared (equal weights)\n" + table(results["placement"]) + "\n", flush=True)
    if "fleet7" in sections:
        results["fleet7"] = bench_fleet7(args.quick)
        print("## consistent-hash over 7 instances\n" + table([results["fleet7"]]) + "\n", flush=True)
    if "sessions" in sections:
        results["sessions"] = bench_sessions(args.quick)
        print("## acquire + release with sessions (bounded-load, 64 backends)\n" + table(results["sessions"]) + "\n")
    if "slo" in sections:
        results["slo"] = bench_slo(args.quick)
        print("## decision time with the SLO-aware choice (bounded-load)\n" + table(results["slo"]) + "\n")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
