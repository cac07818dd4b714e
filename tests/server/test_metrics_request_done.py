"""`ProxyMetrics.request_done`: the series one finished request moves, read back from the exposition text; and
`render_merged`, the workers' merged exposition."""

from __future__ import annotations

import struct
import threading
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.parser import text_string_to_metric_families

from kvroute import Backend, Fleet
from kvroute_server.ops.metrics import ProxyMetrics, RequestOutcome, render_merged

OK, UPSTREAM_ERROR = RequestOutcome.OK, RequestOutcome.UPSTREAM_ERROR


def samples(metrics: ProxyMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of the rendered exposition, by name and sorted labels."""
    text = metrics.render().decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def make_metrics() -> ProxyMetrics:
    return ProxyMetrics(Fleet([Backend("e1"), Backend("e2")]), "bounded-load")


class TestRequestDone:
    def test_counts_by_backend_and_outcome(self) -> None:
        """Each call adds one to its (backend, strategy, outcome) series, whichever calls came before."""
        metrics = make_metrics()
        for backend, outcome in [("e1", OK), ("e2", OK), ("e1", OK), ("e1", UPSTREAM_ERROR)]:
            metrics.request_done(backend, outcome, 0.01)
        got = samples(metrics)
        count = "kvroute_requests_total"
        assert got[count, (("backend", "e1"), ("outcome", "ok"), ("strategy", "bounded-load"))] == 2
        assert got[count, (("backend", "e2"), ("outcome", "ok"), ("strategy", "bounded-load"))] == 1
        assert got[count, (("backend", "e1"), ("outcome", "upstream_error"), ("strategy", "bounded-load"))] == 1

    def test_durations_by_backend(self) -> None:
        """Durations land in the backend's histogram: count, sum and the bucket each falls in."""
        metrics = make_metrics()
        metrics.request_done("e1", OK, 0.003)
        metrics.request_done("e1", UPSTREAM_ERROR, 0.2)
        metrics.request_done("e2", OK, 0.003)
        got = samples(metrics)
        e1 = (("backend", "e1"),)
        assert got["kvroute_request_duration_seconds_count", e1] == 2
        assert abs(got["kvroute_request_duration_seconds_sum", e1] - 0.203) < 1e-9
        assert got["kvroute_request_duration_seconds_bucket", (("backend", "e1"), ("le", "0.005"))] == 1
        assert got["kvroute_request_duration_seconds_bucket", (("backend", "e1"), ("le", "0.25"))] == 2
        assert got["kvroute_request_duration_seconds_count", (("backend", "e2"),)] == 1

    def test_no_duration_series_without_a_backend(self) -> None:
        """A request that never reached a backend (duration None) is counted but makes no duration series."""
        metrics = make_metrics()
        metrics.request_done("none", RequestOutcome.REJECTED, None)
        got = samples(metrics)
        labels = (("backend", "none"), ("outcome", "rejected"), ("strategy", "bounded-load"))
        assert got["kvroute_requests_total", labels] == 1
        durations = [key for key in got if key[0].startswith("kvroute_request_duration")]
        assert not [key for key in durations if ("backend", "none") in key[1]]

    def test_same_series_as_child(self) -> None:
        """Counts made through `ProxyMetrics.child` and through request_done add up in one series."""
        metrics = make_metrics()
        metrics.child(metrics.requests, "e1", "bounded-load", "ok").inc()
        metrics.request_done("e1", OK, None)
        key = ("kvroute_requests_total", (("backend", "e1"), ("outcome", "ok"), ("strategy", "bounded-load")))
        assert samples(metrics)[key] == 2


class TestRequestOutcome:
    def test_label_values(self) -> None:
        """The outcomes are the ``outcome`` label values docs/serve.md documents (dashboards and alerts match them)."""
        assert {str(outcome) for outcome in RequestOutcome} == {
            "ok",
            "client_error",
            "upstream_error",
            "failed",
            "stream_error",
            "timeout",
            "cancelled",
            "no_backend",
            "rejected",
            "internal_error",
        }

    def test_label_is_the_plain_word(self) -> None:
        """An outcome labels its series with its value, not the enum's name."""
        metrics = make_metrics()
        metrics.request_done("e1", RequestOutcome.NO_BACKEND, None)
        labels = (("backend", "e1"), ("outcome", "no_backend"), ("strategy", "bounded-load"))
        assert samples(metrics)["kvroute_requests_total", labels] == 1


class TestRenderMerged:
    def test_a_worker_file_caught_being_created_is_read_again(self, tmp_path: Path) -> None:
        """An empty worker file (created, not yet sized) is read again until it is valid, instead of a 500."""
        registry = CollectorRegistry()
        MultiProcessCollector(registry, path=str(tmp_path))
        db = tmp_path / "counter_123.db"
        db.write_bytes(b"")
        with pytest.raises(struct.error):
            generate_latest(registry)  # what prometheus-client does on its own
        timer = threading.Timer(0.002, lambda: db.write_bytes(struct.pack("i", 8) + b"\0" * 4))
        timer.start()
        try:
            assert render_merged(registry) == b""
        finally:
            timer.join()

    def test_a_file_that_stays_unreadable_still_raises(self, tmp_path: Path) -> None:
        """A file that never becomes readable is not hidden: the error comes out after the retries."""
        registry = CollectorRegistry()
        MultiProcessCollector(registry, path=str(tmp_path))
        (tmp_path / "counter_123.db").write_bytes(b"")
        with pytest.raises(struct.error):
            render_merged(registry)
