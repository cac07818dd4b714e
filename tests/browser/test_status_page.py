"""The status page in a real browser, against ``kvroute serve`` and emulated engines with traffic flowing."""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from tests.browser.conftest import PREFIXES, TOKEN, Proxy, Traffic, _free_port
from tests.server.admission_harness import LONG, OBJECTIVE_MS, Occupier, prompt
from tests.server.harness import Servers, chat_body, http

#: How long the page may take to show a change (it polls every 2 s).
SHOW_WITHIN = 15.0


def status_json(proxy: Proxy) -> dict[str, Any]:
    code, _, body = http("GET", proxy.url + "/status.json")
    assert code == 200, f"expected 200 from /status.json, got {code}: {body[:300]!r}"
    return json.loads(body)  # type: ignore[no-any-return]


def requests_metric(proxy: Proxy) -> dict[str, float]:
    """``kvroute_requests_total`` summed per backend, from /metrics."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(http("GET", proxy.url + "/metrics")[2].decode()):
        for sample in family.samples:
            if sample.name == "kvroute_requests_total":
                out[sample.labels["backend"]] = out.get(sample.labels["backend"], 0.0) + sample.value
    return out


def wait_for(predicate: Any, what: str, timeout: float = SHOW_WITHIN) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.1)


def open_page(chromium: Any, proxy: Proxy) -> Any:
    page = chromium.new_page(viewport={"width": 1500, "height": 1000})
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.on("console", lambda msg: errors.append(msg.text) if msg.type == "error" else None)
    page.errors = errors
    page.goto(proxy.url + "/status")
    wait_for(lambda: refreshes(page) >= 1, "the page's first refresh")
    return page


def refreshes(page: Any) -> int:
    return int(page.evaluate("() => Number(document.body.dataset.refreshes || 0)"))


def next_refresh(page: Any) -> None:
    """Wait until the page has fetched /status.json again (after anything that happened before the call)."""
    seen = refreshes(page)
    wait_for(lambda: refreshes(page) >= seen + 2, "two more refreshes of the page")


def cell(page: Any, backend: str, field: str) -> str:
    return str(page.inner_text(f'#backends tr[data-backend="{backend}"] td[data-field="{field}"]')).strip()


def page_text(page: Any, selector: str) -> str:
    return str(page.inner_text(selector)).strip()


def quiesce(proxy: Proxy) -> None:
    wait_for(lambda: status_json(proxy)["totals"]["in_flight"] == 0, "no request in flight")


class TestStatusPageInBrowser:
    """``GET /status`` rendered by headless Chromium while requests flow through the proxy."""

    def test_renders_numbers_matching_json_and_metrics(self, chromium: Any, fleet: Proxy) -> None:
        """Every backend row shows the request count, share and health that /status.json and /metrics give."""
        page = open_page(chromium, fleet)
        with Traffic(fleet.url) as traffic:
            wait_for(lambda: traffic.sent >= 30, "30 requests through the proxy")
        quiesce(fleet)
        next_refresh(page)
        doc = status_json(fleet)
        metric = requests_metric(fleet)
        assert page.inner_text("h1") == "kvroute"
        assert page.inner_text("#strategy").startswith("bounded-load")
        assert int(page.inner_text("#total-routed").replace(",", "")) == doc["totals"]["routed"] == sum(metric.values())
        assert page.locator("#backends tbody tr").count() == 4
        for row in doc["backends"]:
            bid = row["id"]
            shown = int(cell(page, bid, "requests").replace(",", ""))
            assert shown == row["requests"]["total"] == metric.get(bid, 0), bid
            assert cell(page, bid, "share") == f"{100 * row['share']:.1f}%"
            assert cell(page, bid, "state") == "healthy"
            engine = cell(page, bid, "engine")
            assert re.fullmatch(r"\d+ / \d+", engine), f"{bid}: the vllm adapter's load should show (got {engine!r})"
        decisions = page.locator("#decisions tbody tr")
        assert decisions.count() == len(doc["decisions"]["recent"]) == 25
        first = doc["decisions"]["recent"][0]
        assert decisions.first.get_attribute("data-request-id") == first["request_id"]
        assert decisions.first.locator('td[data-field="explain"]').inner_text() == first["explain"]
        content = page.content()
        assert PREFIXES[0][:40] not in content, "prompt text must never reach the page"
        assert page.errors == []

    def test_updates_as_requests_arrive(self, chromium: Any, fleet: Proxy) -> None:
        """Requests sent after the page opened show up in its counters and decisions without a reload."""
        page = open_page(chromium, fleet)
        before = int(page.inner_text("#total-routed").replace(",", ""))
        ids = []
        for i in range(5):
            code, headers, _ = http("POST", fleet.url + "/v1/chat/completions", chat_body(PREFIXES[1] + str(i)))
            assert code == 200
            ids.append(headers["x-request-id"])
        wait_for(
            lambda: int(page.inner_text("#total-routed").replace(",", "")) == before + 5,
            f"the routed count to go from {before} to {before + 5}",
        )
        shown = page.eval_on_selector_all("#decisions tbody tr", "rows => rows.map(r => r.dataset.requestId)")
        assert shown[:5] == list(reversed(ids))
        assert page.errors == []

    def test_sessions_card(self, chromium: Any, fleet: Proxy) -> None:
        """Requests naming sessions show in the Sessions card with the bindings /status.json counts."""
        page = open_page(chromium, fleet)
        for i in range(3):
            body = chat_body(PREFIXES[2] + str(i))
            code, _, _ = http("POST", fleet.url + "/v1/chat/completions", body, headers={"x-session-id": f"s{i}"})
            assert code == 200
        quiesce(fleet)
        next_refresh(page)
        bound = status_json(fleet)["sessions"]["bound"]
        assert bound["session"] >= 3
        assert page.is_visible("#sessions-card")
        shown = page.inner_text("#total-sessions")
        assert shown == f"{bound['session']} + {bound.get('conversation', 0)}"
        assert page.errors == []

    def test_drained_backend_shows_draining(self, chromium: Any, fleet: Proxy) -> None:
        """A backend drained through the admin API while traffic flows turns to 'draining' on the open page."""
        page = open_page(chromium, fleet)
        assert cell(page, "gpu-2", "state") == "healthy"
        with Traffic(fleet.url, clients=8, max_tokens=64) as traffic:
            wait_for(lambda: traffic.sent >= 20, "20 requests through the proxy")
            code, _, body = http(
                "POST", fleet.url + "/admin/backends/gpu-2/drain", {}, headers={"authorization": f"Bearer {TOKEN}"}
            )
            assert code in (200, 202), body
            wait_for(lambda: cell(page, "gpu-2", "state") == "draining", "gpu-2 to show as draining")
            row = page.locator('#backends tr[data-backend="gpu-2"]')
            assert row.get_attribute("data-state") == "draining"
            assert page.inner_text("#total-routable") == "3 / 4"
            # The picture in docs/serve.md: taken while requests flow, after a refresh with more of them.
            sent = traffic.sent
            wait_for(lambda: traffic.sent >= sent + 20, "20 more requests")
            next_refresh(page)
            shot = os.environ.get("KVROUTE_STATUS_SCREENSHOT")
            if shot:
                Path(shot).parent.mkdir(parents=True, exist_ok=True)
                page.screenshot(path=shot)
        assert page.errors == []

    def test_shadow_section(self, chromium: Any, fleet: Proxy) -> None:
        """The shadow section lists the live strategy and its shadows with /status.json's numbers and the funnel."""
        page = open_page(chromium, fleet)
        assert page.locator("#shadow").is_visible()
        with Traffic(fleet.url) as traffic:
            wait_for(lambda: traffic.sent >= 20, "20 requests through the proxy")
        quiesce(fleet)
        next_refresh(page)
        section = status_json(fleet)["shadow"]
        rows = page.eval_on_selector_all("#shadows tbody tr", "rows => rows.map(r => r.dataset.strategy)")
        assert rows == ["bounded-load", "consistent-hash", "least-outstanding"]
        for row in section["strategies"]:
            shown = page.locator(f'#shadows tr[data-strategy="{row["name"]}"] td[data-field="decisions"]').inner_text()
            assert int(shown.replace(",", "")) == row["decisions"] >= 20
            if row["role"] == "shadow":
                agreement = page.locator(f'#shadows tr[data-strategy="{row["name"]}"] td[data-field="agreement"]')
                assert agreement.inner_text().strip() == f"{100 * row['agreement']:.1f}%"
        for key in ("reusable_anywhere", "predicted_at_chosen", "engine_reported"):
            label = page.locator(f'#funnel [data-funnel="{key}"] .lbl').inner_text()
            funnel = section["funnel"]
            assert label == f"{100 * funnel['ratios'][key]:.1f}% · {funnel[key]:,} tokens", (key, label)
        assert page.errors == []

    def test_admin_mode_asks_for_the_token(self, chromium: Any, guarded: Proxy) -> None:
        """With status = admin the page asks for the token, then shows the fleet once it is given."""
        page = chromium.new_page()
        page.goto(guarded.url + "/status")
        page.wait_for_selector("#auth", state="visible", timeout=SHOW_WITHIN * 1000)
        assert page.locator("#backends tbody tr").count() == 0
        page.fill("#token", TOKEN)
        page.click('#auth-form button[type="submit"]')
        page.wait_for_selector('#backends tr[data-backend="solo"]', timeout=SHOW_WITHIN * 1000)
        assert page.locator("#auth").is_hidden()


class TestAdmissionCard:
    """The Admission card, against ``kvroute serve --admission shed`` and one real-time emulated engine."""

    def test_card_shows_shed_requests(self, chromium: Any, servers: Servers) -> None:
        """A request shed while the engine is busy shows in the card with /status.json's numbers."""
        engine = servers.emulator(time_scale=1.0)
        proxy = Proxy([f"id=solo,url={engine.url}"], "--admission", "shed", "--slo-prefill-rate", "500")
        try:
            page = open_page(chromium, proxy)
            assert page.is_visible("#admission-card")
            assert page.inner_text("#admission-held") == "0 held"
            with Occupier(proxy, LONG):  # type: ignore[arg-type]
                body = chat_body(prompt("shed"), max_tokens=4)
                code, headers, _ = http(
                    "POST", proxy.url + "/v1/chat/completions", body, headers={"x-slo-ttft-ms": str(OBJECTIVE_MS)}
                )
                assert code == 429 and headers["retry-after"]
            next_refresh(page)
            slo = status_json(proxy)["slo"]  # type: ignore[arg-type]
            assert slo["shed"] == {"standard": {"predicted_miss": 1}}
            detail = page.inner_text("#admission-detail")
            assert detail.startswith("shed, up to 256 held; shed standard 1"), detail
            assert page.errors == []
        finally:
            proxy.stop()


class TestPeersCard:
    """The Replica sync card, against two ``kvroute serve`` replicas that list each other as peers."""

    def test_card_shows_peers_and_holds(self, chromium: Any, servers: Servers) -> None:
        """Requests routed by one replica reach the other as holds: the sender's card shows its peer up (and its
        own URL as itself), the receiver's the holds /status.json counts; a proxy without peers shows no card."""
        engine = servers.emulator()
        ports = [_free_port(), _free_port()]
        peers = [arg for port in ports for arg in ("--peer", f"http://127.0.0.1:{port}")]
        backend = [f"id=solo,url={engine.url}"]
        first = Proxy(backend, *peers, "--peer-token", "peer-token-0123456789", port=ports[0])
        second = Proxy(backend, *peers, "--peer-token", "peer-token-0123456789", port=ports[1])
        try:
            for i in range(3):
                code, _, body = http("POST", first.url + "/v1/chat/completions", chat_body(f"{PREFIXES[0]} q{i}"))
                assert code == 200, body[:300]
            wait_for(lambda: status_json(second)["peers"]["received"] > 0, "the second replica to receive holds")
            sender = open_page(chromium, first)  # it sent holds: the second answered, its own batch came back 409
            wait_for(lambda: page_text(sender, "#peers-up") == "1 / 1 up", "the sender's card to show its peer up")
            detail = page_text(sender, "#peers-detail")
            assert f"127.0.0.1:{ports[1]} up" in detail and f"127.0.0.1:{ports[0]} self" in detail, detail
            page = open_page(chromium, second)  # it received them, and has sent nothing yet: peers unknown
            next_refresh(page)
            received = status_json(second)["peers"]["received"]
            detail = page_text(page, "#peers-detail")
            assert f"holds received {received:,}, adopted " in detail and "unknown" in detail, (detail, received)
            assert sender.errors == [] and page.errors == []
        finally:
            first.stop()
            second.stop()
        plain = Proxy(backend)
        try:
            page = open_page(chromium, plain)
            assert page.is_hidden("#peers-card")
        finally:
            plain.stop()
