"""Issue 27 end to end: one trace from the client through `kvroute serve` into a real vLLM (CPU build).

One vLLM server of its own, started with ``--otlp-traces-endpoint`` at a gRPC OTLP receiver this test runs
on loopback; `kvroute serve` in front of it exports to the same receiver. The client (the ``openai`` SDK)
sends a ``traceparent``. vLLM's request span must be in the client's trace, a child of kvroute's attempt
span, which is a child of kvroute's server span, which is a child of the client's span.
"""

from __future__ import annotations

import os
import random
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from tests.contrib.tracing.receiver import GrpcReceiver, ReceivedSpan
from tests.e2e.vllm.proxy import start_proxy
from tests.e2e.vllm.servers import VllmServer, start_vllm_servers

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(not os.environ.get("KVROUTE_VLLM_PYTHON"), reason="KVROUTE_VLLM_PYTHON is not set"),
]


@pytest.fixture(scope="module")
def receiver() -> Iterator[GrpcReceiver]:
    found = GrpcReceiver().start()
    try:
        yield found
    finally:
        found.stop()


@pytest.fixture(scope="module")
def traced_vllm(
    vllm_python: str, tiny_model: Path, receiver: GrpcReceiver, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[VllmServer]:
    """One vLLM server exporting its spans over OTLP/gRPC to the receiver (batch delay cut to 0.5 s)."""
    logs = tmp_path_factory.mktemp("vllm-tracing-logs")
    env = {"OTEL_BSP_SCHEDULE_DELAY": "500", "OTEL_SERVICE_NAME": "vllm"}
    with start_vllm_servers(
        vllm_python,
        tiny_model,
        1,
        log_dir=logs,
        extra_args=("--otlp-traces-endpoint", receiver.url),
        extra_env=env,
    ) as servers:
        yield servers[0]


def _one(spans: list[ReceivedSpan], **match: str) -> ReceivedSpan:
    found = [s for s in spans if all(getattr(s, k) == v for k, v in match.items())]
    assert len(found) == 1, (
        f"expected one span with {match}, got {[(s.name, s.resource.get('service.name')) for s in spans]}"
    )
    return found[0]


class TestTraceThroughVllm:
    def test_vllm_span_is_a_child_of_the_attempt(
        self, traced_vllm: VllmServer, receiver: GrpcReceiver, tmp_path: Path
    ) -> None:
        """Client span -> kvroute server span -> kvroute attempt span -> vLLM's request span, in one trace."""
        rng = random.Random(27)
        trace_id, client_span = f"{rng.getrandbits(128):032x}", f"{rng.getrandbits(64):016x}"
        tracing = {"endpoint": receiver.url, "protocol": "grpc"}
        with start_proxy(
            [traced_vllm.base_url], "bounded-load", {}, tmp_path, name="tracing", sections={"tracing": tracing}
        ) as proxy:
            client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="k", max_retries=0, timeout=120)
            answer = client.chat.completions.create(
                model=traced_vllm.model,
                messages=[{"role": "user", "content": "Tell me about tracing."}],
                max_tokens=8,
                extra_headers={"traceparent": f"00-{trace_id}-{client_span}-01"},
            )
            assert answer.choices
            # kvroute's three spans and vLLM's: vLLM exports from its own batch processor.
            spans = receiver.trace(trace_id, 4, timeout=60)
        vllm_spans = [s for s in spans if s.resource.get("service.name") == "vllm"]
        kvroute = [s for s in spans if s.resource.get("service.name") == "kvroute"]
        server = _one(kvroute, name="POST /v1/chat/completions")
        attempt = _one(kvroute, name="kvroute.attempt")
        assert server.parent_span_id == client_span
        assert attempt.parent_span_id == server.span_id
        assert attempt.attributes["kvroute.attempt.backend"] == "vllm-0"
        assert len(vllm_spans) == 1, [s.name for s in vllm_spans]
        engine = vllm_spans[0]
        assert engine.parent_span_id == attempt.span_id
        assert engine.trace_id == trace_id
        assert attempt.start_ns <= engine.start_ns
