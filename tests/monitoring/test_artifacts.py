"""contrib/deploy/monitoring checked offline: promtool on the rules, and the dashboard's structure.

promtool comes with Debian's ``prometheus`` package; without it these tests fail and say so.
"""

from __future__ import annotations

import json
import re
import subprocess
from typing import Any

import pytest
import yaml

from tests.monitoring.stack import DASHBOARD, MONITORING, RULES, RULES_TEST, require


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [require("promtool"), *args], cwd=MONITORING, capture_output=True, text=True, timeout=60, check=False
    )


def alert_rules() -> list[dict[str, Any]]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return [rule for group in groups for rule in group["rules"] if "alert" in rule]


def query_panels() -> list[dict[str, Any]]:
    dashboard = json.loads(DASHBOARD.read_text())
    found = []
    for panel in dashboard["panels"]:
        found += panel.get("panels", [])
        if panel["type"] != "row":
            found.append(panel)
    return found


class TestRules:
    """kvroute-rules.yml and its unit tests, through promtool."""

    def test_promtool_check_rules_passes(self) -> None:
        """`promtool check rules` accepts the rules file."""
        result = promtool("check", "rules", RULES.name)
        assert result.returncode == 0, f"expected promtool check rules to pass, got:\n{result.stdout}{result.stderr}"

    def test_promtool_unit_tests_pass(self) -> None:
        """`promtool test rules` passes every unit test of the rules."""
        result = promtool("test", "rules", RULES_TEST.name)
        assert result.returncode == 0, f"expected promtool test rules to pass, got:\n{result.stdout}{result.stderr}"

    def test_every_alert_is_shown_firing_by_a_unit_test(self) -> None:
        """Each alert has a unit test in which it fires (and one in which it stays quiet)."""
        tests = yaml.safe_load(RULES_TEST.read_text())["tests"]
        checks = [check for test in tests for check in test.get("alert_rule_test", [])]
        for rule in alert_rules():
            name = rule["alert"]
            fired = [c for c in checks if c["alertname"] == name and c.get("exp_alerts")]
            quiet = [c for c in checks if c["alertname"] == name and not c.get("exp_alerts")]
            assert fired, f"{name}: expected a unit test where it fires, got none"
            assert quiet, f"{name}: expected a unit test where it stays quiet, got none"

    def test_every_alert_has_severity_and_summary(self) -> None:
        """Each alert carries a severity label an Alertmanager can route on, and a summary."""
        for rule in alert_rules():
            assert rule.get("labels", {}).get("severity") in {"warning", "critical"}, (
                f"{rule['alert']}: expected severity warning or critical, got {rule.get('labels')}"
            )
            assert rule.get("annotations", {}).get("summary"), f"{rule['alert']}: expected a summary annotation"

    def test_the_issue_alerts_exist(self) -> None:
        """Reuse collapsed, a backend ejected, fleet stale and spills rising each have an alert."""
        names = {rule["alert"] for rule in alert_rules()}
        wanted = {"KvroutePrefixReuseCollapsed", "KvrouteBackendEjected", "KvrouteFleetStale", "KvrouteSpillsRising"}
        assert wanted <= names, f"expected {sorted(wanted)}, got {sorted(names)}"


class TestDashboard:
    """kvroute-dashboard.json as Grafana imports it."""

    def test_variables(self) -> None:
        """A Prometheus data source variable, then multi-value instance and backend variables with All."""
        variables = {v["name"]: v for v in json.loads(DASHBOARD.read_text())["templating"]["list"]}
        assert variables["datasource"]["type"] == "datasource", f"got {variables['datasource']}"
        assert variables["datasource"]["query"] == "prometheus", f"got {variables['datasource']}"
        for name in ("instance", "backend"):
            variable = variables[name]
            assert variable["type"] == "query" and variable["multi"] and variable["includeAll"], f"got {variable}"
            assert variable["datasource"]["uid"] == "${datasource}", f"{name}: got {variable['datasource']}"

    def test_every_query_uses_the_datasource_variable(self) -> None:
        """Every panel and every target queries the data source the variable names."""
        for panel in query_panels():
            assert panel["datasource"]["uid"] == "${datasource}", f"{panel['title']!r}: got {panel['datasource']}"
            assert panel["targets"], f"{panel['title']!r}: expected queries, got none"
            for target in panel["targets"]:
                assert target["datasource"]["uid"] == "${datasource}", f"{panel['title']!r}: got {target}"

    def test_queries_use_only_known_variables(self) -> None:
        """Queries name only the dashboard's variables and Grafana's built-ins."""
        known = {"instance", "backend", "datasource", "__rate_interval", "__interval", "__range"}
        for panel in query_panels():
            for target in panel["targets"]:
                used = {a or b for a, b in re.findall(r"\$\{(\w+)\}|\$(\w+)", target["expr"])}
                assert used <= known, f"{panel['title']!r}: unknown variables {sorted(used - known)}"

    def test_layout(self) -> None:
        """Panel ids are unique and panels fit the 24-column grid without overlapping."""
        panels = json.loads(DASHBOARD.read_text())["panels"]
        ids = [p["id"] for p in panels]
        assert len(ids) == len(set(ids)), f"expected unique ids, got {ids}"
        taken: set[tuple[int, int]] = set()
        for panel in panels:
            grid = panel["gridPos"]
            assert grid["x"] >= 0 and grid["x"] + grid["w"] <= 24, f"{panel['title']!r}: got {grid}"
            cells = {
                (x, y) for x in range(grid["x"], grid["x"] + grid["w"]) for y in range(grid["y"], grid["y"] + grid["h"])
            }
            assert not cells & taken, f"{panel['title']!r} overlaps another panel at {grid}"
            taken |= cells

    def test_latency_panels_show_exemplars(self) -> None:
        """Every query of the TTFT and request-duration histograms asks Grafana for their trace-id exemplars."""
        targets = [t for p in query_panels() for t in p["targets"]]
        latency = [
            t for t in targets if re.search(r"kvroute_(upstream_ttft|request_duration)_seconds_bucket", t["expr"])
        ]
        assert len(latency) == 5, f"expected 3 TTFT and 2 duration queries, got {len(latency)}"
        assert all(t.get("exemplar") is True for t in latency), [t["refId"] for t in latency if not t.get("exemplar")]

    @pytest.mark.parametrize(
        "needle",
        [
            "kvroute_requests_total",
            "by (outcome)",
            "histogram_quantile(0.5, sum by (backend, le) (rate(kvroute_upstream_ttft_seconds_bucket",
            "histogram_quantile(0.9, sum by (backend, le) (rate(kvroute_upstream_ttft_seconds_bucket",
            "histogram_quantile(0.99, sum by (backend, le) (rate(kvroute_upstream_ttft_seconds_bucket",
            "histogram_quantile(0.99, sum by (backend, le) (rate(kvroute_request_duration_seconds_bucket",
            "vllm:prefix_cache_hits_total",
            "kvroute_prompt_tokens_cached_total",
            "kvroute_in_flight",
            "vllm:num_requests_waiting",
            "by (reason) (rate(kvroute_spills_total",
            "kvroute_routing_decision_seconds_bucket",
            "kvroute_backend_healthy",
            "kvroute_ejections_total",
            "kvroute_discovery_last_success_timestamp_seconds",
            "kvroute_discovery_stale",
            "by (strategy, role) (rate(kvroute_predicted_reused_tokens_total",
            "rate(kvroute_shadow_agreements_total",
            'rate(kvroute_reusable_tokens_total{instance=~"$instance", role="live"}',
            "sum by (kind) (kvroute_sessions{",
            "sum by (kind, result) (rate(kvroute_session_routes_total",
            "kvroute_session_moves_total",
            "kvroute_sessions_dropped_total",
            "kvroute_session_ids_ignored_total",
            "sum by (backend, le) (rate(kvroute_ttft_prediction_error_seconds_bucket",
            "sum by (backend, le) (rate(kvroute_ttft_prediction_ratio_bucket",
            "sum by (priority, result) (rate(kvroute_admission_requests_total",
            "sum by (reason) (rate(kvroute_objectives_ignored_total",
            "kvroute_admission_queue_length",
            "kvroute_admission_wait_seconds_bucket",
            "kvroute_peer_up",
            "kvroute_peer_discovered",
            "kvroute_peer_holds_sent_total",
            "kvroute_peer_holds_received_total",
            "kvroute_peer_holds_adopted_total",
            "kvroute_peer_holds_dropped_total",
            "kvroute_peer_discovery_changes_total",
            "kvroute_peer_discovery_failures_total",
            "kvroute_peer_discovery_stale",
        ],
    )
    def test_covers(self, needle: str) -> None:
        """The dashboard has a query for each signal an operator watches (docs/monitoring.md)."""
        exprs = [t["expr"] for p in query_panels() for t in p["targets"]]
        assert any(needle in e for e in exprs), f"expected a query containing {needle!r}, got none"
