"""Prefix keys: the stable 64-bit value that hash-based strategies place a request by.

A key combines, in this order, a version tag, the model, the LoRA adapter, the
``cache_salt`` and either the caller's affinity key or the first ``prefix_length``
characters of the canonical routing text (`RouteRequest.text`). So:

* two tenants (different ``cache_salt``) or two adapters never share a key, even with the
  same prompt, because engines do not share their cache entries either;
* a caller-supplied affinity key (the ``x-kvroute-affinity`` header) replaces the text, so
  a session can be pinned whatever its prompts say;
* a request shorter than ``prefix_length`` hashes all the text it has.

How much text goes into the key is the caller's choice: a fixed ``prefix_length`` (SageMaker's
``PrefixLength``), or a cut at a message boundary from `message_cuts`, which needs no knowledge
of how long the shared part of the prompts is. A cut key is the same function of fewer
characters, so the layout (and the version tag) is unchanged.

`conversation_key` is the key of one chat conversation. When ``prefix_length`` leaves at least
`MIN_PREFIX_LENGTH` characters after the preamble (a system prompt of a few thousand characters,
or none), it is the ``prefix_key`` of the conversation cut of `message_cuts` (the text through
the first ``user`` message, at most ``prefix_length`` characters), as before. After a longer
preamble (tool definitions and instructions shared by every session of an agent) that cut would
be the preamble alone, the same for every conversation: the key is then xxh3 of the first
`MIN_PREFIX_LENGTH` characters of the first user message, seeded with the preamble's key (the
group key), a new kind of key that no ``prefix_key`` layout produces (so the version tag is
unchanged). Every turn of a conversation repeats its preamble and first user message, so every
turn has the key of its first turn.

Keys are computed with `kvroute.hashing` (xxh3), never Python's salted ``hash()``, so every
process and every router replica computes the same key for the same request.
"""

from __future__ import annotations

import functools

import attrs
import xxhash

from kvroute.hashing import hash_parts
from kvroute.request import RouteRequest

__all__ = [
    "DEFAULT_PREFIX_LENGTH",
    "MAX_PREFIX_LENGTH",
    "MIN_PREFIX_LENGTH",
    "Cuts",
    "conversation_key",
    "message_cuts",
    "opens_conversation",
    "prefix_key",
]

#: Characters of routing text hashed by default (SageMaker's PrefixLength range is 1,024-65,536).
DEFAULT_PREFIX_LENGTH = 4096
MIN_PREFIX_LENGTH = 1024
MAX_PREFIX_LENGTH = 65536

# Bumped if the key layout ever changes, so that old and new keys never collide by accident.
_KEY_VERSION = "kvroute-prefix-key/1"
_xxh3 = xxhash.xxh3_64_intdigest


@functools.lru_cache(maxsize=4096)
def _scope(model: str, lora: str | None, cache_salt: str | None, kind: str) -> int:
    # Everything but the text, hashed once per (model, adapter, salt): the seed of the text's hash.
    return hash_parts(_KEY_VERSION, model, lora, cache_salt, kind)


def prefix_key(request: RouteRequest, prefix_length: int = DEFAULT_PREFIX_LENGTH) -> int:
    """The 64-bit prefix key of ``request``: same request, same key, in every process.

    ``prefix_length`` is a number of characters (>= 1); strategies validate their own range.
    The key is xxh3 of the (UTF-8) text prefix or affinity key, seeded with a hash of the
    version tag, model, LoRA adapter, ``cache_salt`` and which of the two was used.
    """
    if not isinstance(prefix_length, int) or isinstance(prefix_length, bool) or prefix_length < 1:
        raise ValueError(f"'prefix_length' must be a positive integer (got {prefix_length!r}).")
    affinity = request.affinity_key
    if affinity is not None:
        seed = _scope(request.model, request.lora, request.cache_salt, "affinity")
        return _xxh3(affinity.encode("utf-8", "surrogatepass"), seed)
    seed = _scope(request.model, request.lora, request.cache_salt, "text")
    return _xxh3(request.text[:prefix_length].encode("utf-8", "surrogatepass"), seed)


def conversation_key(request: RouteRequest, prefix_length: int = DEFAULT_PREFIX_LENGTH) -> int | None:
    """The 64-bit key of the chat conversation ``request`` belongs to; None when it has none.

    A chat with a ``user`` message has one. When ``prefix_length`` leaves `MIN_PREFIX_LENGTH`
    characters or more after its preamble (the tool definitions and messages before that message),
    or it has none, the key is ``prefix_key`` of its conversation cut (`message_cuts`: the text
    through the first user message, at most ``prefix_length`` characters). After a longer preamble,
    whose conversation cut would be the preamble alone, the key is xxh3 of the first
    `MIN_PREFIX_LENGTH` characters of the rendering of the first user message, seeded with the
    preamble's key (``prefix_key`` of at most ``prefix_length`` characters: the group key). Every
    turn of a conversation repeats those messages, so every turn has this key. None for a request
    with an affinity key (the caller chose its key), a plain completion (no message boundaries) and
    a chat without a user message. Two conversations under one preamble share a key only if their
    first user messages agree on what the key covers.
    """
    if not isinstance(prefix_length, int) or isinstance(prefix_length, bool) or prefix_length < 1:
        raise ValueError(f"'prefix_length' must be a positive integer (got {prefix_length!r}).")
    if request.affinity_key is not None:
        return None
    boundaries = _chat_boundaries(request)
    if boundaries is None:
        return None
    preamble, first_turn = boundaries
    if first_turn <= preamble:  # no user message: nothing tells this conversation from another
        return None
    head = min(MIN_PREFIX_LENGTH, prefix_length)
    if prefix_length - preamble >= head:  # the conversation cut keeps at least `head` of the message
        return prefix_key(request, max(1, min(first_turn, prefix_length, len(request.text))))
    seed = prefix_key(request, min(preamble, prefix_length))
    end = preamble + min(first_turn - preamble, head)
    return _xxh3(request.text[preamble:end].encode("utf-8", "surrogatepass"), seed)


@attrs.frozen
class Cuts:
    """Two places to cut a request's routing text for its key, in characters (``group <= conversation``).

    ``group`` ends the part that many conversations may share (the system prompt); ``conversation``
    ends the part that every later turn of this conversation repeats (through its first user
    message). Both are at most ``prefix_length``, and both are the same for every turn of one
    conversation, so either gives turn N+1 the key of turn N.
    """

    group: int
    conversation: int


def message_cuts(request: RouteRequest, prefix_length: int = DEFAULT_PREFIX_LENGTH) -> Cuts:
    """Where to cut ``request.text`` for a group key and a conversation key (see `Cuts`).

    Chat: ``group`` is the end of the *preamble* (tool definitions and the messages before the
    first ``user`` message), ``conversation`` the end of the first ``user`` message; with no
    preamble, ``group`` equals ``conversation``; with no user message, both are the whole text.
    Plain completions carry no boundaries: ``group`` is the first `MIN_PREFIX_LENGTH` characters
    (a head that tells templates and system parts apart in most traffic), ``conversation`` the
    first ``prefix_length``. Every cut is capped at ``prefix_length`` and the text's length, and
    is at least 1 (`prefix_key`'s least length; an empty text hashes whole either way).
    """
    if not isinstance(prefix_length, int) or isinstance(prefix_length, bool) or prefix_length < 1:
        raise ValueError(f"'prefix_length' must be a positive integer (got {prefix_length!r}).")
    cap = max(1, min(prefix_length, len(request.text)))
    boundaries = _chat_boundaries(request)
    if boundaries is None:
        return Cuts(min(MIN_PREFIX_LENGTH, cap), cap)
    preamble, first_turn = boundaries
    conversation = min(first_turn, cap)
    return Cuts(min(preamble, cap) if preamble else conversation, conversation)


def opens_conversation(request: RouteRequest) -> bool:
    """Whether ``request`` is a conversation's first turn: no answer after its first user message (every completion).

    A later turn resends the history, so it has an ``assistant`` message after its first ``user``
    message (an agent's later turns too, whose other messages are tool results). Sibling
    sub-requests of a first turn, which add their own task after it, are first turns as well.
    """
    messages = request.messages
    if messages is None:
        return True
    first_user = next((i for i, m in enumerate(messages) if m.get("role") == "user"), len(messages))
    return not any(m.get("role") == "assistant" for m in messages[first_user + 1 :])


def _chat_boundaries(request: RouteRequest) -> tuple[int, int] | None:
    """(end of the preamble, end of the first user message) in ``request.text``; None if not a chat."""
    messages, offsets = request.messages, request.message_offsets
    if not messages or offsets is None or len(offsets) != len(messages) + 1:
        return None
    first_user = next((i for i, m in enumerate(messages) if m.get("role") == "user"), None)
    if first_user is None:
        return offsets[-1], offsets[-1]
    return offsets[first_user], offsets[first_user + 1]
