"""Workloads for the fleet simulator: deterministic streams of requests with real routing text.

Every workload is a frozen value whose :meth:`arrivals` returns a new iterator of
:class:`Arrival`, in order of arrival time, the same for the same parameters and seed.
An arrival carries an OpenAI-style request body (chat ``messages`` or completions
``prompt``) whose text is what the router sees, the prompt's token ids (consistent with
that text under the word-level :class:`~kvroute_simulator.tokens.Vocabulary`), and the
number of tokens to generate.

Lengths written as ``(lo, hi)`` are drawn uniformly from lo..hi inclusive. Arrivals stop
after ``requests`` arrivals or past ``duration`` seconds, whichever comes first (at least
one must be set). Shared prefixes and documents are shared objects (text strings and
:class:`~kvroute_simulator.tokens.TokenSeq` nodes), so memory grows with the unique
content, not with the number of requests.

* ``long-prefix``: ``groups`` prefixes of ``prefix_tokens`` (the seed's 8,000) each; a request
  picks a group uniformly and adds a unique question. Poisson arrivals at ``rate`` per second.
* ``hot-prefix``: the same shape, but prefix 0 takes ``hot_share`` of the traffic and the rest
  is spread uniformly over the other prefixes.
* ``short-prefix``: the same shape with a shared prefix shorter than the hash strategies'
  default ``prefix_length`` (24 system prompts of ~2,500 characters, then a unique question of
  ~2,000 characters), so a key over the first 4,096 characters includes the question.
* ``multi-turn``: ShareGPT-like chats under one shared system prompt. Conversations start as
  a Poisson process at ``rate`` per second, have a geometric number of turns, and each turn's
  prompt is the previous prompt plus its answer plus a new user message. A later turn names
  the turn it follows (``follows``) and the user's ``think_time``; ``time`` is the arrival if
  every answer were instant, a closed-loop driver sends it ``think_time`` after the answer.
  With ``systems`` > 1, each conversation picks one of that many system prompts.
* ``multi-turn-short``: the same conversations with short first turns (16 system prompts of
  ~1,000 characters, short user messages and answers), so the first three turns or so are
  each shorter than 4,096 characters and the history crosses that length later.
* ``agentic``: agent sessions (coding agents, tool loops) under a long shared preamble of tool
  definitions and instructions (``preambles`` of 10k-20k tokens each). A session is the
  preamble, a task, then turns of an answer (the agent's tool call) and a tool result of
  0.5k-8k tokens, 5-30 turns, each turn resending the whole history; some turns fan out into
  parallel sub-requests that share the new history and each add their own instruction, sent
  at once. Sessions start as a Poisson process at ``rate`` per second.
* ``rag``: a pool of ``documents`` with Zipf(``zipf_s``) popularity; a request is a shared
  system prompt, ``docs_per_request`` distinct documents in retrieval order, and a question.
* ``trace``: replay of a JSONL file, either the Mooncake format (``timestamp`` in ms,
  ``input_length``, ``output_length``, ``hash_ids`` of 512-token blocks, equal ids meaning
  equal content) or a simple format with ``prompt`` or ``messages``, ``timestamp`` (ms) and
  ``output_length`` (:mod:`~kvroute_simulator.traces`).

With ``session_ids`` on (``multi-turn``, ``multi-turn-short``, ``agentic``; off by default), every
request of a conversation or session carries its id in the body's ``metadata.session_id``, one
of the places ``RouteRequest.from_openai`` reads a session id from (`kvroute.session_ids`), as
agent harnesses send theirs.

:class:`Arrival` and the :class:`Workload` protocol live in :mod:`~kvroute_simulator.arrivals`;
this module re-exports them with the trace replay, so every workload is importable from here.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import math
import random
from collections.abc import Iterator, Mapping
from typing import Any, ClassVar

import attrs

from kvroute.errors import ConfigError
from kvroute.validators import (
    flag,
    integer,
    non_negative_number,
    optional,
    positive_integer,
    positive_number,
    share,
)
from kvroute_simulator._content import draw_words, is_int, seeded_rng
from kvroute_simulator.arrivals import DEFAULT_MODEL, Arrival, Workload
from kvroute_simulator.tokens import ASSISTANT, END, SYSTEM, TOOL, USER, TokenSeq, Vocabulary, vocabulary
from kvroute_simulator.traces import Trace, TraceFormatError

__all__ = [
    "DEFAULT_MODEL",
    "WORKLOADS",
    "Agentic",
    "Arrival",
    "HotPrefix",
    "LongPrefix",
    "MultiTurn",
    "MultiTurnShort",
    "Rag",
    "ShortPrefix",
    "Trace",
    "TraceFormatError",
    "Workload",
    "make_workload",
]

Length = tuple[int, int]


def _length(_inst: object, attr: attrs.Attribute[Any], value: Length) -> None:
    if not (isinstance(value, tuple) and len(value) == 2 and all(map(is_int, value)) and 1 <= value[0] <= value[1]):
        raise ConfigError(
            f"'{attr.name}' must be a number of tokens N or a range LO..HI with 1 <= LO <= HI (got {value!r})."
        )


def _to_length(value: Any) -> Any:
    """Turn N into (N, N) and a pair into a tuple; anything else is left for the validator to refuse."""
    if is_int(value):
        return (value, value)
    if isinstance(value, tuple | list) and len(value) == 2:
        return tuple(value)
    return value


def _uniform(rng: random.Random, length: Length) -> int:
    return rng.randint(length[0], length[1])


def _log_uniform(rng: random.Random, length: Length) -> int:
    """A length drawn log-uniformly from lo..hi: as many 0.5-1k as 4-8k outputs (a tool's output is skewed)."""
    lo, hi = length
    return min(hi, max(lo, round(math.exp(rng.uniform(math.log(lo), math.log(hi))))))


@attrs.frozen(kw_only=True)
class _Open:
    """Parameters shared by the generated workloads."""

    rate: float = attrs.field(default=4.0, validator=positive_number)
    requests: int | None = attrs.field(default=1000, validator=optional(positive_integer))
    duration: float | None = attrs.field(default=None, validator=optional(positive_number))
    seed: int = attrs.field(default=0, validator=integer)
    model: str = DEFAULT_MODEL

    def __attrs_post_init__(self) -> None:
        if self.requests is None and self.duration is None:
            raise ConfigError("a workload needs 'requests' or 'duration' to end (got neither).")

    def _done(self, emitted: int, time: float) -> bool:
        return (self.requests is not None and emitted >= self.requests) or (
            self.duration is not None and time > self.duration
        )

    def _body(self, messages: list[dict[str, Any]], output_len: int, session: str | None = None) -> dict[str, Any]:
        body: dict[str, Any] = {"model": self.model, "messages": messages, "max_tokens": output_len}
        if session is not None:
            body["metadata"] = {"session_id": session}
        return body


@attrs.define
class _Piece:
    """A shared piece of content: its text, and the tokens of its chat message."""

    text: str
    node: TokenSeq


def _system_piece(vocab: Vocabulary, rng: random.Random, tokens: int) -> _Piece:
    ids = draw_words(rng, vocab, tokens)
    return _Piece(vocab.decode(ids), TokenSeq.of((SYSTEM, *ids, END)))


@attrs.frozen(kw_only=True)
class LongPrefix(_Open):
    """The seed's workload: groups sharing a long prefix (a system message), unique questions.

    Parameters: ``groups`` (number of distinct prefixes), ``prefix_tokens``,
    ``question_tokens`` and ``output_tokens`` ranges, ``rate`` (requests per second,
    Poisson), ``requests``/``duration``, ``seed``. With ``concurrency`` set, the load is a
    closed loop instead, as a benchmark client with that many users makes it: user ``i %
    concurrency`` sends request ``i`` as soon as its previous request finished (``follows``
    names it; every ``time`` is 0 and ``rate`` and ``duration`` are unused).
    """

    name: ClassVar[str] = "long-prefix"

    groups: int = attrs.field(default=360, validator=positive_integer)
    prefix_tokens: int = attrs.field(default=8000, validator=positive_integer)
    question_tokens: Length = attrs.field(default=(50, 350), converter=_to_length, validator=_length)
    output_tokens: Length = attrs.field(default=(100, 300), converter=_to_length, validator=_length)
    rate: float = attrs.field(default=7.0, validator=positive_number)
    requests: int | None = attrs.field(default=2000, validator=optional(positive_integer))
    concurrency: int | None = attrs.field(default=None, validator=optional(positive_integer))

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        if self.concurrency is not None and self.requests is None:
            raise ConfigError("a closed-loop workload ('concurrency' set) needs 'requests' to end (got none).")

    def _pick(self, rng: random.Random) -> int:
        return rng.randrange(self.groups)

    def arrivals(self) -> Iterator[Arrival]:
        """Return a new iterator over the arrivals, in order of ``time``."""
        vocab = vocabulary()
        rng = seeded_rng(self.seed, self.name)
        prefixes: dict[int, _Piece] = {}
        closed = self.concurrency
        last: dict[int, str] = {}  # closed loop: each user's previous request
        t = 0.0
        for i in itertools.count():
            if closed is None:
                t += rng.expovariate(self.rate)
            if self._done(i, t):
                return
            group = self._pick(rng)
            piece = prefixes.get(group)
            if piece is None:
                piece = prefixes[group] = _system_piece(
                    vocab, seeded_rng(self.seed, self.name, "prefix", group), self.prefix_tokens
                )
            question = draw_words(rng, vocab, _uniform(rng, self.question_tokens))
            output_len = _uniform(rng, self.output_tokens)
            messages = [{"role": "system", "content": piece.text}, {"role": "user", "content": vocab.decode(question)}]
            request_id = f"{self.name}-{i:06d}"
            follows = None
            if closed is not None:
                follows = last.get(i % closed)
                last[i % closed] = request_id
            yield Arrival(
                time=t,
                request_id=request_id,
                body=self._body(messages, output_len),
                prompt=piece.node.extend((USER, *question, END, ASSISTANT)),
                output_len=output_len,
                session_id=f"group-{group}",
                follows=follows,
            )


@attrs.frozen(kw_only=True)
class HotPrefix(LongPrefix):
    """Long prefixes where one is hot: prefix 0 takes ``hot_share`` of the requests, the rest spread evenly.

    Parameters as :class:`LongPrefix` (``groups`` counts the hot prefix), plus ``hot_share``.
    """

    name: ClassVar[str] = "hot-prefix"

    groups: int = attrs.field(default=16, validator=positive_integer)
    prefix_tokens: int = attrs.field(default=4000, validator=positive_integer)
    hot_share: float = attrs.field(default=0.5, validator=share)

    def _pick(self, rng: random.Random) -> int:
        if self.groups == 1 or rng.random() < self.hot_share:
            return 0
        return 1 + rng.randrange(self.groups - 1)


@attrs.frozen(kw_only=True)
class ShortPrefix(LongPrefix):
    """Groups sharing a prefix shorter than the default ``prefix_length``, then a longer unique question.

    Parameters as :class:`LongPrefix`. The defaults model a chat application: 24
    system prompts of 380 tokens (~2,500 characters: a simulated word is 6.5 characters with
    its space) and a question of 280-330 tokens (~2,000 characters), 300 requests. The
    routing text of a request is ~4,500 characters, so its first 4,096 hold part of the
    question: a key over them is unique per request, while the engines could reuse the
    system prompt's blocks.
    """

    name: ClassVar[str] = "short-prefix"

    groups: int = attrs.field(default=24, validator=positive_integer)
    prefix_tokens: int = attrs.field(default=380, validator=positive_integer)
    question_tokens: Length = attrs.field(default=(280, 330), converter=_to_length, validator=_length)
    requests: int | None = attrs.field(default=300, validator=optional(positive_integer))


@attrs.define
class _Conversation:
    index: int
    rng: random.Random
    turns: int
    node: TokenSeq
    messages: list[dict[str, Any]]
    turn: int = 0
    previous: str | None = None
    think: float = 0.0


@attrs.frozen(kw_only=True)
class MultiTurn(_Open):
    """ShareGPT-like conversations whose history grows turn by turn, with think time between turns.

    Parameters: ``rate`` (new conversations per second, Poisson), ``mean_turns`` (geometric,
    at most ``max_turns``), ``system_tokens`` (the length of the shared system
    prompt), ``user_tokens`` and ``answer_tokens`` ranges per turn (an answer is
    followed by ``<|end|>``, which counts as an output token), ``think_time`` (mean seconds,
    exponential), ``requests``/``duration`` (counted in turns), ``seed``, ``systems``
    (distinct system prompts, each conversation picking one uniformly; 1 by default), and
    ``session_ids`` (each turn names its conversation in ``metadata.session_id``; off by default).
    """

    name: ClassVar[str] = "multi-turn"

    rate: float = attrs.field(default=1.0, validator=positive_number)
    mean_turns: float = attrs.field(default=4.0, validator=positive_number)
    max_turns: int = attrs.field(default=16, validator=positive_integer)
    system_tokens: int = attrs.field(default=500, validator=positive_integer)
    user_tokens: Length = attrs.field(default=(20, 300), converter=_to_length, validator=_length)
    answer_tokens: Length = attrs.field(default=(50, 500), converter=_to_length, validator=_length)
    think_time: float = attrs.field(default=15.0, validator=non_negative_number)
    systems: int = attrs.field(default=1, validator=positive_integer)
    session_ids: bool = attrs.field(default=False, validator=flag)

    def arrivals(self) -> Iterator[Arrival]:
        """Return a new iterator over the turns, in order of ``time`` (see the module docstring)."""
        vocab = vocabulary()
        rng = seeded_rng(self.seed, self.name)
        # System prompt 0 is drawn as when there was only one, so ``systems=1`` keeps earlier streams.
        prompts = [
            _system_piece(vocab, seeded_rng(self.seed, self.name, "system", *([k] if k else [])), self.system_tokens)
            for k in range(self.systems)
        ]
        p_stop = min(1.0, 1.0 / self.mean_turns)
        heap: list[tuple[float, int, _Conversation]] = []
        next_start = rng.expovariate(self.rate)
        order = itertools.count()
        started = itertools.count()
        emitted = 0
        while True:
            while not heap or next_start <= heap[0][0]:
                index = next(started)
                conv_rng = seeded_rng(self.seed, self.name, "conversation", index)
                turns = 1
                while turns < self.max_turns and conv_rng.random() >= p_stop:
                    turns += 1
                system = prompts[conv_rng.randrange(self.systems)] if self.systems > 1 else prompts[0]
                messages = [{"role": "system", "content": system.text}]
                heapq.heappush(
                    heap, (next_start, next(order), _Conversation(index, conv_rng, turns, system.node, messages))
                )
                next_start += rng.expovariate(self.rate)
            t, _, conv = heapq.heappop(heap)
            if self._done(emitted, t):
                return
            yield self._turn(vocab, conv, t)
            emitted += 1
            if conv.turn < conv.turns:
                heapq.heappush(heap, (t + conv.think, next(order), conv))

    def _turn(self, vocab: Vocabulary, conv: _Conversation, t: float) -> Arrival:
        """Return the conversation's next turn and advance it."""
        rng = conv.rng
        user = draw_words(rng, vocab, _uniform(rng, self.user_tokens))
        answer = (*draw_words(rng, vocab, _uniform(rng, self.answer_tokens)), END)
        messages = [*conv.messages, {"role": "user", "content": vocab.decode(user)}]
        prompt = conv.node.extend((USER, *user, END, ASSISTANT))
        request_id = f"{self.name}-c{conv.index:05d}-t{conv.turn:02d}"
        session = f"conversation-{conv.index}"
        arrival = Arrival(
            time=t,
            request_id=request_id,
            body=self._body(messages, len(answer), session if self.session_ids else None),
            prompt=prompt,
            output_len=len(answer),
            output_tokens=answer,
            session_id=session,
            follows=conv.previous,
            think_time=conv.think,
        )
        conv.turn += 1
        conv.node = prompt.extend(answer)
        conv.messages = [*messages, {"role": "assistant", "content": vocab.decode(answer[:-1])}]
        conv.previous = request_id
        conv.think = rng.expovariate(1.0 / self.think_time) if self.think_time > 0 else 0.0
        return arrival


@attrs.frozen(kw_only=True)
class MultiTurnShort(MultiTurn):
    """Conversations whose first turns are short: each of them is shorter than the default ``prefix_length``.

    Parameters as :class:`MultiTurn`. The defaults: 16 system prompts of 150 tokens (~1,000
    characters), user messages of 5-60 tokens, answers of 40-200, 6 turns on average, 2
    conversations per second, 1,500 turns. Turn 1 is ~1,300 characters and each turn adds
    ~1,000, so under a 4,096-character key the first three turns or so each hash all
    their text, and consecutive turns get different keys until the history is long enough.
    """

    name: ClassVar[str] = "multi-turn-short"

    rate: float = attrs.field(default=2.0, validator=positive_number)
    requests: int | None = attrs.field(default=1500, validator=optional(positive_integer))
    mean_turns: float = attrs.field(default=6.0, validator=positive_number)
    max_turns: int = attrs.field(default=20, validator=positive_integer)
    system_tokens: int = attrs.field(default=150, validator=positive_integer)
    user_tokens: Length = attrs.field(default=(5, 60), converter=_to_length, validator=_length)
    answer_tokens: Length = attrs.field(default=(40, 200), converter=_to_length, validator=_length)
    systems: int = attrs.field(default=16, validator=positive_integer)


@attrs.define
class _Session:
    index: int
    rng: random.Random
    turns: int
    node: TokenSeq
    messages: list[dict[str, Any]]
    turn: int = 0
    previous: str | None = None
    wait: float = 0.0


@attrs.frozen(kw_only=True)
class Agentic(_Open):
    """Agent sessions under a long shared preamble: growing tool-loop histories and bursts of sub-requests.

    A session is a preamble (tool definitions and instructions, one of ``preambles``, each of
    ``preamble_tokens``, drawn once), a task (``task_tokens``), then turns. Turn 1 is the preamble
    and the task; every later turn adds the agent's previous answer (``answer_tokens``: a tool
    call) and the tool's result (``tool_tokens``, drawn log-uniformly: short results are as
    common as long ones), and resends the whole history. A session has ``turns`` turns, fewer if
    its history would outgrow ``context_tokens``. After turn 1, a turn fans out with probability
    ``fanout_share``: besides the turn itself, ``fanout - 1`` sub-requests (sub-agents, parallel
    tool calls) are sent at the same time, each the turn's history with its own instruction
    (``subtask_tokens``) as a user message, so all share a prefix no engine has seen yet; the
    session goes on from the turn's own answer. The next turn follows ``tool_time`` seconds
    (mean, exponential) after an answer, the tool's run time. Sessions start as a Poisson
    process at ``rate`` per second; ``requests``/``duration`` count every request (sub-requests
    too). With ``session_ids`` every request names its session in ``metadata.session_id``.
    """

    name: ClassVar[str] = "agentic"

    rate: float = attrs.field(default=0.2, validator=positive_number)
    requests: int | None = attrs.field(default=2000, validator=optional(positive_integer))
    preambles: int = attrs.field(default=1, validator=positive_integer)
    preamble_tokens: Length = attrs.field(default=(10_000, 20_000), converter=_to_length, validator=_length)
    turns: Length = attrs.field(default=(5, 30), converter=_to_length, validator=_length)
    task_tokens: Length = attrs.field(default=(30, 300), converter=_to_length, validator=_length)
    answer_tokens: Length = attrs.field(default=(20, 200), converter=_to_length, validator=_length)
    tool_tokens: Length = attrs.field(default=(500, 8000), converter=_to_length, validator=_length)
    tool_time: float = attrs.field(default=2.0, validator=non_negative_number)
    fanout_share: float = attrs.field(default=0.1, validator=share)
    fanout: Length = attrs.field(default=(2, 4), converter=_to_length, validator=_length)
    subtask_tokens: Length = attrs.field(default=(20, 120), converter=_to_length, validator=_length)
    context_tokens: int = attrs.field(default=120_000, validator=positive_integer)
    session_ids: bool = attrs.field(default=False, validator=flag)

    def arrivals(self) -> Iterator[Arrival]:
        """Return a new iterator over the requests, in order of ``time`` (see the class docstring)."""
        vocab = vocabulary()
        rng = seeded_rng(self.seed, self.name)
        preambles = []
        for k in range(self.preambles):
            preamble_rng = seeded_rng(self.seed, self.name, "preamble", k)
            preambles.append(_system_piece(vocab, preamble_rng, _uniform(preamble_rng, self.preamble_tokens)))
        heap: list[tuple[float, int, _Session]] = []
        next_start = rng.expovariate(self.rate)
        order = itertools.count()
        started = itertools.count()
        emitted = 0
        while True:
            while not heap or next_start <= heap[0][0]:
                index = next(started)
                session_rng = seeded_rng(self.seed, self.name, "session", index)
                preamble = preambles[session_rng.randrange(self.preambles)]
                session = _Session(
                    index,
                    session_rng,
                    _uniform(session_rng, self.turns),
                    preamble.node,
                    [{"role": "system", "content": preamble.text}],
                )
                heapq.heappush(heap, (next_start, next(order), session))
                next_start += rng.expovariate(self.rate)
            t, _, session = heapq.heappop(heap)
            burst = self._turn(vocab, session, t)
            if not burst:
                continue
            for arrival in burst:
                if self._done(emitted, t):
                    return
                yield arrival
                emitted += 1
            if session.turn < session.turns:
                heapq.heappush(heap, (t + session.wait, next(order), session))

    def _turn(self, vocab: Vocabulary, session: _Session, t: float) -> list[Arrival]:
        """Return the session's next turn and its sub-requests, and advance it; none once its context is full."""
        rng = session.rng
        if session.turn == 0:
            role, added = "user", draw_words(rng, vocab, _uniform(rng, self.task_tokens))
            marker = USER
        else:
            role, added = "tool", draw_words(rng, vocab, _log_uniform(rng, self.tool_tokens))
            marker = TOOL
        answer = (*draw_words(rng, vocab, _uniform(rng, self.answer_tokens)), END)
        if len(session.node) + len(added) + 3 + len(answer) > self.context_tokens:
            session.turns = session.turn  # the history is full: the session ends here
            return []
        label = f"session-{session.index}"
        body_session = label if self.session_ids else None
        shared = session.node.extend((marker, *added, END))
        messages = [*session.messages, {"role": role, "content": vocab.decode(added)}]
        request_id = f"{self.name}-s{session.index:05d}-t{session.turn:02d}"
        prompt = shared.extend((ASSISTANT,))
        think = session.wait
        out = [
            Arrival(
                time=t,
                request_id=request_id,
                body=self._body(messages, len(answer), body_session),
                prompt=prompt,
                output_len=len(answer),
                output_tokens=answer,
                session_id=label,
                follows=session.previous,
                think_time=think,
            )
        ]
        if session.turn > 0 and rng.random() < self.fanout_share:
            for j in range(1, _uniform(rng, self.fanout)):
                subtask = draw_words(rng, vocab, _uniform(rng, self.subtask_tokens))
                output_len = _uniform(rng, self.answer_tokens)
                out.append(
                    Arrival(
                        time=t,
                        request_id=f"{request_id}-sub{j}",
                        body=self._body(
                            [*messages, {"role": "user", "content": vocab.decode(subtask)}], output_len, body_session
                        ),
                        prompt=shared.extend((USER, *subtask, END, ASSISTANT)),
                        output_len=output_len,
                        session_id=label,
                        follows=session.previous,
                        think_time=think,
                    )
                )
        session.turn += 1
        session.node = prompt.extend(answer)
        session.messages = [*messages, {"role": "assistant", "content": vocab.decode(answer[:-1])}]
        session.previous = request_id
        session.wait = rng.expovariate(1.0 / self.tool_time) if self.tool_time > 0 else 0.0
        return out


@attrs.frozen(kw_only=True)
class Rag(_Open):
    """Retrieval-augmented requests: a shared system prompt, retrieved documents, a question.

    Parameters: ``documents`` (pool size), ``doc_tokens`` range, ``docs_per_request``
    (distinct documents, in retrieval order: a document's rank in the prompt follows the
    draw), ``zipf_s`` (popularity of the document of rank r is proportional to
    ``1 / r ** zipf_s``), ``system_tokens``, ``question_tokens`` and ``output_tokens``
    ranges, ``rate`` (requests per second, Poisson), ``requests``/``duration``, ``seed``.
    The user message is the documents' texts and the question, separated by blank lines.
    """

    name: ClassVar[str] = "rag"

    documents: int = attrs.field(default=500, validator=positive_integer)
    doc_tokens: Length = attrs.field(default=(300, 1200), converter=_to_length, validator=_length)
    docs_per_request: int = attrs.field(default=4, validator=positive_integer)
    zipf_s: float = attrs.field(default=1.0, validator=non_negative_number)
    system_tokens: int = attrs.field(default=300, validator=positive_integer)
    question_tokens: Length = attrs.field(default=(10, 60), converter=_to_length, validator=_length)
    output_tokens: Length = attrs.field(default=(50, 300), converter=_to_length, validator=_length)
    rate: float = attrs.field(default=5.0, validator=positive_number)

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        if self.docs_per_request > self.documents:
            raise ConfigError(
                f"'docs_per_request' must be at most 'documents'={self.documents} (got {self.docs_per_request})."
            )

    def arrivals(self) -> Iterator[Arrival]:
        """Return a new iterator over the arrivals, in order of ``time``."""
        vocab = vocabulary()
        rng = seeded_rng(self.seed, self.name)
        system = _system_piece(vocab, seeded_rng(self.seed, self.name, "system"), self.system_tokens)
        cumulative = list(itertools.accumulate(1.0 / (rank**self.zipf_s) for rank in range(1, self.documents + 1)))
        total = cumulative[-1]
        docs: dict[int, tuple[tuple[int, ...], str]] = {}
        nodes: dict[tuple[int, ...], TokenSeq] = {(): system.node}
        t = 0.0
        for i in itertools.count():
            t += rng.expovariate(self.rate)
            if self._done(i, t):
                return
            chosen = self._retrieve(rng, cumulative, total)
            node = system.node
            texts = []
            for depth, doc in enumerate(chosen):
                found = docs.get(doc)
                if found is None:
                    doc_rng = seeded_rng(self.seed, self.name, "document", doc)
                    ids = draw_words(doc_rng, vocab, _uniform(doc_rng, self.doc_tokens))
                    found = docs[doc] = (ids, vocab.decode(ids))
                texts.append(found[1])
                path = chosen[: depth + 1]
                child = nodes.get(path)
                if child is None:
                    child = nodes[path] = node.extend((USER, *found[0]) if depth == 0 else found[0])
                node = child
            question = draw_words(rng, vocab, _uniform(rng, self.question_tokens))
            texts.append(vocab.decode(question))
            output_len = _uniform(rng, self.output_tokens)
            messages = [{"role": "system", "content": system.text}, {"role": "user", "content": "\n\n".join(texts)}]
            yield Arrival(
                time=t,
                request_id=f"{self.name}-{i:06d}",
                body=self._body(messages, output_len),
                prompt=node.extend((*question, END, ASSISTANT)),
                output_len=output_len,
                session_id=f"doc-{chosen[0]}",
            )

    def _retrieve(self, rng: random.Random, cumulative: list[float], total: float) -> tuple[int, ...]:
        """Draw distinct documents by popularity (rejection; the most popular unused ones if that stalls)."""
        chosen: list[int] = []
        for _ in range(64 * self.docs_per_request):
            if len(chosen) == self.docs_per_request:
                break
            doc = min(bisect.bisect_right(cumulative, rng.random() * total), self.documents - 1)
            if doc not in chosen:
                chosen.append(doc)
        fill = (d for d in range(self.documents) if d not in chosen)
        chosen.extend(itertools.islice(fill, self.docs_per_request - len(chosen)))
        return tuple(chosen)


#: Workload classes by name (the names ``kvroute simulate --workload`` accepts).
WORKLOADS: Mapping[str, type[Workload]] = {
    "long-prefix": LongPrefix,
    "hot-prefix": HotPrefix,
    "short-prefix": ShortPrefix,
    "multi-turn": MultiTurn,
    "multi-turn-short": MultiTurnShort,
    "agentic": Agentic,
    "rag": Rag,
    "trace": Trace,
}


def make_workload(name: str, **options: Any) -> Workload:
    """Return the workload ``name`` built with ``options``; raises :class:`ConfigError` naming what is wrong."""
    cls = WORKLOADS.get(name)
    if cls is None:
        raise ConfigError(f"'workload' must be one of {', '.join(WORKLOADS)} (got {name!r}).")
    known = {a.name for a in attrs.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(options) - known)
    if unknown:
        raise ConfigError(
            f"workload {name!r} has no option {', '.join(map(repr, unknown))}; "
            f"expected some of {', '.join(sorted(known))}."
        )
    return cls(**options)
