"""RouteRequest: parsing OpenAI bodies and rendering the canonical routing text."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given

from kvroute import AFFINITY_HEADER, LORA_HEADER, REQUEST_ID_HEADER, InvalidRequest, RouteRequest
from kvroute.request import render_messages
from tests.hypothesis_strategies import conversations


def chat(messages: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    return {"model": "m", "messages": messages, **extra}


class TestChatParsing:
    def test_string_and_part_list_content_render_the_same(self) -> None:
        """Content given as a string and as a list of text parts gives identical routing text."""
        a = RouteRequest.from_openai(chat([{"role": "user", "content": "hello world"}]))
        b = RouteRequest.from_openai(
            chat([{"role": "user", "content": [{"type": "text", "text": "hello "}, {"type": "text", "text": "world"}]}])
        )
        assert a.text == b.text == "<|user|>hello world\n"

    def test_system_and_tools_render_in_order(self) -> None:
        """Tools come first, then every message in order with its role."""
        tools = [{"type": "function", "function": {"name": "f", "parameters": {"b": 1, "a": 2}}}]
        req = RouteRequest.from_openai(
            chat([{"role": "system", "content": "S"}, {"role": "user", "content": "U"}], tools=tools)
        )
        assert req.text.startswith("<|tools|>")
        assert req.text.index("<|system|>S") < req.text.index("<|user|>U")

    def test_json_key_order_does_not_change_text(self) -> None:
        """Tools with the same content but another key order render identically."""
        t1 = [{"type": "function", "function": {"name": "f", "parameters": {"b": 1, "a": 2}}}]
        t2 = [{"function": {"parameters": {"a": 2, "b": 1}, "name": "f"}, "type": "function"}]
        m = [{"role": "user", "content": "x"}]
        assert RouteRequest.from_openai(chat(m, tools=t1)).text == RouteRequest.from_openai(chat(m, tools=t2)).text

    def test_image_parts_render_as_stable_hash(self) -> None:
        """An image part renders as a short stable marker, not its (possibly huge) URL."""
        url = "data:image/png;base64," + "A" * 10_000
        part = {"type": "image_url", "image_url": {"url": url}}
        text = RouteRequest.from_openai(chat([{"role": "user", "content": [part]}])).text
        assert len(text) < 64 and text.startswith("<|user|><|image:")
        other = {"type": "image_url", "image_url": {"url": url + "B"}}
        assert RouteRequest.from_openai(chat([{"role": "user", "content": [other]}])).text != text

    def test_fields_and_headers(self) -> None:
        """Model, stream, cache_salt, max_tokens and the documented headers are read."""
        req = RouteRequest.from_openai(
            chat([{"role": "user", "content": "x"}], stream=True, cache_salt="tenant-a", max_tokens=7),
            headers={AFFINITY_HEADER: "session-1", LORA_HEADER: "sql-lora", REQUEST_ID_HEADER: "rid-1"},
        )
        assert (req.model, req.stream, req.cache_salt, req.max_tokens) == ("m", True, "tenant-a", 7)
        assert (req.affinity_key, req.lora, req.request_id) == ("session-1", "sql-lora", "rid-1")
        assert req.endpoint == "chat" and req.messages is not None

    def test_request_id_is_created_when_absent(self) -> None:
        """Two requests without an id get two different ids."""
        m = chat([{"role": "user", "content": "x"}])
        assert RouteRequest.from_openai(m).request_id != RouteRequest.from_openai(m).request_id

    @given(conversations, conversations)
    def test_multi_turn_prefixes_nest(self, history: list[dict[str, Any]], more: list[dict[str, Any]]) -> None:
        """Turn N+1's rendering starts with turn N's rendering."""
        assert render_messages(history + more).startswith(render_messages(history))

    @given(conversations)
    def test_rendering_is_deterministic(self, messages: list[dict[str, Any]]) -> None:
        """Identical content renders to identical text."""
        import copy

        assert render_messages(messages) == render_messages(copy.deepcopy(messages))


class TestCompletionsParsing:
    def test_string_prompt(self) -> None:
        """A string prompt is the routing text."""
        req = RouteRequest.from_openai({"model": "m", "prompt": "abc"}, endpoint="completions")
        assert req.text == "abc" and req.token_ids is None

    def test_list_of_strings(self) -> None:
        """A list of prompts renders joined by newlines, so the first prompt leads the prefix."""
        req = RouteRequest.from_openai({"model": "m", "prompt": ["a", "b"]}, endpoint="completions")
        assert req.text == "a\nb"

    def test_token_ids(self) -> None:
        """Token id prompts are kept as token_ids and rendered as text for character prefixes."""
        req = RouteRequest.from_openai({"model": "m", "prompt": [1, 2, 3]}, endpoint="completions")
        assert req.token_ids == (1, 2, 3)
        assert req.text == "<|ids|>1 2 3"

    def test_list_of_token_lists_uses_first(self) -> None:
        """A batch of token prompts routes by the first one."""
        req = RouteRequest.from_openai({"model": "m", "prompt": [[5, 6], [7]]}, endpoint="completions")
        assert req.token_ids == (5, 6)


class TestInvalidRequests:
    @pytest.mark.parametrize(
        ("body", "endpoint", "param", "fragment"),
        [
            ([], "chat", None, "must be a JSON object (got list)"),
            (
                {"messages": [{"role": "user", "content": "x"}]},
                "chat",
                "model",
                "'model' must be a non-empty string (got null)",
            ),
            ({"model": 3, "messages": []}, "chat", "model", "(got int)"),
            ({"model": "m"}, "chat", "messages", "'messages' must be a non-empty list"),
            ({"model": "m", "messages": "hi"}, "chat", "messages", "(got str)"),
            ({"model": "m", "messages": ["hi"]}, "chat", "messages", "'messages[0]' must be an object"),
            ({"model": "m", "messages": [{"content": "x"}]}, "chat", "messages", "'messages[0].role'"),
            ({"model": "m", "messages": [{"role": "user", "content": 5}]}, "chat", "messages[0].content", "(got int)"),
            (
                {"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": 1}]}]},
                "chat",
                "messages[0].content",
                "'messages[0].content[0].text' must be a string",
            ),
            (
                {"model": "m", "messages": [{"role": "user", "content": "x"}], "stream": "yes"},
                "chat",
                "stream",
                "'stream' must be a boolean (got str)",
            ),
            (
                {"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": -1},
                "chat",
                "max_tokens",
                "non-negative integer",
            ),
            (
                {"model": "m", "messages": [{"role": "user", "content": "x"}], "cache_salt": "s" * 129},
                "chat",
                "cache_salt",
                "at most 128 characters (got 129)",
            ),
            (
                {"model": "m", "messages": [{"role": "user", "content": "x"}], "tools": {}},
                "chat",
                "tools",
                "'tools' must be a list",
            ),
            ({"model": "m"}, "completions", "prompt", "'prompt' must be a string"),
            ({"model": "m", "prompt": [1, "a"]}, "completions", "prompt", "(got list)"),
            ({"model": "m", "prompt": 12}, "completions", "prompt", "(got int)"),
        ],
    )
    def test_clear_errors(self, body: Any, endpoint: Any, param: str | None, fragment: str) -> None:
        """Each malformed body raises InvalidRequest naming the field, what was expected and what was got."""
        with pytest.raises(InvalidRequest) as info:
            RouteRequest.from_openai(body, endpoint=endpoint)
        assert fragment in str(info.value)
        assert info.value.param == param
