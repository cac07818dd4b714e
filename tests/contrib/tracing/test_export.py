"""kvroute-tracing's exporter set-up: the OTEL_* variables, the settings that win over them, the bounded queue."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from click.testing import CliRunner
from opentelemetry.sdk.trace import TracerProvider

from kvroute.errors import ConfigError
from kvroute.fleet import Fleet
from kvroute_server.cli import serve
from kvroute_server.config import ServerConfig, TracingConfig, load_toml
from kvroute_server.ops.metrics import ProxyMetrics
from kvroute_server.ops.tracing import NoTracing, create_tracing
from kvroute_tracing import BoundedSpanProcessor, ExportSettings, TracingConfigError, make_exporter, resolve
from tests.contrib.tracing.receiver import HttpReceiver


def _resolve(endpoint: str | None = None, protocol: str | None = None, **env: str) -> ExportSettings | None:
    return resolve(endpoint, protocol, None, None, 2048, environ=env)


class TestResolve:
    def test_off_without_an_endpoint(self) -> None:
        """No endpoint in the settings or the environment: tracing is off."""
        assert _resolve() is None

    def test_environment_endpoint_and_protocol(self) -> None:
        """OTEL_EXPORTER_OTLP_ENDPOINT and OTEL_EXPORTER_OTLP_PROTOCOL turn tracing on as the specification says."""
        found = _resolve(OTEL_EXPORTER_OTLP_ENDPOINT="http://c:4317", OTEL_EXPORTER_OTLP_PROTOCOL="grpc")
        assert found is not None and (found.endpoint, found.protocol, found.full_url) == (
            "http://c:4317",
            "grpc",
            False,
        )

    def test_signal_endpoint_is_used_as_given(self) -> None:
        """OTEL_EXPORTER_OTLP_TRACES_ENDPOINT wins over the generic one and is the full URL (no path added)."""
        found = _resolve(
            OTEL_EXPORTER_OTLP_ENDPOINT="http://generic:4318", OTEL_EXPORTER_OTLP_TRACES_ENDPOINT="http://t:1/custom"
        )
        assert found is not None and found.full_url
        assert make_exporter(found)._endpoint == "http://t:1/custom"  # type: ignore[attr-defined]

    def test_settings_win_over_the_environment(self) -> None:
        """--otlp-endpoint and --otlp-protocol win over the variables; HTTP gets /v1/traces appended."""
        found = _resolve(
            "http://flag:4318",
            "http/protobuf",
            OTEL_EXPORTER_OTLP_ENDPOINT="http://env:1",
            OTEL_EXPORTER_OTLP_PROTOCOL="grpc",
        )
        assert found is not None and found.protocol == "http/protobuf"
        assert make_exporter(found)._endpoint == "http://flag:4318/v1/traces"  # type: ignore[attr-defined]

    @pytest.mark.parametrize(
        "env", [{"OTEL_SDK_DISABLED": "true"}, {"OTEL_TRACES_EXPORTER": "none"}], ids=["sdk-disabled", "exporter-none"]
    )
    def test_standard_switches_turn_it_off(self, env: dict[str, str]) -> None:
        """OTEL_SDK_DISABLED=true and OTEL_TRACES_EXPORTER=none turn tracing off even with an endpoint."""
        assert _resolve("http://c:4318", **env) is None

    @pytest.mark.parametrize(
        ("env", "expected"),
        [
            ({"OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"}, "got 'http/json'"),
            ({"OTEL_TRACES_EXPORTER": "zipkin"}, "got 'zipkin'"),
            ({"OTEL_EXPORTER_OTLP_ENDPOINT": "collector:4317"}, "got 'collector:4317'"),
        ],
    )
    def test_unusable_values_are_named(self, env: dict[str, str], expected: str) -> None:
        """An unsupported protocol, exporter or a URL without scheme is an error naming the value."""
        endpoint = None if "OTEL_EXPORTER_OTLP_ENDPOINT" in env else "http://c:4318"
        with pytest.raises(TracingConfigError, match=expected):
            _resolve(endpoint, **env)

    def test_proxy_turns_bad_environment_into_config_error(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """The proxy reports an unusable OTEL_* value as a ConfigError at start, before any request."""
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/json")
        with pytest.raises(ConfigError, match="http/json"):
            create_tracing(TracingConfig(endpoint="http://127.0.0.1:9"), Fleet(), ProxyMetrics(Fleet(), "random"))

    def test_off_by_default(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """The default settings with no OTEL endpoint make NoTracing."""
        monkeypatch.delenv("OTEL_EXPORTER_OTLP_ENDPOINT", raising=False)
        monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", raising=False)
        assert isinstance(create_tracing(ServerConfig().tracing, Fleet(), ProxyMetrics(Fleet(), "random")), NoTracing)


class TestSettings:
    def test_toml_table_and_flags(self, tmp_path: Path) -> None:
        """[tracing] is read from TOML, flags win over it, and --check shows the result."""
        config = tmp_path / "kvroute.toml"
        config.write_text(
            '[tracing]\nendpoint = "http://collector:4318"\nsample_ratio = 0.25\n'
            'service_name = "edge"\nmax_queue = 64\n'
        )
        loaded = load_toml(config)
        assert loaded.tracing == TracingConfig("http://collector:4318", None, 0.25, "edge", 64)
        result = CliRunner().invoke(
            serve,
            [
                *("--config", str(config), "--backend", "http://127.0.0.1:9"),
                *("--otlp-protocol", "grpc", "--trace-sample-ratio", "1", "--check"),
            ],
        )
        assert result.exit_code == 0, result.output
        shown = json.loads(result.stdout)["tracing"]
        assert (
            shown["protocol"] == "grpc"
            and shown["sample_ratio"] == 1.0
            and shown["endpoint"] == "http://collector:4318"
        )

    @pytest.mark.parametrize(
        ("args", "expected"),
        [
            (["--otlp-endpoint", "collector:4318"], "'otlp_endpoint' must be an http:// or https:// URL"),
            (["--trace-sample-ratio", "2"], "'sample_ratio' must be a number from 0 to 1"),
            (["--otlp-protocol", "thrift"], "'thrift' is not one of"),
        ],
    )
    def test_bad_flags_are_named(self, args: list[str], expected: str) -> None:
        """A bad endpoint, ratio or protocol is refused with a message naming it."""
        result = CliRunner().invoke(serve, ["--backend", "http://127.0.0.1:9", *args, "--check"])
        assert result.exit_code != 0
        assert expected in result.output


class TestBoundedProcessor:
    def _spans(self, processor: BoundedSpanProcessor, count: int) -> None:
        provider = TracerProvider()
        provider.add_span_processor(processor)
        tracer = provider.get_tracer("test")
        for i in range(count):
            tracer.start_span(f"s{i}").end()

    def test_failing_collector_counts_export_failures(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """A collector answering 503 makes every batch an export failure, counted per span, and the queue drains."""
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_TIMEOUT", "1")  # the exporter's own retries give up after 1 s
        receiver = HttpReceiver("fail").start()
        drops: list[tuple[str, int]] = []
        settings = resolve(receiver.url, None, None, None, 100, environ={})
        assert settings is not None
        processor = BoundedSpanProcessor(
            make_exporter(settings), max_queue=100, max_batch=10, on_drop=lambda r, n: drops.append((r, n))
        )
        try:
            self._spans(processor, 30)
            assert processor.force_flush(20_000)
            assert processor.dropped["export_failed"] == 30
            assert sum(n for reason, n in drops if reason == "export_failed") == 30
            assert processor.exported == 0
        finally:
            processor.shutdown(1)
            receiver.stop()

    def test_full_queue_drops_without_waiting(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """With the collector hung, on_end never waits on the exporter: spans beyond the queue are dropped and counted
        (the 5 s bound only tells a wait, which would last the exporter's 30 s timeout, from none)."""
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_TIMEOUT", "30")
        receiver = HttpReceiver("hang").start()
        settings = resolve(receiver.url, None, None, None, 5, environ={})
        assert settings is not None
        processor = BoundedSpanProcessor(make_exporter(settings), max_queue=5, max_batch=5, schedule_delay_s=0.01)
        try:
            started = time.perf_counter()
            self._spans(processor, 1000)
            ended = time.perf_counter() - started
            assert processor.dropped["queue_full"] >= 1000 - 10
            assert ended < 5.0, f"making 1,000 spans took {ended:.2f} s with a hung collector"
        finally:
            receiver.stop()
            processor.shutdown(0.5)

    def test_spans_reach_the_collector(self) -> None:
        """Sampled spans are exported, in batches, to a working collector; unsampled ones are not queued."""
        receiver = HttpReceiver().start()
        settings = resolve(receiver.url, None, None, None, 100, environ={})
        assert settings is not None
        processor = BoundedSpanProcessor(make_exporter(settings), max_queue=100, max_batch=7)
        try:
            self._spans(processor, 20)
            assert processor.force_flush(10_000)
            assert processor.exported == 20
            assert sorted(s.name for s in receiver.spans) == sorted(f"s{i}" for i in range(20))
            assert receiver.requests >= 3
        finally:
            processor.shutdown(1)
            receiver.stop()
