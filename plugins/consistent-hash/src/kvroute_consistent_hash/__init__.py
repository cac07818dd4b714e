"""The ``consistent-hash`` strategy: the same prefix goes to the same backend, on every replica.

A request's key is `kvroute.keys.prefix_key` (model, LoRA adapter, ``cache_salt`` and a
prefix of the routing text, or the caller's affinity key). By default (``prefix=messages``) the
prefix ends at a message boundary: the system prompt; or, for a system prompt that opens more
than one backend's share of the conversations (`kvroute_consistent_hash.groups`), the
conversation's own key, `kvroute.keys.conversation_key` (the preamble's key and the first user
message, at least 1,024 characters of it however long the preamble); so affinity works whatever
the shared prefix's length, and every turn of a conversation has the key of its first turn.
``prefix=fixed`` keys on the first ``prefix_length`` characters, as SageMaker's ``PrefixLength`` does.
Placement is weighted rendezvous hashing over every member of the fleet (see
`kvroute_consistent_hash.placement`); when the key's home cannot take requests (unhealthy,
draining, or already failed for this request) the request goes to the next backend in the
key's own preference order, so no other key moves. There is no load awareness: use
``bounded-load`` for that.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence

import attrs

import kvroute
from kvroute.keys import (
    DEFAULT_PREFIX_LENGTH,
    MAX_PREFIX_LENGTH,
    MIN_PREFIX_LENGTH,
    Cuts,
    conversation_key,
    message_cuts,
    prefix_key,
)
from kvroute.options import int_option, optional_int_option, str_option
from kvroute_consistent_hash.groups import HotGroups
from kvroute_consistent_hash.placement import CandidateView, Rendezvous, backend_seed

__all__ = ["CandidateView", "ConsistentHash", "HotGroups", "Rendezvous", "backend_seed", "prefix_key"]

#: Values of the ``prefix`` option: cut the key's text at message boundaries, or after ``prefix_length``.
PREFIXES = ("messages", "fixed")

#: Fleet events that change placement; the others (health, draining) only change who is routable.
PLACEMENT_EVENTS = frozenset({"attached", "added", "removed", "weight", "models"})


@attrs.define
class ConsistentHash(kvroute.BaseStrategy):
    """Rendezvous-hash each request's prefix key onto the fleet.

    Options:

    * ``prefix`` (``messages`` or ``fixed``): where the key's text ends. ``messages`` cuts at a
      message boundary: the system prompt (tool definitions and the messages before the first
      user message), or, for a system prompt that opened more than one backend's share of the
      recent conversations, the conversation's key (`conversation_key`); a plain completion is cut
      after 1,024 characters (``prefix_length`` for a hot one). ``fixed`` keys on the first
      ``prefix_length`` characters (SageMaker's ``PrefixLength``). Default: ``fixed`` when
      ``prefix_length`` is given, else ``messages``.
    * ``prefix_length`` (1024-65536, default 4096): characters of routing text in the key
      (``fixed``), or the most a cut may keep (``messages``; after a longer preamble the
      conversation key keeps 1,024 characters of the first user message).
    * ``cache_size`` (0-16777216, default 65536): keys whose placement is memoized per
      membership snapshot (0 disables the cache; it only saves time, never changes a pick).

    Decisions: reason ``hash`` (the home), or ``spilled`` with ``spill_reason`` =
    ``home_unroutable`` when the home is not a candidate. ``spills`` counts spilled requests
    that were started, by reason in ``spill_reasons``.
    """

    prefix: str | None = str_option(None, choices=PREFIXES)
    prefix_length: int | None = optional_int_option(min=MIN_PREFIX_LENGTH, max=MAX_PREFIX_LENGTH)
    cache_size: int = int_option(65536, min=0, max=1 << 24)
    spills: int = attrs.field(default=0, init=False)
    spill_reasons: Counter[str] = attrs.field(factory=Counter, init=False)
    _placement: Rendezvous = attrs.field(init=False)
    _length: int = attrs.field(init=False)
    _hot_groups: HotGroups = attrs.field(factory=HotGroups, init=False)
    #: The last request `_group` computed, with its result: ``on_request_start`` asks again for the
    #: request ``pick`` has just keyed (2.7 µs saved per request).
    _last_group: tuple[object, Cuts, int] | None = attrs.field(default=None, init=False, repr=False, eq=False)
    #: The last request `conversation_key` keyed, with its key: a session wrapper asks before ``pick`` does.
    _last_conversation: tuple[object, int | None] | None = attrs.field(default=None, init=False, repr=False, eq=False)

    def __attrs_post_init__(self) -> None:
        if self.prefix is None:  # SageMaker's PrefixLength, given alone, keeps its meaning
            self.prefix = "messages" if self.prefix_length is None else "fixed"
        self._length = DEFAULT_PREFIX_LENGTH if self.prefix_length is None else self.prefix_length
        self._placement = Rendezvous((), cache_size=self.cache_size)

    @property
    def hot_groups(self) -> HotGroups:
        """The groups (system prompts) whose requests are keyed by conversation (``prefix=messages``)."""
        return self._hot_groups

    @property
    def placement(self) -> Rendezvous:
        """The current membership snapshot and its rendezvous placement."""
        return self._placement

    # -- callbacks ---------------------------------------------------------------------

    def on_fleet_change(self, event: kvroute.FleetEvent, members: Sequence[kvroute.BackendState]) -> None:
        current = self._placement
        if (
            event.kind not in PLACEMENT_EVENTS
            and len(members) == len(current.states)
            and all(a is b for a, b in zip(members, current.states, strict=True))
        ):
            return  # health or draining only: placement and its caches stay valid
        self._placement = Rendezvous(members, cache_size=self.cache_size)

    def on_request_start(self, request: kvroute.RouteRequest, decision: kvroute.Decision) -> None:
        if self.prefix == "messages" and request.affinity_key is None and _opens_conversation(request):
            self._hot_groups.observe(self._group(request)[1], len(self._placement.states))
        if decision.spilled:
            self.spills += 1
            self.spill_reasons[str(decision.spill_reason or decision.reason)] += 1

    # -- deciding ----------------------------------------------------------------------

    def key(self, request: kvroute.RouteRequest) -> int:
        """The request's prefix key: its group's, or its conversation's when the group is hot (or ``fixed``)."""
        if self.prefix == "fixed" or request.affinity_key is not None:
            return prefix_key(request, self._length)
        cuts, group = self._group(request)
        if not self._hot_groups.is_hot(group):
            return group
        conversation = self._conversation(request)
        if conversation is not None:
            return conversation
        # A plain completion (or a chat without a user message): its longer head, if it has one.
        return group if cuts.conversation == cuts.group else prefix_key(request, cuts.conversation)

    def conversation_key(self, request: kvroute.RouteRequest) -> int | None:
        """The key of the conversation ``request`` belongs to, the same for each of its turns; None if it has none.

        `kvroute.keys.conversation_key` with this strategy's ``prefix_length``: the preamble's key
        and the first user message. None with ``prefix=fixed``, for a request with an affinity
        key, a plain completion and a chat without a user message. `key` uses it for hot groups; a
        wrapper that binds conversations to backends (``kvroute.sessions``) can use it for every
        request, so that a conversation started while its group was cold keeps its backend.
        """
        if self.prefix == "fixed":
            return None
        return self._conversation(request)

    def _conversation(self, request: kvroute.RouteRequest) -> int | None:
        last = self._last_conversation
        if last is not None and last[0] is request:
            return last[1]
        key = conversation_key(request, self._length)
        self._last_conversation = (request, key)
        return key

    def _group(self, request: kvroute.RouteRequest) -> tuple[Cuts, int]:
        """The request's message cuts and its group key."""
        last = self._last_group
        if last is not None and last[0] is request:
            return last[1], last[2]
        cuts = message_cuts(request, self._length)
        group = prefix_key(request, cuts.group)
        self._last_group = (request, cuts, group)
        return cuts, group

    def pick(self, request: kvroute.RouteRequest, candidates: Sequence[kvroute.BackendState]) -> kvroute.Decision:
        return self.place(self.key(request), request.model, candidates)

    def place(self, key: int, model: str | None, candidates: Sequence[kvroute.BackendState]) -> kvroute.Decision:
        """Place an already computed key: its home if that is a candidate, else the next candidate in its order."""
        placement = self._placement
        view = CandidateView(placement, candidates)
        home = placement.home(key, model)
        if home is not None:
            state = view.get(home)
            if state is not None:
                return kvroute.Decision(state.backend, reason="hash", key=key, detail={"home": state.id})
            if not view.foreign:
                home_id = placement.states[home].id
                for rank, index in enumerate(placement.ranking(key, model)):
                    state = view.get(index)
                    if state is not None:
                        return kvroute.Decision(
                            state.backend,
                            reason="spilled",
                            key=key,
                            spilled=True,
                            detail={"home": home_id, "rank": rank},
                            spill_reason=kvroute.SpillReason.HOME_UNROUTABLE,
                        )
        # The snapshot does not cover these candidates (the strategy was not told about some
        # of them, or the host did not filter by model): rendezvous over the candidates alone.
        return self._place_over_candidates(key, candidates)

    def _place_over_candidates(self, key: int, candidates: Sequence[kvroute.BackendState]) -> kvroute.Decision:
        placement = Rendezvous(candidates, cache_size=0)
        chosen = placement.states[placement.ranking(key, None)[0]]
        return kvroute.Decision(chosen.backend, reason="hash", key=key, detail={"home": chosen.id})


def _opens_conversation(request: kvroute.RouteRequest) -> bool:
    """Whether ``request`` is a conversation's first turn (no answer after its first user message; every completion).

    Hot groups count conversations, not turns: a few long conversations would otherwise make a
    group look hot early on, and moving them to their own keys costs their history. An agent's
    later turns have one user message too (then answers and tool results): the assistant's answer
    after the first user message tells them from a first turn.
    """
    messages = request.messages
    if messages is None:
        return True
    first_user = next((i for i, m in enumerate(messages) if m.get("role") == "user"), len(messages))
    return not any(m.get("role") == "assistant" for m in messages[first_user + 1 :])


@kvroute.hookimpl
def kvroute_register_strategies(register: Callable[..., None]) -> None:
    register("consistent-hash", ConsistentHash)
