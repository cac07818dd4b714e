"""Chat templates rendered the way inference engines render them.

Engines (vLLM, SGLang, TensorRT-LLM's OpenAI server) turn chat ``messages`` into a prompt with
the model's Jinja chat template, using the semantics of ``transformers``'
``apply_chat_template``; the router must produce the very same text, or its token blocks never
match the engine's. The facts this module follows:

* The template comes from the model's ``chat_template.jinja`` file, else from
  ``tokenizer_config.json``'s ``chat_template``: a string, or a list of ``{"name", "template"}``
  where ``"tool_use"`` is used when tools are given and ``"default"`` otherwise.
* It runs in Jinja's immutable sandbox with ``trim_blocks`` and ``lstrip_blocks``, the
  ``loopcontrols`` extension and a ``{% generation %}`` tag that only renders its body; a
  ``tojson`` filter that does not escape HTML (``json.dumps`` with ``ensure_ascii=False``);
  the globals ``raise_exception(message)`` and ``strftime_now(format)``.
* Variables: ``messages`` (message keys whose value is ``None`` are dropped), ``tools``,
  ``documents``, ``add_generation_prompt``, the tokenizer's special tokens (``bos_token``,
  ``eos_token``...) and any extra keyword (vLLM's ``chat_template_kwargs``).
* Like vLLM, a template that only reads ``message['content']`` as a string (content format
  ``string``) gets list-of-parts content flattened to its text parts joined with ``"\\n"``; a
  template that loops over the parts (format ``openai``) gets the list as it is.
* The rendered text is tokenized without adding special tokens: the template writes them.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from typing import Any, Literal

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from kvroute.errors import ConfigError, InvalidRequest

__all__ = ["ChatTemplate", "ContentFormat", "select_template"]

ContentFormat = Literal["string", "openai"]

# Appended to the last message when continuing it, then cut away with everything after it.
_CONTINUE_MARK = "\ue000kvroute-continue\ue001"


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` (assistant-mask templates): renders its body."""

    tags = {"generation"}  # noqa: RUF012 - Jinja reads a plain set

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Callable[[], str]) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None, sort_keys: bool = False
) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _mentions_content(node: jinja2.nodes.Node) -> bool:
    """Whether an expression reads a ``content`` attribute or item (``m.content``, ``m['content']``)."""
    for sub in [node, *node.find_all((jinja2.nodes.Getattr, jinja2.nodes.Getitem))]:
        if isinstance(sub, jinja2.nodes.Getattr) and sub.attr == "content":
            return True
        if (
            isinstance(sub, jinja2.nodes.Getitem)
            and isinstance(sub.arg, jinja2.nodes.Const)
            and sub.arg.value == "content"
        ):
            return True
    return False


def detect_content_format(source: str) -> ContentFormat:
    """``openai`` if the template loops over a message's content (list of parts), else ``string``."""
    try:
        ast = _environment().parse(source)
    except jinja2.TemplateSyntaxError:
        return "string"
    for loop in ast.find_all(jinja2.nodes.For):
        if _mentions_content(loop.iter):
            return "openai"
    return "string"


def select_template(raw: object, *, with_tools: bool) -> str | None:
    """Pick the template text from a ``chat_template`` value (string or list of named templates)."""
    if raw is None or isinstance(raw, str):
        return raw
    if isinstance(raw, list):
        named: dict[str, str] = {}
        for item in raw:
            if (
                not isinstance(item, Mapping)
                or not isinstance(item.get("name"), str)
                or not isinstance(item.get("template"), str)
            ):
                raise ConfigError(
                    '\'chat_template\' must be a string or a list of {"name": str, "template": str} objects '
                    f"(got an item {item!r:.80})."
                )
            named[item["name"]] = item["template"]
        if with_tools and "tool_use" in named:
            return named["tool_use"]
        if "default" in named:
            return named["default"]
        raise ConfigError(f"'chat_template' lists templates {sorted(named)} but none is named 'default'.")
    raise ConfigError(f"'chat_template' must be a string or a list of named templates (got {type(raw).__name__}).")


def _flatten_content(content: object, where: str) -> object:
    if not isinstance(content, list):
        return content
    texts = []
    for i, part in enumerate(content):
        if not isinstance(part, Mapping):
            raise InvalidRequest(
                f"'{where}[{i}]' must be a content part object (got {type(part).__name__}).", param="messages"
            )
        if part.get("type") == "text" or ("text" in part and "type" not in part):
            text = part.get("text")
            if not isinstance(text, str):
                raise InvalidRequest(
                    f"'{where}[{i}].text' must be a string (got {type(text).__name__}).", param="messages"
                )
            texts.append(text)
    return "\n".join(texts)


def _plain(value: Any) -> Any:
    """A deep copy made of dicts and lists, so that the template never sees mapping proxies or tuples."""
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


class ChatTemplate:
    """A compiled chat template plus the special tokens it may read.

    ``render(messages, ...)`` returns the prompt text an engine would build. Compilation
    happens once; rendering a few messages costs tens of microseconds.
    """

    def __init__(
        self,
        source: str,
        special_tokens: Mapping[str, str] | None = None,
        *,
        content_format: ContentFormat | Literal["auto"] = "auto",
        tool_source: str | None = None,
    ) -> None:
        if not isinstance(source, str) or not source:
            raise ConfigError(f"a chat template must be a non-empty string (got {source!r:.60}).")
        env = _environment()
        try:
            self._template = env.from_string(source)
            self._tool_template = env.from_string(tool_source) if tool_source else None
        except jinja2.TemplateSyntaxError as exc:
            raise ConfigError(f"the chat template does not compile: {exc} (line {exc.lineno}).") from None
        self.source = source
        self.special_tokens = dict(special_tokens or {})
        if content_format not in ("auto", "string", "openai"):
            raise ConfigError(f"'content_format' must be one of auto, string, openai (got {content_format!r}).")
        self.content_format: ContentFormat = (
            detect_content_format(source) if content_format == "auto" else content_format
        )

    def _messages(self, messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
        out = []
        for i, message in enumerate(messages):
            if not isinstance(message, Mapping):
                raise InvalidRequest(
                    f"'messages[{i}]' must be an object (got {type(message).__name__}).", param="messages"
                )
            plain = {k: _plain(v) for k, v in message.items() if v is not None}
            if self.content_format == "string" and "content" in plain:
                plain["content"] = _flatten_content(plain["content"], f"messages[{i}].content")
            out.append(plain)
        return out

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        documents: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        **kwargs: Any,
    ) -> str:
        """Render a conversation; raises `InvalidRequest` when the template rejects it."""
        chat = self._messages(messages)
        if continue_final_message:
            if add_generation_prompt:
                raise InvalidRequest(
                    "'continue_final_message' and 'add_generation_prompt' cannot both be true.",
                    param="continue_final_message",
                )
            if not chat or not isinstance(chat[-1].get("content"), str):
                raise InvalidRequest(
                    "'continue_final_message' needs a last message whose content is a string.",
                    param="continue_final_message",
                )
            chat[-1]["content"] += _CONTINUE_MARK
        template = self._tool_template if tools and self._tool_template is not None else self._template
        variables = {**self.special_tokens, **kwargs}
        try:
            text = template.render(
                messages=chat,
                tools=_plain(tools) if tools is not None else None,
                documents=_plain(documents) if documents is not None else None,
                add_generation_prompt=add_generation_prompt,
                **variables,
            )
        except jinja2.TemplateError as exc:
            raise InvalidRequest(f"the model's chat template rejected the messages: {exc}", param="messages") from None
        if continue_final_message:
            cut = text.rfind(_CONTINUE_MARK)
            if cut < 0:
                raise InvalidRequest(
                    "'continue_final_message': the chat template dropped the final message's text.", param="messages"
                )
            text = text[:cut]
        return text
