"""kvroute.keys.prefix_key: what goes into a prefix key, and that it is stable."""

from __future__ import annotations

import subprocess
import sys

import pytest
from hypothesis import given

from kvroute import RouteRequest
from kvroute.keys import DEFAULT_PREFIX_LENGTH, prefix_key
from tests.hypothesis_strategies import prompt_text


def req(text: str, **kw: object) -> RouteRequest:
    return RouteRequest.from_text(text, **kw)  # type: ignore[arg-type]


class TestPrefixKey:
    def test_golden_value(self) -> None:
        """The key layout is pinned: a change would silently split caches between router versions."""
        assert f"{prefix_key(req('hello', model='m')):016x}" == "e80e6c7a5a904150"

    def test_only_the_prefix_counts(self) -> None:
        """Texts that agree on the first prefix_length characters share a key; others do not."""
        base = "x" * DEFAULT_PREFIX_LENGTH
        assert prefix_key(req(base + "tail one")) == prefix_key(req(base + "another tail"))
        assert prefix_key(req(base[:-1] + "y" + "tail")) != prefix_key(req(base + "tail"))
        assert prefix_key(req("a" * 2000 + "b"), 2000) == prefix_key(req("a" * 2000 + "c"), 2000)

    @given(prompt_text, prompt_text)
    def test_short_requests_hash_what_they_have(self, a: str, b: str) -> None:
        """Requests shorter than prefix_length share a key only when their whole texts are equal."""
        assert (prefix_key(req(a)) == prefix_key(req(b))) == (a == b)

    def test_model_lora_and_salt_split_keys(self) -> None:
        """Model, LoRA adapter and cache_salt each give a different key for the same text."""
        keys = {
            prefix_key(req("same text")),
            prefix_key(req("same text", model="other")),
            prefix_key(req("same text", lora="adapter-a")),
            prefix_key(req("same text", lora="adapter-b")),
            prefix_key(req("same text", cache_salt="tenant-1")),
            prefix_key(req("same text", cache_salt="tenant-2")),
        }
        assert len(keys) == 6

    def test_affinity_key_overrides_text(self) -> None:
        """With an affinity key the text no longer matters, but the tenant still does."""
        a = prefix_key(req("one prompt", affinity_key="session-7"))
        assert a == prefix_key(req("a different prompt", affinity_key="session-7"))
        assert a != prefix_key(req("one prompt", affinity_key="session-8"))
        assert a != prefix_key(req("one prompt", affinity_key="session-7", cache_salt="t"))
        assert a != prefix_key(req("session-7"))

    def test_same_key_in_another_process(self) -> None:
        """A process with a different PYTHONHASHSEED computes the same key."""
        code = (
            "from kvroute import RouteRequest; from kvroute.keys import prefix_key; "
            "print(prefix_key(RouteRequest.from_text('hello \\u00e9', model='m', lora='l', cache_salt='s')))"
        )
        out = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True, env={"PYTHONHASHSEED": "12345"}
        ).stdout
        assert int(out) == prefix_key(req("hello \u00e9", model="m", lora="l", cache_salt="s"))

    @pytest.mark.parametrize("bad", [0, -1, True, 2.5, "4096"])
    def test_bad_prefix_length(self, bad: object) -> None:
        """A prefix length that is not a positive integer is a ValueError saying what was got."""
        with pytest.raises(ValueError, match="'prefix_length' must be a positive integer"):
            prefix_key(req("x"), bad)  # type: ignore[arg-type]
