"""Fuzzing RouteRequest.from_openai: whatever JSON arrives, only InvalidRequest escapes.

Fixed seed, no example database, and a stated number of examples per property (300), so every
run checks the same inputs; the file runs in a few seconds.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given, seed, settings
from hypothesis import strategies as st

from kvroute import AFFINITY_HEADER, LORA_HEADER, REQUEST_ID_HEADER, InvalidRequest, RouteRequest
from tests.hypothesis_strategies import json_values

EXAMPLES = 300
FUZZ = settings(max_examples=EXAMPLES, database=None, deadline=None)
ENDPOINTS = ("chat", "completions")


def either(valid: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """A field's valid value or any JSON value at all (mostly of the wrong type)."""
    return valid | json_values


# Integers that break naive code: negative, past 64 bits, and past str()'s 4,300-digit limit.
awkward_ints = st.integers() | st.sampled_from([-1, 2**63, 2**64, 10**5000, -(10**5000)])
text = st.text(max_size=12)

part = st.one_of(
    st.fixed_dictionaries({"type": either(st.just("text")), "text": either(text)}),
    st.fixed_dictionaries(
        {
            "type": st.sampled_from(
                ["image_url", "input_image", "input_audio", "audio_url", "video_url", "file", "input_file", "refusal"]
            )
        },
        optional={
            "image_url": either(
                text | st.fixed_dictionaries({}, optional={"url": either(text), "detail": either(text)})
            ),
            "input_audio": either(st.fixed_dictionaries({}, optional={"data": either(text), "format": either(text)})),
            "audio_url": either(st.fixed_dictionaries({}, optional={"url": either(text)})),
            "video_url": either(st.fixed_dictionaries({}, optional={"url": either(text)})),
            "file": either(st.fixed_dictionaries({}, optional={"file_id": either(text), "file_data": either(text)})),
            "file_id": either(text),
        },
    ),
    json_values,
)

message = either(
    st.fixed_dictionaries(
        {},
        optional={
            "role": either(st.sampled_from(["system", "user", "assistant", "tool", "image"])),
            "content": either(st.none() | text | st.lists(part, max_size=3)),
            "name": either(text),
            "tool_calls": either(
                st.lists(st.fixed_dictionaries({"id": either(text), "function": json_values}), max_size=2)
            ),
            "tool_call_id": json_values,
        },
    )
)

prompt = either(
    text
    | st.lists(text, max_size=3)
    | st.lists(awkward_ints, max_size=4)
    | st.lists(st.lists(awkward_ints, max_size=3), max_size=3)
)

#: OpenAI-shaped bodies for both endpoints, every field either right or of any JSON type.
openai_bodies = st.fixed_dictionaries(
    {},
    optional={
        "model": either(st.just("m")),
        "messages": either(st.lists(message, max_size=3)),
        "tools": either(
            st.lists(st.fixed_dictionaries({"type": either(st.just("function")), "function": json_values}), max_size=2)
        ),
        "stream": either(st.booleans()),
        "max_tokens": either(awkward_ints),
        "max_completion_tokens": either(awkward_ints),
        "cache_salt": either(st.text(max_size=130)),
        "lora_adapter": either(text),
        "prompt": prompt,
        "documents": json_values,
        "chat_template_kwargs": json_values,
        "add_special_tokens": json_values,
    },
)

headers = st.dictionaries(
    st.sampled_from([AFFINITY_HEADER, LORA_HEADER, REQUEST_ID_HEADER, "x-other"]), text, max_size=3
)


def parse_or_reject(body: object, request_headers: dict[str, str] | None = None) -> None:
    """Parse ``body`` for both endpoints: a RouteRequest or InvalidRequest, nothing else."""
    for endpoint in ENDPOINTS:
        with contextlib.suppress(InvalidRequest):
            request = RouteRequest.from_openai(body, endpoint=endpoint, headers=request_headers)  # type: ignore[arg-type]
            assert isinstance(request.text, str) and request.endpoint == endpoint


@st.composite
def mutated_json(draw: st.DrawFn) -> bytes:
    """An OpenAI-shaped body serialized, then with a few byte ranges deleted, replaced or inserted."""
    try:
        raw = bytearray(json.dumps(draw(openai_bodies)).encode())
    except ValueError:  # an int past str()'s digit limit: JSON text cannot carry it
        raw = bytearray(b'{"model": "m", "prompt": [1]}')
    for _ in range(draw(st.integers(1, 3))):
        at = draw(st.integers(0, len(raw)))
        cut = draw(st.integers(0, 4))
        raw[at : at + cut] = draw(
            st.binary(max_size=3)
            | st.sampled_from([b"[", b"]", b"{", b"}", b'"', b",", b":", b"null", b"1e999", b"\\u"])
        )
    return bytes(raw)


def deep_list(depth: int, leaf: object = None) -> object:
    value = leaf
    for _ in range(depth):
        value = [value]
    return value


def deep_dict(depth: int) -> object:
    value: object = None
    for _ in range(depth):
        value = {"a": value}
    return value


DEPTH = 100_000
USER: Callable[[object], dict[str, Any]] = lambda content: {"role": "user", "content": content}  # noqa: E731


class TestFromOpenAIFuzz:
    @seed(11)
    @FUZZ
    @given(json_values, headers)
    def test_any_json_value(self, body: object, request_headers: dict[str, str]) -> None:
        """Any JSON value as a body parses or raises InvalidRequest, for both endpoints."""
        parse_or_reject(body, request_headers)

    @seed(11)
    @FUZZ
    @given(openai_bodies, headers)
    def test_openai_shaped_bodies_with_wrong_types(self, body: dict[str, Any], request_headers: dict[str, str]) -> None:
        """A body with every field right or of a wrong type (huge ints included) parses or raises InvalidRequest."""
        parse_or_reject(body, request_headers)

    @seed(11)
    @FUZZ
    @given(st.binary(max_size=64) | mutated_json())
    def test_raw_bytes_that_decode_as_json(self, raw: bytes) -> None:
        """Bytes that json.loads accepts (random or a damaged body) parse or raise InvalidRequest."""
        try:
            body = json.loads(raw)
        except (ValueError, RecursionError):  # not JSON: the host answers 400 before routing
            return
        parse_or_reject(body)

    @pytest.mark.parametrize(
        ("endpoint", "body", "param"),
        [
            ("chat", {"model": "m", "messages": deep_list(DEPTH)}, "messages"),
            ("chat", {"model": "m", "messages": [USER(deep_list(DEPTH))]}, "messages[0].content"),
            ("chat", {"model": "m", "messages": [USER([{"type": "x", "v": deep_list(DEPTH)}])]}, "messages[0].content"),
            ("chat", {"model": "m", "messages": [USER([{"type": "x", "v": deep_dict(DEPTH)}])]}, "messages[0].content"),
            (
                "chat",
                {"model": "m", "messages": [USER([{"type": "image_url", "image_url": {"url": deep_list(DEPTH)}}])]},
                "messages[0].content",
            ),
            (
                "chat",
                {"model": "m", "messages": [USER([{"type": "input_audio", "input_audio": deep_dict(DEPTH)}])]},
                "messages[0].content",
            ),
            ("chat", {"model": "m", "messages": [{"role": "assistant", "tool_calls": deep_list(DEPTH)}]}, "messages"),
            ("chat", {"model": "m", "messages": [{"role": deep_list(DEPTH), "content": "x"}]}, "messages"),
            ("chat", {"model": "m", "messages": [USER("x")], "tools": deep_list(DEPTH)}, "tools"),
            ("chat", {"model": "m", "messages": [USER("x")], "tools": [deep_dict(DEPTH)]}, "tools"),
            ("chat", {"model": deep_list(DEPTH), "messages": [USER("x")]}, "model"),
            ("chat", {"model": "m", "messages": [USER("x")], "max_tokens": deep_list(DEPTH)}, "max_tokens"),
            ("chat", {"model": "m", "messages": [USER("x")], "stream": deep_dict(DEPTH)}, "stream"),
            ("chat", {"model": "m", "messages": [USER("x")], "cache_salt": deep_list(DEPTH)}, "cache_salt"),
            ("completions", {"model": "m", "prompt": deep_list(DEPTH)}, "prompt"),
            ("completions", {"model": "m", "prompt": [deep_list(DEPTH, 1)]}, "prompt"),
            ("chat", {"model": "m", "messages": [{**USER("x"), "name": deep_list(DEPTH)}]}, None),
            ("chat", {"model": "m", "messages": [USER("x")], "documents": deep_list(DEPTH)}, None),
        ],
        ids=lambda v: v if isinstance(v, str) else "",
    )
    def test_deep_nesting_is_an_invalid_request(self, endpoint: Any, body: dict[str, Any], param: str | None) -> None:
        """Values nested 100,000 deep raise InvalidRequest naming the field (never RecursionError),
        or parse when the field is only carried along (name is ignored, documents is stored)."""
        if param is None:
            assert RouteRequest.from_openai(body, endpoint=endpoint).model == "m"
            return
        with pytest.raises(InvalidRequest) as info:
            RouteRequest.from_openai(body, endpoint=endpoint)
        assert info.value.param == param

    def test_deep_nesting_says_how_deep(self) -> None:
        """The error for a too-deep value says what was expected and how deep it was."""
        with pytest.raises(
            InvalidRequest, match=r"'tools' must be JSON nested less deeply than .* \(got 100000 levels\)"
        ):
            RouteRequest.from_openai({"model": "m", "messages": [USER("x")], "tools": deep_list(DEPTH)})

    @pytest.mark.parametrize(
        ("body", "fragment"),
        [
            (
                {"model": "m", "prompt": [10**5000]},
                "token ids must be integers from 0 to 2**64 - 1 (got an integer of 16610 bits)",
            ),
            ({"model": "m", "prompt": [[-1]]}, "(got -1)"),
            ({"model": "m", "prompt": [2**64]}, f"(got {2**64})"),
            (
                {"model": "m", "prompt": "x", "max_tokens": -(10**5000)},
                "'max_tokens' must be a non-negative integer (got an integer of 16610 bits)",
            ),
            (
                {"model": "m", "prompt": "x", "max_tokens": 1.5},
                "'max_tokens' must be a non-negative integer (got float)",
            ),
        ],
    )
    def test_awkward_integers(self, body: dict[str, Any], fragment: str) -> None:
        """Token ids outside 0..2**64-1 and huge max_tokens raise InvalidRequest with a readable 'got'."""
        with pytest.raises(InvalidRequest) as info:
            RouteRequest.from_openai(body, endpoint="completions")
        assert fragment in str(info.value)

    def test_values_json_cannot_encode(self) -> None:
        """Tools that are not JSON (a cycle, bytes, mixed key types) raise InvalidRequest, also past the recursion
        limit."""
        cycle: list[Any] = []
        cycle.append(cycle)
        for tools in ([cycle], [b"x"], [{1: "a", "b": 2}]):
            with pytest.raises(InvalidRequest, match="'tools' must be a JSON value"):
                RouteRequest.from_openai({"model": "m", "messages": [USER("x")], "tools": tools})
        deep_cycle: list[Any] = []
        inner = deep_cycle
        for _ in range(5_000):
            inner.append([])
            inner = inner[0]
        inner.append(deep_cycle)  # deeper than the recursion limit before the cycle closes
        with pytest.raises(InvalidRequest, match=r"'tools' must be JSON nested less deeply .* \(got 5002 levels\)"):
            RouteRequest.from_openai({"model": "m", "messages": [USER("x")], "tools": [deep_cycle]})
