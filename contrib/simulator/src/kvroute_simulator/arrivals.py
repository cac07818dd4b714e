"""What a workload yields: :class:`Arrival`, one request ready for the router and for an engine."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any, ClassVar, Literal, Protocol

import attrs

from kvroute_simulator.sequences import EngineRequest
from kvroute_simulator.tokens import TokenSeq

__all__ = ["DEFAULT_MODEL", "Arrival", "Workload"]

#: The model named in generated request bodies.
DEFAULT_MODEL = "meta-llama/Llama-3.1-70B-Instruct"


@attrs.frozen
class Arrival:
    """One request of a workload, ready for the router (``body``) and for an engine (``engine_request``)."""

    time: float
    request_id: str
    body: Mapping[str, Any] = attrs.field(repr=False)
    prompt: TokenSeq = attrs.field(repr=False)
    output_len: int
    output_tokens: tuple[int, ...] | None = attrs.field(default=None, repr=False)
    extra_key: str | None = None
    session_id: str | None = None
    follows: str | None = None
    think_time: float = 0.0

    @property
    def endpoint(self) -> Literal["chat", "completions"]:
        """Which OpenAI endpoint the body is for."""
        return "chat" if "messages" in self.body else "completions"

    @property
    def prompt_len(self) -> int:
        """Prompt tokens."""
        return len(self.prompt)

    def engine_request(self) -> EngineRequest:
        """Return what an engine needs to serve this arrival."""
        return EngineRequest(
            self.request_id, self.prompt, self.output_len, output_tokens=self.output_tokens, extra_key=self.extra_key
        )


class Workload(Protocol):
    """A named, seeded generator of arrivals."""

    name: ClassVar[str]

    def arrivals(self) -> Iterator[Arrival]:
        """Return a new iterator over the arrivals, in order of ``time``."""
        ...
