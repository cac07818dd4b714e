"""A request as an engine sees it (:class:`EngineRequest`) and its progress inside one (:class:`EngineSequence`)."""

from __future__ import annotations

import attrs

from kvroute.validators import positive_integer
from kvroute_simulator.tokens import TokenSeq, root_hash

__all__ = ["EngineRequest", "EngineSequence"]


@attrs.frozen
class EngineRequest:
    """What an engine knows of a request: its tokens, how many it will generate, its cache key.

    ``output_tokens`` are the tokens it will generate, when known (a multi-turn
    conversation's answer): their full blocks are cached like the prompt's, so the next
    turn can hit them. ``extra_key`` (LoRA name, cache_salt) is mixed into the first block.
    """

    request_id: str
    prompt: TokenSeq
    output_len: int = attrs.field(validator=positive_integer)
    output_tokens: tuple[int, ...] | None = attrs.field(default=None, kw_only=True)
    extra_key: str | None = attrs.field(default=None, kw_only=True)

    def __attrs_post_init__(self) -> None:
        if len(self.prompt) < 1:
            raise ValueError(f"request {self.request_id!r}: the prompt must hold at least one token (got 0).")
        if self.output_tokens is not None and len(self.output_tokens) != self.output_len:
            raise ValueError(
                f"request {self.request_id!r}: 'output_tokens' must hold output_len={self.output_len} tokens "
                f"(got {len(self.output_tokens)})."
            )

    def block_hashes(self, block_size: int) -> list[int]:
        """Return the hashes of the full blocks of every known token (prompt, then known output)."""
        seq = self.prompt if self.output_tokens is None else self.prompt.extend(self.output_tokens)
        return seq.block_hashes(block_size, root_hash(self.extra_key))


@attrs.define(eq=False)
class EngineSequence:
    """One request inside an engine, with its progress and its timings (seconds, virtual time)."""

    request: EngineRequest
    arrival: float
    hashes: list[int] = attrs.field(repr=False)
    num_tokens: int
    num_computed: int = 0
    generated: int = 0
    blocks: list[int] = attrs.field(factory=list, repr=False)
    registered: int = 0
    cached_tokens: int | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    preemptions: int = 0
    abort_time: float | None = None

    @property
    def request_id(self) -> str:
        """The request's id."""
        return self.request.request_id

    @property
    def prompt_len(self) -> int:
        """Prompt tokens."""
        return len(self.request.prompt)

    @property
    def ttft(self) -> float | None:
        """Seconds from arrival to the end of the step that produced the first token."""
        return None if self.first_token_time is None else self.first_token_time - self.arrival

    @property
    def finished(self) -> bool:
        """Whether every output token has been generated."""
        return self.finish_time is not None

    @property
    def aborted(self) -> bool:
        """Whether the sequence was aborted before it finished."""
        return self.abort_time is not None
