"""What a parity check found: one `ParityCase` per sample, one `ParityReport` per backend."""

from __future__ import annotations

from typing import Any, Literal

import attrs

__all__ = ["ParityCase", "ParityReport", "Status"]

Status = Literal["ok", "mismatch", "skipped"]


@attrs.frozen
class ParityCase:
    """One sample compared: the router's ids, the engine's, and how they were compared.

    ``method`` is ``tokenize`` (ids compared one by one) or ``usage`` (only the count, from a
    one-token completion's ``usage.prompt_tokens``).
    """

    name: str
    kind: Literal["prompt", "chat"]
    status: Status
    method: Literal["tokenize", "usage", "none"] = "tokenize"
    router_count: int | None = None
    engine_count: int | None = None
    first_difference: int | None = None
    router_around: tuple[int, ...] = ()
    engine_around: tuple[int, ...] = ()
    note: str | None = None

    def describe(self) -> str:
        """One line for humans."""
        if self.status == "ok":
            return f"{self.name}: {self.router_count} tokens, identical ({self.method})"
        if self.status == "skipped":
            return f"{self.name}: skipped ({self.note})"
        if self.method == "usage":
            return f"{self.name}: router {self.router_count} tokens, engine {self.engine_count} (usage counts differ)"
        return (
            f"{self.name}: router {self.router_count} tokens, engine {self.engine_count}; first difference at token "
            f"{self.first_difference}: router {list(self.router_around)} vs engine {list(self.engine_around)}"
        )


@attrs.frozen
class ParityReport:
    """The outcome for one backend."""

    backend: str
    model: str | None
    cases: tuple[ParityCase, ...] = ()
    engine_block_size: int | None = None
    block_size_source: str | None = None
    router_block_size: int | None = None
    error: str | None = None

    @property
    def block_size_ok(self) -> bool:
        """False when the strategy hashes fixed-size blocks that differ from the engine's."""
        return (
            self.router_block_size is None
            or self.engine_block_size is None
            or self.router_block_size == self.engine_block_size
        )

    @property
    def compared(self) -> int:
        return sum(c.status != "skipped" for c in self.cases)

    @property
    def ok(self) -> bool:
        """Every compared sample matched, at least one was compared, and block sizes agree."""
        return (
            self.error is None
            and self.compared > 0
            and self.block_size_ok
            and all(c.status != "mismatch" for c in self.cases)
        )

    def to_json(self) -> dict[str, Any]:
        data = attrs.asdict(self, recurse=True)
        data["ok"] = self.ok
        data["block_size_ok"] = self.block_size_ok
        return data

    def lines(self) -> list[str]:
        """A human-readable report."""
        out = [f"backend {self.backend} (model {self.model or '?'})"]
        if self.error is not None:
            out.append(f"  error: {self.error}")
            return out
        if self.engine_block_size is not None:
            out.append(f"  engine block size: {self.engine_block_size} tokens ({self.block_size_source})")
        else:
            out.append("  engine block size: not reported")
        if self.router_block_size is None:
            out.append("  router block size: from the engine (strategy option block_size unset)")
        else:
            agree = (
                "agrees"
                if self.block_size_ok
                else "DIFFERS: set the strategy's block_size to the engine's or leave it unset"
            )
            out.append(f"  router block size: {self.router_block_size} ({agree})")
        out.extend("  " + c.describe() for c in self.cases)
        verdict = "PASS" if self.ok else "FAIL"
        mismatches = sum(c.status == "mismatch" for c in self.cases)
        out.append(f"  {verdict}: {self.compared - mismatches}/{self.compared} samples identical")
        return out
