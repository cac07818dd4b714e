"""Reading the emulator's requests: JSON bodies, the model check, prompts and chat messages as token ids.

Every refusal is a :class:`BadRequest`, which the app answers with vLLM's error body.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvroute_server.http.asgi import BodyTooLarge, InvalidBody, Receive, Scope, loads_body, read_body
from kvroute_simulator.tokens import Vocabulary, vocabulary

__all__ = ["MAX_BODY", "BadRequest", "check_model", "prompt_tokens", "read_json", "tokenize_chat", "tokenize_text"]

#: The largest request body the emulator reads, in bytes.
MAX_BODY = 64 * 1024 * 1024


class BadRequest(Exception):
    """A request the emulator refuses: answered with ``status`` and an OpenAI error naming ``param``."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.status = status
        self.code = code


def tokenize_text(text: str, vocab: Vocabulary | None = None) -> tuple[int, ...]:
    """The emulator's tokenizer: whitespace-separated words -> ids of the simulator's vocabulary."""
    return (vocab or vocabulary()).encode(text)


def tokenize_chat(
    messages: object, vocab: Vocabulary | None = None, *, add_generation_prompt: bool = True
) -> tuple[int, ...]:
    """The emulator's chat template: per message ``<|role|>`` + content words + ``<|end|>``, then ``<|assistant|>``."""
    vocab = vocab or vocabulary()
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty list of message objects.", "messages")
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
            raise BadRequest(f"'messages[{i}]' must be an object with a string 'role'.", "messages")
    try:
        return vocab.render_chat(messages, add_generation_prompt=add_generation_prompt)
    except ValueError as exc:
        raise BadRequest(str(exc), "messages") from None


def prompt_tokens(body: Mapping[str, Any], vocab: Vocabulary) -> tuple[int, ...]:
    """Return a completions body's ``prompt`` as token ids (a string, a list of one string, or token ids)."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    if isinstance(prompt, str):
        return vocab.encode(prompt)
    if (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt)
    ):
        return tuple(prompt)
    raise BadRequest("'prompt' must be a string, a list of one string, or a list of token ids.", "prompt")


async def read_json(scope: Scope, receive: Receive) -> dict[str, Any]:
    """Read the request's body as a JSON object (refusing another media type, an oversized or invalid body)."""
    content_type = next((v for k, v in scope["headers"] if k == b"content-type"), b"")
    if not content_type.split(b";")[0].strip().lower() == b"application/json":
        # vLLM (FastAPI) refuses any other media type the same way.
        raise BadRequest("1 validation error:\n  Unsupported Media Type: Only 'application/json' is allowed")
    try:
        raw = await read_body(receive, MAX_BODY)
    except BodyTooLarge as exc:
        raise BadRequest(str(exc), status=413) from None
    try:
        body = loads_body(raw)
    except InvalidBody as exc:
        raise BadRequest(str(exc), code=exc.code) from None
    if not isinstance(body, dict):
        raise BadRequest("The request body must be a JSON object.")
    return body


def check_model(body: Mapping[str, Any], model: str) -> None:
    """Refuse a body that names another model than the one served (vLLM answers 404)."""
    requested = body.get("model")
    if requested is not None and requested != model:
        raise BadRequest(f"The model `{requested}` does not exist.", "model", status=404, code="model_not_found")
