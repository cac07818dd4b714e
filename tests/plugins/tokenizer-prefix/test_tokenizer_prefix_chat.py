"""Chat templates: rendering equals transformers' apply_chat_template, the way engines call it."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kvroute_tokenizer_prefix import ChatTemplate, load_tokenizer, prompt_ids
from kvroute_tokenizer_prefix.chat import detect_content_format, select_template

import kvroute
from kvroute.errors import ConfigError, InvalidRequest
from tests.hypothesis_strategies import conversations

EXPECTATIONS = Path(__file__).with_name("chat_expectations.json")

tools_lists = st.lists(
    st.fixed_dictionaries(
        {
            "type": st.just("function"),
            "function": st.fixed_dictionaries(
                {"name": st.text("abcdefgh_", min_size=1, max_size=8), "description": st.text(max_size=30)}
            ),
        }
    ),
    max_size=2,
).map(lambda tools: tools or None)


def flattened(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """What vLLM hands a string-format template: list content joined from its text parts with newlines."""
    out = []
    for m in messages:
        content = m["content"]
        if isinstance(content, list):
            content = "\n".join(part["text"] for part in content)
        out.append({**m, "content": content})
    return out


@pytest.fixture(scope="module")
def hf_tokenizers(model_dir: Path, parts_model_dir: Path) -> dict[str, Any]:
    """transformers' own tokenizers for both fixture models (skips when transformers is not installed)."""
    pytest.importorskip("transformers", reason="transformers is only installed in the tokenizer-prefix tox env")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    return {
        "string": AutoTokenizer.from_pretrained(str(model_dir)),
        "parts": AutoTokenizer.from_pretrained(str(parts_model_dir)),
    }


class TestParityWithTransformers:
    @settings(max_examples=150)
    @given(messages=conversations, tools=tools_lists)
    def test_string_template_matches_apply_chat_template(
        self,
        hf_tokenizers: dict[str, Any],
        tok: Any,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
    ) -> None:
        """A string-content template renders and tokenizes like apply_chat_template on vLLM's flattened messages."""
        hf = hf_tokenizers["string"]
        expected = hf.apply_chat_template(flattened(messages), tools=tools, add_generation_prompt=True, tokenize=False)
        assert tok.chat_template.render(messages, tools=tools) == expected
        ids = hf.apply_chat_template(flattened(messages), tools=tools, add_generation_prompt=True)["input_ids"]
        assert tok.encode_text(expected) == ids
        if tools is None:
            request = kvroute.RouteRequest.from_openai({"model": "m", "messages": messages})
            assert prompt_ids(tok, request) == ids

    @settings(max_examples=150)
    @given(messages=conversations, generation=st.booleans())
    def test_parts_template_matches_apply_chat_template(
        self, hf_tokenizers: dict[str, Any], parts_model_dir: Path, messages: list[dict[str, Any]], generation: bool
    ) -> None:
        """A template that loops over content parts gets the parts as they are, like apply_chat_template."""
        template = load_tokenizer(parts_model_dir).chat_template
        assert template is not None and template.content_format == "openai"
        expected = hf_tokenizers["parts"].apply_chat_template(
            messages, add_generation_prompt=generation, tokenize=False
        )
        assert template.render(messages, add_generation_prompt=generation) == expected


class TestRecordedExpectations:
    def test_renders_equal_recorded_transformers_output(self, tok: Any, parts_model_dir: Path) -> None:
        """Without transformers, rendering still equals what apply_chat_template produced when recorded."""
        cases = json.loads(EXPECTATIONS.read_text())
        parts = load_tokenizer(parts_model_dir).chat_template
        assert len(cases) >= 4
        for case in cases:
            template = tok.chat_template if case["template"] == "string" else parts
            rendered = template.render(
                case["messages"], tools=case.get("tools"), add_generation_prompt=case["add_generation_prompt"]
            )
            assert rendered == case["expected"], case


class TestChatTemplate:
    def test_string_template_flattens_parts_with_newlines(self, tok: Any) -> None:
        """List content is joined from its text parts with newlines for a string-format template, as vLLM does."""
        messages = [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "a"},
                    {"type": "image_url", "image_url": {"url": "x"}},
                    {"type": "text", "text": "b"},
                ],
            }
        ]
        assert "user\na\nb<|im_end|>" in tok.chat_template.render(messages)

    def test_content_format_detection(self) -> None:
        """A loop over message content means the openai format; reading it as a value means string."""
        assert (
            detect_content_format(
                "{% for m in messages %}{% for p in m['content'] %}{{ p.text }}{% endfor %}{% endfor %}"
            )
            == "openai"
        )
        assert (
            detect_content_format("{% for m in messages %}{% for p in m.content %}{{ p }}{% endfor %}{% endfor %}")
            == "openai"
        )
        assert detect_content_format("{% for m in messages %}{{ m['content'] }}{% endfor %}") == "string"

    def test_none_values_are_dropped(self) -> None:
        """Message keys whose value is None are dropped, so `is defined` checks behave as in transformers."""
        template = ChatTemplate("{% for m in messages %}{{ 'N' if m.name is defined else 'U' }}{% endfor %}")
        assert template.render([{"role": "user", "content": "x", "name": None}]) == "U"

    def test_raise_exception_is_an_invalid_request(self, tok: Any) -> None:
        """A template's raise_exception becomes an InvalidRequest carrying the template's message."""
        with pytest.raises(InvalidRequest, match="Unknown role: wizard"):
            tok.chat_template.render([{"role": "wizard", "content": "x"}])

    def test_tojson_keeps_unicode_and_html(self) -> None:
        """tojson writes non-ASCII and HTML characters as they are (json.dumps, ensure_ascii off)."""
        template = ChatTemplate("{{ messages[0] | tojson }}")
        assert template.render([{"role": "user", "content": "é <b>"}]) == '{"role": "user", "content": "é <b>"}'

    def test_generation_tag_renders_its_body(self) -> None:
        """The {% generation %} tag of assistant-mask templates renders its body."""
        template = ChatTemplate(
            "{% for m in messages %}{% generation %}[{{ m.content }}]{% endgeneration %}{% endfor %}"
        )
        assert template.render([{"role": "assistant", "content": "x"}]) == "[x]"

    def test_special_tokens_and_kwargs_are_variables(self) -> None:
        """Special tokens and chat_template_kwargs are template variables (kwargs win)."""
        template = ChatTemplate("{{ bos_token }}{{ enable_thinking }}", {"bos_token": "<s>"})
        assert template.render([], enable_thinking=False) == "<s>False"

    def test_continue_final_message(self, tok: Any) -> None:
        """continue_final_message leaves the last message open: nothing after its text."""
        messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Sure, here"}]
        text = tok.chat_template.render(messages, add_generation_prompt=False, continue_final_message=True)
        assert text.endswith("<|im_start|>assistant\nSure, here")

    def test_continue_with_generation_prompt_is_rejected(self, tok: Any) -> None:
        """continue_final_message with add_generation_prompt is an InvalidRequest."""
        with pytest.raises(InvalidRequest, match="cannot both be true"):
            tok.chat_template.render([{"role": "user", "content": "x"}], continue_final_message=True)

    def test_bad_template_is_a_config_error(self) -> None:
        """A template that does not compile is a ConfigError with the line."""
        with pytest.raises(ConfigError, match="does not compile"):
            ChatTemplate("{% for m in messages %}")

    def test_named_templates(self) -> None:
        """A list of named templates gives 'tool_use' with tools and 'default' otherwise."""
        raw = [{"name": "default", "template": "D"}, {"name": "tool_use", "template": "T"}]
        assert select_template(raw, with_tools=False) == "D"
        assert select_template(raw, with_tools=True) == "T"
        with pytest.raises(ConfigError, match="none is named 'default'"):
            select_template([{"name": "x", "template": "X"}], with_tools=False)

    def test_template_override_from_a_file(self, model_dir: Path, tmp_path: Path) -> None:
        """The chat_template option may name a file that replaces the model's template."""
        path = tmp_path / "t.jinja"
        path.write_text("{% for m in messages %}<{{ m.content }}>{% endfor %}")
        tok = load_tokenizer(model_dir, chat_template=str(path))
        assert tok.chat_template is not None
        assert tok.chat_template.render([{"role": "user", "content": "x"}]) == "<x>"

    def test_chat_template_jinja_file_wins(self, model_dir: Path, tmp_path: Path) -> None:
        """A chat_template.jinja file beside the tokenizer replaces tokenizer_config.json's template."""
        for f in model_dir.iterdir():
            (tmp_path / f.name).write_bytes(f.read_bytes())
        (tmp_path / "chat_template.jinja").write_text("J{{ messages | length }}")
        tok = load_tokenizer(tmp_path)
        assert tok.chat_template is not None
        assert tok.chat_template.render([{"role": "user", "content": "x"}]) == "J1"
