"""The status page's shadow section: ``shadow`` in /status.json and its markup in /status."""

from __future__ import annotations

from kvroute_server.ops.status import page
from tests.server.harness import Servers, chat_body, http
from tests.server.test_shadow import samples, shared_prefix_texts
from tests.server.test_status import status
from tests.server.test_status_workers import answer, serve_workers


class TestStatusShadow:
    def test_absent_without_shadows(self, servers: Servers) -> None:
        """Without shadows /status.json has ``shadow: null``."""
        proxy = servers.proxy(servers.emulators(1))
        assert status(proxy)["shadow"] is None

    def test_section_matches_metrics(self, servers: Servers) -> None:
        """Per strategy (live first) the section shows the metrics' counts; the funnel ends with the engines' count."""
        proxy = servers.proxy(servers.emulators(3), strategy="random", shadow=("least-outstanding", "consistent-hash"))
        for text in shared_prefix_texts(9):
            assert http("POST", proxy.url + "/v1/chat/completions", chat_body(text))[0] == 200
        doc = status(proxy)
        found = samples(proxy)
        section = doc["shadow"]
        names = [(r["name"], r["role"]) for r in section["strategies"]]
        assert names == [("random", "live"), ("least-outstanding", "shadow"), ("consistent-hash", "shadow")]
        for row in section["strategies"]:
            labels = (("role", row["role"]), ("strategy", row["name"]))
            assert row["decisions"] == found["kvroute_strategy_decisions_total", labels] == 9
            assert row["predicted_reused_tokens"] == found["kvroute_predicted_reused_tokens_total", labels]
            assert row["reusable_tokens"] == found["kvroute_reusable_tokens_total", labels]
            if row["role"] == "shadow":
                agreed = found["kvroute_shadow_agreements_total", (("strategy", row["name"]),)]
                assert row["agreements"] == agreed and row["agreement"] == round(agreed / 9, 4)
        live = section["strategies"][0]
        assert live["agreement"] == 1.0
        funnel = section["funnel"]
        assert funnel["prompt_tokens"] == found["kvroute_cache_view_prompt_tokens_total", ()] > 0
        assert funnel["reusable_anywhere"] == live["reusable_tokens"] >= funnel["predicted_at_chosen"]
        assert funnel["predicted_at_chosen"] == live["predicted_reused_tokens"] > 0
        assert funnel["engine_reported"] == doc["totals"]["cached_tokens"] > 0
        assert funnel["engine_prompt_tokens"] == doc["totals"]["prompt_tokens"]
        ratios = funnel["ratios"]
        assert ratios["predicted_at_chosen"] == round(funnel["predicted_at_chosen"] / funnel["prompt_tokens"], 4)
        assert ratios["engine_reported"] == round(funnel["engine_reported"] / funnel["engine_prompt_tokens"], 4)

    def test_page_has_the_section(self) -> None:
        """The page carries the shadow section, its funnel and its table, shown only when the JSON has ``shadow``."""
        html = page().decode()
        for marker in ('id="shadow"', 'id="funnel"', 'id="shadows"', "shadow(s.shadow)", '"engine_reported"'):
            assert marker in html

    def test_merged_under_workers(self, servers: Servers) -> None:
        """Under --workers 2 each worker runs the shadows on its requests and either worker shows the merged counts."""
        with serve_workers(servers, "--strategy", "random", "--shadow", "least-outstanding") as url:
            for text in shared_prefix_texts(12):
                body = chat_body(text)
                assert http("POST", url + "/v1/chat/completions", body, headers={"connection": "close"})[0] == 200
            for _ in range(4):
                rows = {r["name"]: r for r in answer(url)["shadow"]["strategies"]}
                assert rows["random"]["decisions"] == rows["least-outstanding"]["decisions"] == 12
