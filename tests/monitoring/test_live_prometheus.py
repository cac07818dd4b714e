"""The Grafana dashboard and the Prometheus rules against a real Prometheus scraping a live kvroute stack.

Three `kvroute emulate` engines (vLLM's metrics) behind `kvroute serve` (bounded-load with a
concurrency threshold of 2, so concurrent traffic spills; the fleet read from a discovery file),
scraped every second by a Prometheus server started here. The traffic is bounded: a few hundred
requests, half of them streamed, three 503s that are retried elsewhere, and one backend ejected by
failing probes and then restored; sessions (some evicted from a small table, some moved off the
ejected backend); requests with TTFT objectives judged by admission (met, queued, shed); and a second
replica the proxy exchanges session holds with, found through peer discovery files (one also naming a
port nothing listens on, one empty: a failed lookup). Then every query of every dashboard panel, with
the dashboard's variables substituted as Grafana would, must return a finite value through
/api/v1/query.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

from tests.contrib.tracing.receiver import HttpReceiver
from tests.monitoring.stack import DASHBOARD, PEER_TOKEN, Prometheus, proxy_requests, require, start_proxy
from tests.replicas.processes import Process, body, free_port, start_engines, until

pytestmark = pytest.mark.anyio

ENGINES = 3
PREFIXES = 12
REQUESTS = 240
ROUND = 40
CONCURRENCY = 8
#: Session ids the traffic carries, and the proxy's session table: fewer bindings, so some are evicted.
SESSIONS = 12
MAX_SESSIONS = 8
#: Rounds after which the admission, ignored-id and peer requests are sent, one of each per round.
EXTRAS = 3

#: Grafana's built-in variables, as Grafana would fill them for a short time range and 1 s scrapes (the rate
#: interval spans the whole run, so every event of the traffic is inside it).
BUILTINS = {"__rate_interval": "2m", "__interval": "15s", "__range": "5m", "__range_s": "300"}


def regex_escape(value: str) -> str:
    """A label value escaped for a PromQL regex matcher, as Grafana's Prometheus data source does."""
    return re.sub(r"([\\^$*+?.()|{}\[\]])", r"\\\\\1", value)


def substitute(expr: str, values: dict[str, list[str]]) -> str:
    """``expr`` with ``$name`` and ``${name}`` replaced: built-ins, or a multi-value variable set to All."""

    def one(match: re.Match[str]) -> str:
        name = match.group(1) or match.group(2)
        if name in BUILTINS:
            return BUILTINS[name]
        if name not in values:
            raise AssertionError(f"{expr!r} uses ${name}: expected one of {sorted([*values, *BUILTINS])}, got none")
        chosen = values[name]
        return chosen[0] if len(chosen) == 1 else "(" + "|".join(regex_escape(v) for v in chosen) + ")"

    return re.sub(r"\$\{(\w+)\}|\$(\w+)", one, expr)


def panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    """Every panel that queries, rows' nested panels included."""
    found = []
    for panel in dashboard["panels"]:
        found += [p for p in panel.get("panels", [])]
        if panel["type"] != "row":
            found.append(panel)
    return found


async def run_bounded(count: int, send: Callable[[int], Any]) -> None:
    """``send(i)`` for i < count, CONCURRENCY at a time."""
    limit = anyio.Semaphore(CONCURRENCY)

    async def one(i: int) -> None:
        async with limit:
            await send(i)

    async with anyio.create_task_group() as tg:
        for i in range(count):
            tg.start_soon(one, i)


async def fault(client: httpx.AsyncClient, engine: Process, **fields: Any) -> None:
    answer = await client.post(engine.url + "/emulator/faults", json=fields)
    assert answer.status_code == 200, f"expected the emulator to take {fields}, got {answer.status_code} {answer.text}"


@pytest.fixture(scope="module")
async def client() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def collector() -> Iterator[HttpReceiver]:
    """The OTLP receiver the proxy exports its spans to (its sampled requests' trace ids are the exemplars)."""
    receiver = HttpReceiver().start()
    try:
        yield receiver
    finally:
        receiver.stop()


@pytest.fixture(scope="module")
async def stack(
    client: httpx.AsyncClient, tmp_path_factory: pytest.TempPathFactory, collector: HttpReceiver
) -> AsyncIterator[tuple[Prometheus, Process]]:
    """The stack after its traffic, with Prometheus holding every request the proxy counted."""
    require("prometheus")  # before starting anything: fail at once, naming the package
    directory: Path = tmp_path_factory.mktemp("monitoring")
    engines = await start_engines(client, ENGINES, time_scale=0.05)
    started: list[Any] = list(engines)
    try:
        options = {"prefix_length": 1024, "concurrency_threshold": 2}
        # Replica sync: the proxy finds its peers in two discovery files, one naming a second replica (added once
        # that is up) and a port nothing listens on (peer down: its holds dropped), one empty (a failed lookup).
        peers_file, no_peers = directory / "peers.toml", directory / "no-peers.toml"
        down = f"http://127.0.0.1:{free_port()}"
        peers_file.write_text(peer_tables([down]))
        no_peers.write_text("")
        sync = [f'token = "{PEER_TOKEN}"', "interval = 0.2", "timeout = 1.0"]
        sources = [
            line
            for path in (peers_file, no_peers)
            for line in ("[[peers.discovery]]", 'kind = "file"', f"target = {json.dumps(str(path))}", "interval = 0.5")
        ]
        # Admission on (its predictions give the TTFT-prediction histograms), a small session table (evictions).
        extra = ["[admission]", 'mode = "queue"', "max_wait = 2.0", "[sessions]", f"max_sessions = {MAX_SESSIONS}"]
        proxy = await start_proxy(
            client, engines, directory, options, otlp_endpoint=collector.url, extra=[*extra, "[peers]", *sync, *sources]
        )
        started.append(proxy)
        replica = await start_proxy(
            client,
            engines,
            directory,
            options,
            extra=["[peers]", *sync, f"urls = [{json.dumps(proxy.url)}]"],
            name="replica",
        )
        started.append(replica)
        peers_file.write_text(peer_tables([replica.url, down]))
        prometheus = Prometheus(directory, proxy, engines)
        started.append(prometheus)
        await prometheus.ready(client)

        # Prometheus starts scraping a few seconds after it is ready (its scrape manager reloads every 5 s):
        # traffic sent before would reach it as one sample, too few for rate().
        async def scraping() -> bool:
            health = await prometheus.targets_up(client)
            return len(health) == ENGINES + 1 and set(health.values()) == {"up"}

        await until(scraping)

        async def send(i: int) -> None:
            stream = i % 2 == 0
            extra: dict[str, Any] = {"max_tokens": 4}
            if stream:
                extra.update(stream=True, stream_options={"include_usage": True})
            # Every third request names a generous TTFT objective (admitted at once, as `met`).
            headers = {"x-slo-ttft-ms": "60000"} if i % 3 == 0 else {}
            answer = await client.post(
                proxy.url + "/v1/chat/completions",
                json=body(i % PREFIXES, f"Question {i}?", **extra),
                headers=headers,
            )
            assert answer.status_code == 200, f"request {i}: expected 200, got {answer.status_code} {answer.text}"

        async def extras(i: int) -> None:
            """Sent after each of the first rounds (the TTFT predictor has data by then), so that their series grow
            over several scrapes: a critical request with an objective no backend meets waits in the admission
            queue until its deadline, then is sent late; a sheddable one is shed (429) at once; a session id too
            long to use is ignored, and so is its TPOT objective, which is not a number; the second replica's own
            session is a hold it sends the proxy."""
            answer = await client.post(
                proxy.url + "/v1/chat/completions",
                json=body(i, "Urgent?", max_tokens=4),
                headers={"x-slo-ttft-ms": "1", "x-priority": "critical"},
            )
            assert answer.status_code == 200, f"critical {i}: expected 200, got {answer.status_code} {answer.text}"
            answer = await client.post(
                proxy.url + "/v1/chat/completions",
                json=body(i, "Later?", max_tokens=4),
                headers={"x-slo-ttft-ms": "1", "x-priority": "sheddable"},
            )
            assert answer.status_code == 429, f"sheddable {i}: expected 429, got {answer.status_code} {answer.text}"
            answer = await client.post(
                proxy.url + "/v1/chat/completions",
                json=body(i, "Who am I?", max_tokens=4),
                headers={"x-session-id": "s" * 300, "x-slo-tpot-ms": "soon"},
            )
            assert answer.status_code == 200, f"long id {i}: expected 200, got {answer.status_code} {answer.text}"
            answer = await client.post(
                replica.url + "/v1/chat/completions",
                json=body(PREFIXES + i, "Elsewhere?", max_tokens=4),
                headers={"x-session-id": f"replica-{i}"},
            )
            assert answer.status_code == 200, f"replica {i}: expected 200, got {answer.status_code} {answer.text}"

        # Sessions, one at a time: more ids than the table holds, a few after each round (the first are evicted),
        # then the ids still held, newest first, again while e2 is out of rotation (those bound to it move); their
        # bindings are the holds the proxy sends its peers.
        async def session(i: int) -> None:
            answer = await client.post(
                proxy.url + "/v1/chat/completions",
                json=body(i, f"Session {i}?", max_tokens=4),
                headers={"x-session-id": f"user-{i}"},
            )
            assert answer.status_code == 200, f"session {i}: expected 200, got {answer.status_code} {answer.text}"

        await fault(client, engines[1], error_next=3, error_status=503)
        # In rounds a scrape apart, so that every series has several samples while traffic flows.
        for start in range(0, REQUESTS, ROUND):
            await run_bounded(ROUND, lambda i, start=start: send(start + i))
            if start < EXTRAS * ROUND:
                await extras(start // ROUND)
            per_round = SESSIONS // (REQUESTS // ROUND)
            for i in range(start // ROUND * per_round, (start // ROUND + 1) * per_round):
                await session(i)
            await anyio.sleep(1.0)

        # Eject e2 by failing its probes; let Prometheus see it out of rotation; route around it; restore it.
        async def routable(count: int) -> bool:
            return bool((await client.get(proxy.url + "/health")).json().get("routable") == count)

        await fault(client, engines[2], health_status=503)
        await until(lambda: routable(ENGINES - 1))
        for i in reversed(range(SESSIONS - MAX_SESSIONS, SESSIONS)):
            await session(i)
        await anyio.sleep(2.5)
        await run_bounded(ROUND, lambda i: send(REQUESTS + i))
        await fault(client, engines[2], health_status=200)
        await until(lambda: routable(ENGINES))

        async def synced() -> bool:
            text = (await client.get(proxy.url + "/metrics")).text
            return all(
                sum(float(v) for v in re.findall(rf"^{name}(?:{{[^}}]*}})? ([0-9.eE+-]+)$", text, re.M)) > 0
                for name in (
                    "kvroute_peer_holds_received_total",
                    "kvroute_peer_holds_sent_total",
                    "kvroute_peer_holds_dropped_total",
                )
            )

        await until(synced, within=15)
        expected = await proxy_requests(client, proxy)

        async def scraped() -> bool:
            found = await prometheus.query(client, 'sum(kvroute_requests_total{job="kvroute"})')
            healthy = await prometheus.query(client, 'min(kvroute_backend_healthy{job="kvroute"})')
            return (
                bool(found)
                and float(found[0]["value"][1]) == expected
                and bool(healthy)
                and float(healthy[0]["value"][1]) == 1
            )

        await until(scraped)
        yield prometheus, proxy
    finally:
        for process in reversed(started):
            process.stop()


def peer_tables(urls: list[str]) -> str:
    """A peer discovery file: each URL one endpoint."""
    return "".join(f'[[backends]]\nid = "peer{i}"\nurl = "{url}"\n' for i, url in enumerate(urls))


def finite(samples: list[dict[str, Any]]) -> bool:
    return any(math.isfinite(float(s["value"][1])) for s in samples)


class TestDashboardAgainstPrometheus:
    """kvroute-dashboard.json queried through Prometheus' HTTP API after live traffic."""

    @pytest.fixture(scope="class")
    async def variables(self, client: httpx.AsyncClient, stack: tuple[Prometheus, Process]) -> dict[str, list[str]]:
        """Each query variable's values, resolved in the dashboard's order (later ones may use earlier ones)."""
        prometheus, _ = stack
        dashboard = json.loads(DASHBOARD.read_text())
        values: dict[str, list[str]] = {"datasource": ["prometheus"]}
        for variable in dashboard["templating"]["list"]:
            if variable["type"] != "query":
                continue
            query = substitute(variable["query"]["query"], values)
            parsed = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", query)
            assert parsed, f"variable {variable['name']}: expected label_values(SELECTOR, LABEL), got {query!r}"
            values[variable["name"]] = await prometheus.label_values(client, parsed.group(2), parsed.group(1))
        return values

    async def test_variables_list_the_proxy_and_its_backends(
        self, variables: dict[str, list[str]], stack: tuple[Prometheus, Process]
    ) -> None:
        """The instance variable lists the scraped proxy and the backend variable lists every backend id."""
        _, proxy = stack
        assert variables["instance"] == [f"127.0.0.1:{proxy.port}"], f"instance values: got {variables['instance']}"
        assert variables["backend"] == [f"e{i}" for i in range(ENGINES)], f"backend values: got {variables['backend']}"

    async def test_every_panel_query_returns_data(
        self, client: httpx.AsyncClient, variables: dict[str, list[str]], stack: tuple[Prometheus, Process]
    ) -> None:
        """Every target of every panel, variables substituted, returns at least one finite sample."""
        prometheus, _ = stack
        dashboard = json.loads(DASHBOARD.read_text())
        empty = []
        checked = 0
        for panel in panels(dashboard):
            for target in panel["targets"]:
                expr = substitute(target["expr"], variables)
                samples = await prometheus.query(client, expr)
                checked += 1
                if not finite(samples):
                    empty.append(f"{panel['title']!r} {target['refId']}: {expr} -> {samples}")
        assert checked >= 20, f"expected the dashboard's 20+ queries, got {checked}"
        assert not empty, "panel queries without data:\n" + "\n".join(empty)


#: What the traffic did, as panels must show it: (panel title, refId, labels of a sample whose value is > 0).
SHOWN = [
    ("Requests by outcome", "A", {"outcome": "ok"}),
    ("Requests by backend", "A", {"backend": "e2"}),
    ("Spills by reason", "A", {"reason": "concurrency_threshold"}),
    ("Retries by reason", "A", {"backend": "e1", "reason": "upstream_5xx"}),
    ("Ejections and restorations", "A", {"backend": "e2", "cause": "probe"}),
    ("Ejections and restorations", "B", {"backend": "e2"}),
    ("Prefix reuse reported by engines", "A", {}),
    ("Prefix reuse from responses (cached_tokens)", "A", {}),
    ("TTFT p50 / p90 / p99 per backend", "C", {"backend": "e0"}),
    ("Routing decision latency", "B", {"strategy": "bounded-load"}),
    ("Discovery changes", "A", {"change": "added"}),
    ("Discovery freshness", "A", {}),
    ("Sessions bound", "A", {"kind": "session"}),
    ("Session routes", "A", {"kind": "session", "result": "new"}),
    ("Session moves, drops and ignored ids", "A", {"reason": "unroutable"}),
    ("Session moves, drops and ignored ids", "B", {"cause": "evicted"}),
    ("Session moves, drops and ignored ids", "C", {"reason": "too_long"}),
    ("TTFT prediction error per backend", "C", {"backend": "e0"}),
    ("Admission by class and result, ignored objectives", "A", {"priority": "critical", "result": "queued"}),
    ("Admission by class and result, ignored objectives", "B", {"priority": "sheddable", "reason": "predicted_miss"}),
    ("Admission by class and result, ignored objectives", "C", {"reason": "not_a_number"}),
    ("Admission wait p50 / p99", "B", {"priority": "critical", "result": "sent_late"}),
    ("Holds exchanged", "B", {}),
    ("Holds exchanged", "C", {"result": "new"}),
    ("Peers up and discovered", "C", {}),
    ("Peer changes, lookup failures and dropped holds", "A", {"change": "added"}),
    ("Peer changes, lookup failures and dropped holds", "B", {}),
    ("Peer changes, lookup failures and dropped holds", "C", {}),
]


class TestPanelsShowTheTraffic:
    """Panels whose numbers the traffic determines show them, not only some value."""

    @pytest.mark.parametrize(("title", "ref", "labels"), SHOWN, ids=[f"{t} {r}" for t, r, _ in SHOWN])
    async def test_panel_shows_what_happened(
        self,
        client: httpx.AsyncClient,
        stack: tuple[Prometheus, Process],
        title: str,
        ref: str,
        labels: dict[str, str],
    ) -> None:
        """The panel's query has a positive sample with the labels the traffic produced."""
        prometheus, proxy = stack
        dashboard = json.loads(DASHBOARD.read_text())
        values = {"instance": [f"127.0.0.1:{proxy.port}"], "backend": [f"e{i}" for i in range(ENGINES)]}
        (target,) = [t for p in panels(dashboard) if p["title"] == title for t in p["targets"] if t["refId"] == ref]
        samples = await prometheus.query(client, substitute(target["expr"], values))
        hits = [
            s for s in samples if all(s["metric"].get(k) == v for k, v in labels.items()) and float(s["value"][1]) > 0
        ]
        assert hits, f"{title!r} {ref}: expected a sample with {labels} above 0, got {samples}"


class TestRulesAgainstPrometheus:
    """kvroute-rules.yml loaded into the same Prometheus."""

    async def test_every_recording_rule_has_data(
        self, client: httpx.AsyncClient, stack: tuple[Prometheus, Process]
    ) -> None:
        """Every recording rule evaluates without error and its series holds a finite value."""
        prometheus, _ = stack
        rules = [r for r in await prometheus.rules(client) if r["type"] == "recording"]
        assert len(rules) >= 9, f"expected the rules file's recording rules, got {[r['name'] for r in rules]}"

        async def evaluated() -> bool:
            for rule in rules:
                if not finite(await prometheus.query(client, rule["name"])):
                    return False
            return True

        await until(evaluated, within=15)
        broken = [(r["name"], r.get("lastError")) for r in await prometheus.rules(client) if r["health"] != "ok"]
        assert not broken, f"expected every rule healthy, got {broken}"

    async def test_alerts_evaluate_cleanly_and_stay_quiet(
        self, client: httpx.AsyncClient, stack: tuple[Prometheus, Process]
    ) -> None:
        """Every alert rule evaluates on live series without error, and none fires on a healthy fleet."""
        prometheus, _ = stack
        alerts = [r for r in await prometheus.rules(client) if r["type"] == "alerting"]
        assert {a["name"] for a in alerts} >= {
            "KvroutePrefixReuseCollapsed",
            "KvrouteBackendEjected",
            "KvrouteFleetStale",
            "KvrouteSpillsRising",
        }, f"got {[a['name'] for a in alerts]}"
        broken = [(a["name"], a.get("lastError")) for a in alerts if a["health"] != "ok"]
        assert not broken, f"expected every alert rule healthy, got {broken}"
        firing = [a["name"] for a in alerts if a["state"] == "firing"]
        assert not firing, f"expected no alert firing on a healthy fleet, got {firing}"


class TestExemplars:
    """The histograms' trace-id exemplars, scraped as OpenMetrics into Prometheus' exemplar storage."""

    @pytest.mark.parametrize(
        "histogram", ["kvroute_request_duration_seconds_bucket", "kvroute_upstream_ttft_seconds_bucket"]
    )
    async def test_exemplars_name_traces_the_collector_got(
        self,
        client: httpx.AsyncClient,
        stack: tuple[Prometheus, Process],
        collector: HttpReceiver,
        histogram: str,
    ) -> None:
        """Prometheus holds exemplars of the dashboard's latency histograms whose trace ids are traces the proxy
        exported to the collector."""
        prometheus, _ = stack
        found = await prometheus.exemplars(client, f'{histogram}{{job="kvroute"}}')
        trace_ids = {labels["trace_id"] for labels in found if "trace_id" in labels}
        assert trace_ids, f"expected exemplars with a trace_id on {histogram}, got {found[:5]}"
        exported = {s.trace_id for s in collector.wait_for(lambda spans: len(spans) > 0)}
        assert trace_ids & exported, (
            f"expected exemplar trace ids among the exported traces, got {sorted(trace_ids)[:5]}"
        )
