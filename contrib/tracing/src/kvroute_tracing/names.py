"""Span and attribute names: the OpenTelemetry GenAI and HTTP semantic conventions where they apply, ``kvroute.*``
otherwise.

Plain strings rather than the ``opentelemetry-semantic-conventions`` package's constants: those move between
its ``_incubating`` modules from release to release, and a name on the wire is what a dashboard matches.
No attribute ever holds prompt or completion text.
"""

from __future__ import annotations

# -- spans ---------------------------------------------------------------------------------
#: The routing decision (a child of the request's server span, or of the embedder's current span).
ROUTE_SPAN = "kvroute.route"
#: One try on one backend (a child of the server span); the engine's own span becomes its child.
ATTEMPT_SPAN = "kvroute.attempt"
#: The instrumentation scope's name.
SCOPE = "kvroute"

# -- OpenTelemetry GenAI semantic conventions -------------------------------------------------
GEN_AI_OPERATION = "gen_ai.operation.name"
GEN_AI_REQUEST_MODEL = "gen_ai.request.model"
GEN_AI_REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
GEN_AI_REQUEST_STREAM = "gen_ai.request.stream"
GEN_AI_INPUT_TOKENS = "gen_ai.usage.input_tokens"
GEN_AI_OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
GEN_AI_CACHED_INPUT_TOKENS = "gen_ai.usage.cache_read.input_tokens"

# -- HTTP, URL and server semantic conventions --------------------------------------------------
HTTP_METHOD = "http.request.method"
HTTP_STATUS = "http.response.status_code"
URL_PATH = "url.path"
SERVER_ADDRESS = "server.address"
SERVER_PORT = "server.port"
ERROR_TYPE = "error.type"

# -- kvroute's own ---------------------------------------------------------------------------
REQUEST_ID = "kvroute.request_id"
STRATEGY = "kvroute.route.strategy"
REASON = "kvroute.route.reason"
KEY = "kvroute.route.key"
BACKEND = "kvroute.route.backend"
CANDIDATES = "kvroute.route.candidates"
CANDIDATE_COUNT = "kvroute.route.candidate_count"
SPILLED = "kvroute.route.spilled"
SPILL_REASON = "kvroute.route.spill_reason"
RANK = "kvroute.route.data_parallel_rank"
PREDICTED_REUSE = "kvroute.route.predicted_reused_tokens"
PREDICTED_TTFT = "kvroute.route.predicted_ttft_s"
SESSION_KIND = "kvroute.session.kind"
SESSION_RESULT = "kvroute.session.result"
DECISION_SECONDS = "kvroute.route.decision_s"
SHADOWS_AGREED = "kvroute.shadow.agreed"
SHADOWS_DISAGREED = "kvroute.shadow.disagreed"
ATTEMPT = "kvroute.attempt.number"
ATTEMPT_BACKEND = "kvroute.attempt.backend"
ATTEMPT_RANK = "kvroute.attempt.data_parallel_rank"
FIRST_BYTE = "kvroute.attempt.first_byte_s"
FAILURE = "kvroute.attempt.failure"
RETRY_CAUSE = "kvroute.attempt.retry_cause"
BYTES = "kvroute.attempt.response_bytes"
OUTCOME = "kvroute.outcome"
ATTEMPTS = "kvroute.attempts"
TTFT = "kvroute.ttft_s"
WORKER = "kvroute.worker"
