"""The routing decision's span attributes, shared by kvroute serve and the embedders' plugin."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from kvroute.request import RouteRequest
from kvroute.strategy import Decision
from kvroute_tracing import names

__all__ = ["MAX_CANDIDATES", "decision_attributes", "request_attributes"]

#: At most this many candidate ids go into ``kvroute.route.candidates`` (the count is always exact).
MAX_CANDIDATES = 64
#: Decision detail keys whose value is the prompt tokens the chosen backend is expected to hold.
_REUSE_KEYS = ("matched_tokens",)


def request_attributes(request: RouteRequest) -> dict[str, Any]:
    """What the request says about itself: GenAI operation, model, budget, stream (never its text)."""
    attributes: dict[str, Any] = {
        names.GEN_AI_OPERATION: "chat" if request.endpoint == "chat" else "text_completion",
        names.GEN_AI_REQUEST_MODEL: request.model,
        names.GEN_AI_REQUEST_STREAM: request.stream,
    }
    if request.max_tokens is not None:
        attributes[names.GEN_AI_REQUEST_MAX_TOKENS] = request.max_tokens
    return attributes


def decision_attributes(decision: Decision, candidates: Iterable[str] | None = None) -> dict[str, Any]:
    """The decision as span attributes: strategy, key hash, chosen backend, spill, rank, session, predictions."""
    attributes: dict[str, Any] = {
        names.STRATEGY: decision.strategy,
        names.REASON: decision.reason,
        names.BACKEND: decision.backend.id,
        names.SPILLED: decision.spilled,
        names.DECISION_SECONDS: decision.duration_s,
    }
    if decision.key is not None:
        attributes[names.KEY] = f"{decision.key:016x}"
    if decision.spill_reason is not None:
        attributes[names.SPILL_REASON] = str(decision.spill_reason)
    if decision.data_parallel_rank is not None:
        attributes[names.RANK] = decision.data_parallel_rank
    if candidates is not None:
        ids = sorted(candidates)
        attributes[names.CANDIDATE_COUNT] = len(ids)
        attributes[names.CANDIDATES] = ids[:MAX_CANDIDATES]
    detail = decision.detail
    for key in _REUSE_KEYS:
        value = detail.get(key)
        if isinstance(value, int) and not isinstance(value, bool):
            attributes[names.PREDICTED_REUSE] = value
            break
    kind = detail.get("bound") or detail.get("binds")
    if kind is not None:
        attributes[names.SESSION_KIND] = str(kind)
        attributes[names.SESSION_RESULT] = _session_result(decision)
    if decision.prediction is not None:
        attributes[names.PREDICTED_TTFT] = decision.prediction.ttft_s
    return attributes


def _session_result(decision: Decision) -> str:
    """``stayed``, ``new`` or ``moved``, as ``kvroute_session_routes_total`` counts a session's request."""
    detail = decision.detail
    if detail.get("bound") is not None:
        return "stayed"
    moved_from = detail.get("moved_from")
    if moved_from is None:
        return "new"
    return "stayed" if moved_from == decision.backend.id else "moved"
