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

import operator
from collections import Counter
from collections.abc import Callable, Iterator, Sequence

import attrs

import kvroute
from kvroute.keys import (
    DEFAULT_PREFIX_LENGTH,
    MAX_PREFIX_LENGTH,
    MIN_PREFIX_LENGTH,
    Cuts,
    conversation_key,
    message_cuts,
    opens_conversation,
    prefix_key,
)
from kvroute.options import bool_option, int_option, optional_float_option, optional_int_option, str_option
from kvroute_consistent_hash.groups import HotGroups
from kvroute_consistent_hash.placement import HEAD, CandidateView, Rendezvous, backend_seed
from kvroute_consistent_hash.shares import Shares

__all__ = [
    "Balanced",
    "CandidateView",
    "ConsistentHash",
    "HotGroups",
    "Rendezvous",
    "Shares",
    "backend_seed",
    "prefix_key",
]

#: Values of the ``prefix`` option: cut the key's text at message boundaries, or after ``prefix_length``.
PREFIXES = ("messages", "fixed")

#: Fleet events that change placement; the others (health, draining) only change who is routable.
PLACEMENT_EVENTS = frozenset({"attached", "added", "removed", "weight", "models"})

#: A key held by a backend moves for a new conversation only when that backend is over this many times
#: ``share_factor`` (a new key moves past ``share_factor``): a system prompt keeps its home while that is
#: merely above its share, and leaves it before conversations pile up there (docs/strategies.md).
HELD_SLACK = 1.25


class Balanced:
    """One key's candidates under the share bound (`Shares`): its holder, its home and who comes first.

    ``home`` is the key's home when it is a candidate (``home_id`` names it either way), ``holder``
    the candidate holding the request's conversation (``held`` = ``"conversation"``) or key
    (``"key"``). `preferred` yields the holder, then the candidates of the key's order with share
    room, then the others; `order` (the candidates in the key's order) is computed only when the
    holder and the home are not enough.
    """

    __slots__ = (
        "_order",
        "_ranks",
        "_total_weight",
        "by_conversations",
        "candidates",
        "choices",
        "conversation",
        "held",
        "holder",
        "home",
        "home_id",
        "key",
        "model",
        "placement",
        "shares",
        "view",
    )

    def __init__(
        self,
        placement: Rendezvous,
        view: CandidateView,
        key: int,
        model: str | None,
        shares: Shares,
        candidates: Sequence[kvroute.BackendState],
        home_id: str,
        home: kvroute.BackendState | None,
    ) -> None:
        self.placement, self.view, self.key, self.model = placement, view, key, model
        self.shares, self.candidates = shares, candidates
        #: d > 1: a new key takes the least loaded (`load`) of the first d backends of its order with share room.
        self.choices = 1
        #: The request's conversation key: when it is the key itself (a hot group's conversation),
        #: the key is not bounded by the live keys (`has_room`).
        self.conversation: int | None = None
        #: The choices compare active conversations first (`Shares.active_on`), then recent requests.
        self.by_conversations = False
        self._total_weight: float | None = None
        self.home_id, self.home = home_id, home
        self.holder: kvroute.BackendState | None = None
        self.held: str | None = None
        self._order: list[kvroute.BackendState] | None = None
        self._ranks: list[int] = []

    def member(self, backend_id: str | None) -> kvroute.BackendState | None:
        """The candidate named ``backend_id``, if it is one."""
        if backend_id is None:
            return None
        index = self.placement.member(backend_id)
        return None if index is None else self.view.get(index)

    @property
    def total_weight(self) -> float:
        """The candidates' total weight (the snapshot's when the candidates are its members, in order)."""
        if self._total_weight is None:
            states, candidates = self.placement.states, self.candidates
            if len(states) == len(candidates) and all(map(operator.is_, states, candidates)):
                self._total_weight = self.placement.total_weight
            else:
                self._total_weight = sum(s.backend.weight for s in candidates)
        return self._total_weight

    def has_room(self, state: kvroute.BackendState, slack: float = 1.0) -> bool:
        """Whether ``state`` has share room for one more request (`Shares.has_room`) and, when the key is not
        the conversation's own, for the key among its live keys (`Shares.has_key_room`)."""
        shares, weight, total = self.shares, state.backend.weight, self.total_weight
        if not shares.has_room(state.id, weight, total, slack):
            return False
        return self.conversation == self.key or shares.has_key_room(state.id, weight, total, self.key)

    @property
    def order(self) -> list[kvroute.BackendState]:
        """The candidates in the key's preference order."""
        if self._order is None:
            ranked = list(self._ranked())
            self._ranks = [rank for rank, _ in ranked]
            self._order = [state for _, state in ranked]
        return self._order

    def _ranked(self) -> Iterator[tuple[int, kvroute.BackendState]]:
        """(rank, candidate) in the key's order: the memoized head first, the full ranking only past it."""
        if self._order is not None:
            yield from zip(self._ranks, self._order, strict=True)
            return
        get, placement = self.view.get, self.placement
        head = placement.head(self.key, self.model)
        for rank, index in enumerate(head):
            state = get(index)
            if state is not None:
                yield rank, state
        if len(head) < HEAD:
            return
        for rank, index in enumerate(placement.ranking(self.key, self.model)):
            if rank >= len(head):
                state = get(index)
                if state is not None:
                    yield rank, state

    def preferred(self) -> Iterator[kvroute.BackendState]:
        """The candidates, best first (lazily: the order is computed only as far as the walk goes).

        The holder; then the candidates with share room in the key's order, except that with
        ``choices`` d > 1 and no holder the first d of them come in the order of their `load`
        (active conversations, then recent requests, per unit of weight: the power of d choices;
        ties to the earlier); then the rest.
        """
        holder = self.holder
        if holder is not None:
            yield holder
        choices = self.choices if holder is None else 1
        crowded: list[kvroute.BackendState] = []
        pool: list[kvroute.BackendState] = []
        for state in self._walk():
            if state is holder:
                continue
            if not self.has_room(state):
                crowded.append(state)
            elif choices <= 1:
                yield state
            else:
                pool.append(state)
                if len(pool) == choices:
                    yield from sorted(pool, key=self.load)  # stable: ties to the earlier
                    pool, choices = [], 1
        yield from sorted(pool, key=self.load)
        yield from crowded

    def _walk(self) -> Iterator[kvroute.BackendState]:
        home = self.home
        if home is not None:
            yield home
        for _, state in self._ranked():
            if state is not home:
                yield state

    def per_weight(self, state: kvroute.BackendState) -> float:
        """``state``'s recent requests per unit of weight."""
        return self.shares.count(state.id) / state.backend.weight

    def load(self, state: kvroute.BackendState) -> tuple[float, float]:
        """What the choices compare (`Shares.load`): active conversations with ``by_conversations``, then recent
        requests, per unit of weight."""
        return self.shares.load(state.id, state.backend.weight, self.by_conversations)

    def rank(self, state: kvroute.BackendState) -> int:
        """Position of ``state`` in the key's order over every member serving the model (0: the home)."""
        return next(rank for rank, s in self._ranked() if s is state)


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
    * ``share_factor`` (1.0-100.0 or ``off``; default ``off`` here, 1.2 in ``bounded-load`` and
      ``bounded-cache``): with ``prefix=messages``, a key that no backend holds goes to the first
      backend of its order whose share of the recent requests stays within this factor of its
      weight share, and a conversation's later turns follow its first (`Shares`).
    * ``share_window`` (0-1,048,576, default 0 = 64 requests per member, at least 256): recent
      requests the shares are counted over. ``share_keys`` (default 65536): keys whose holder is kept.
    * ``share_choices`` (1-4, default 4): a new key takes the first backend of its order with
      share room (1), or the least loaded of the first d (the power of d choices).
    * ``share_conversations`` (default true): the choices compare each backend's active
      conversations (`Shares.converse`: a conversation is active until three mean gaps between a
      conversation's requests pass without one), then its recent requests; false: recent requests only.

    Decisions: reason ``hash`` (the home), ``held`` (the backend holding the conversation or key,
    not its home), ``balanced`` (a later backend of the key's order, the home being over its
    share), or ``spilled`` with ``spill_reason`` = ``home_unroutable`` when the home is not a
    candidate. ``spills`` counts spilled requests that were started, by reason in ``spill_reasons``.
    """

    prefix: str | None = str_option(None, choices=PREFIXES)
    prefix_length: int | None = optional_int_option(min=MIN_PREFIX_LENGTH, max=MAX_PREFIX_LENGTH)
    cache_size: int = int_option(65536, min=0, max=1 << 24)
    share_factor: float | None = optional_float_option(None, min=1.0, max=100.0)
    share_window: int = int_option(0, min=0, max=1 << 20)
    share_keys: int = int_option(65536, min=1, max=1 << 24)
    share_choices: int = int_option(HEAD, min=1, max=HEAD)
    share_conversations: bool = bool_option(True)
    key_factor: float | None = optional_float_option(None, min=1.0, max=100.0)
    spills: int = attrs.field(default=0, init=False)
    spill_reasons: Counter[str] = attrs.field(factory=Counter, init=False)
    _placement: Rendezvous = attrs.field(init=False)
    _length: int = attrs.field(init=False)
    _hot_groups: HotGroups = attrs.field(factory=HotGroups, init=False)
    _shares: Shares | None = attrs.field(default=None, init=False)
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
        if self.share_factor is not None and self.prefix == "messages":
            self._shares = Shares(self.share_factor, self.share_window, self.share_keys, self.key_factor)

    @property
    def shares(self) -> Shares | None:
        """The recent requests' shares and the keys' holders (``None`` when ``share_factor`` is off or ``fixed``)."""
        return self._shares

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
        if self._shares is not None:
            self._shares.resize(len(members))
            known = {state.id for state in current.states}
            self._shares.joined(state.id for state in members if state.id not in known)

    def on_request_start(self, request: kvroute.RouteRequest, decision: kvroute.Decision) -> None:
        if self.prefix == "messages" and request.affinity_key is None and _opens_conversation(request):
            self._hot_groups.observe(self._group(request)[1], len(self._placement.states))
        if decision.spilled:
            self.spills += 1
            self.spill_reasons[str(decision.spill_reason or decision.reason)] += 1
        shares = self._shares
        if shares is not None:
            placed = decision.key
            if request.affinity_key is not None:
                shares.record(decision.backend.id, (), placed)
            elif decision.spilled or decision.reason == "replicated" or decision.detail.get("held") == "conversation":
                # Overflow (a load spill, a hot key's extra home) does not move the key's holder: its
                # second homes are for overflow only. A conversation follows its latest turn.
                shares.record(decision.backend.id, (self._conversation(request),), placed)
            else:
                shares.record(decision.backend.id, (self._conversation(request), decision.key), placed)
            if self.share_conversations:
                shares.converse(decision.backend.id, self._conversation(request))

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
        key = self.key(request)
        if self._shares is None or request.affinity_key is not None:
            return self.place_home(key, request.model, candidates)
        return self.place(
            key,
            request.model,
            candidates,
            conversation=self._conversation(request),
            choices=self.share_choices,
            balance=True,
            short=self._group(request)[0].group < self._length,
        )

    def balanced(
        self,
        key: int,
        model: str | None,
        candidates: Sequence[kvroute.BackendState],
        conversation: int | None = None,
        choices: int = 1,
        short: bool = False,
    ) -> Balanced | None:
        """``key``'s candidates under the share bound; ``None`` when it is off (``share_factor`` or ``fixed``).

        The holder: the backend ``conversation`` went to last, if it is a candidate; else the one
        ``key`` went to last, if it is a candidate and, for a request that opens a conversation
        (``conversation`` given and not held), still has share room (``HELD_SLACK``) or the key is
        worth keeping together: a system prompt's first conversations do not all park on its home,
        and a long prompt is not copied to a second backend for a busy holder's sake. A key is worth
        keeping together unless it is ``short`` (its shared prefix is under ``prefix_length``
        characters: cheap to copy) or hot (`Shares.is_hot`: it alone is over one backend's share).
        A short key's holder also needs room among the active conversations
        (`Shares.has_conversation_room`): the later turns of the conversations it already took are
        its coming requests, which its share of the recent requests does not show yet.
        """
        shares = self._shares
        if shares is None:
            return None
        placement = self._placement
        view = CandidateView(placement, candidates)
        home = placement.home(key, model)
        home_state = None if home is None else view.get(home)
        if home is None or (home_state is None and view.foreign):
            # The snapshot does not cover these candidates: rendezvous over the candidates alone.
            placement = Rendezvous(candidates, cache_size=0)
            view = CandidateView(placement, candidates)
            model = None
            home = placement.home(key, None)
            assert home is not None
            home_state = view.get(home)
        balanced = Balanced(placement, view, key, model, shares, candidates, placement.states[home].id, home_state)
        balanced.choices = choices
        balanced.conversation = conversation
        balanced.by_conversations = self.share_conversations
        if conversation is not None:
            holder = balanced.member(shares.holder(conversation, balanced.home_id))
            if holder is not None:
                balanced.holder, balanced.held = holder, "conversation"
                return balanced
        holder_id = shares.holder(key, balanced.home_id)
        if holder_id is None and shares.holder(key) is not None:
            balanced.choices = 1  # its home joined since it was held: it moves there, as rendezvous hashing moves it
        holder = balanced.member(holder_id)
        if holder is not None and (
            conversation is None
            or (
                balanced.has_room(holder, HELD_SLACK)
                and (not short or shares.has_conversation_room(holder.id, holder.backend.weight, balanced.total_weight))
            )
            or not (short or shares.is_hot(key, len(candidates)))
        ):
            balanced.holder, balanced.held = holder, "key"
        return balanced

    def place(
        self,
        key: int,
        model: str | None,
        candidates: Sequence[kvroute.BackendState],
        *,
        conversation: int | None = None,
        choices: int = 1,
        balance: bool = False,
        short: bool = False,
    ) -> kvroute.Decision:
        """Place an already computed key; with ``balance``, under the share bound.

        Without ``balance`` (the default, what the session table uses for a session id: every
        replica must send a new session to the same backend without seeing the same traffic), or
        with the share bound off, `place_home`. With it: the holder of ``conversation`` or ``key``,
        else the first backend of the key's order with share room (``choices`` 2: the less loaded
        of the first two, `Balanced.preferred`).
        """
        balanced = self.balanced(key, model, candidates, conversation, choices, short) if balance else None
        if balanced is None:
            return self.place_home(key, model, candidates)
        chosen = next(balanced.preferred())
        return _balanced_decision(balanced, chosen, key)

    # -- router-replica sync (kvroute.strategy.Holds) -----------------------------------------

    def holds_made(self, request: kvroute.RouteRequest, decision: kvroute.Decision) -> list[kvroute.Hold]:
        """The keys ``on_request_start`` made ``decision.backend`` the holder of (none with the share bound off)."""
        if self._shares is None or request.affinity_key is not None:
            return []
        backend_id = decision.backend.id
        conversation = self._conversation(request)
        holds = [] if conversation is None else [kvroute.Hold("conversation", conversation, backend_id)]
        moves_key = not (
            decision.spilled or decision.reason == "replicated" or decision.detail.get("held") == "conversation"
        )
        if moves_key and decision.key is not None and decision.key != conversation:
            holds.append(kvroute.Hold("key", decision.key, backend_id))
        if self.prefix == "messages" and _opens_conversation(request):  # as on_request_start observes it
            holds.append(kvroute.Hold("group", self._group(request)[1], backend_id))
        return holds

    def adopt_holds(self, holds: Sequence[kvroute.Hold]) -> dict[str, int]:
        """Hold the keys of another replica's holds that no request here held (``Shares.adopt``)."""
        shares = self._shares
        if shares is None:
            return {}
        adopted = opened = 0
        members = len(self._placement.states)
        for i, hold in enumerate(holds):
            if hold.kind == "group":  # a conversation another replica started: hot groups count every replica's
                self._hot_groups.observe(hold.key, members)
                opened += 1
                continue
            adopted += shares.adopt(hold.key, hold.backend_id)
            if hold.kind != "key":  # one per request another replica started: the window counts every replica's
                # The key it was placed by comes right after it (`Router._log_holds`' order): a key placed by
                # every replica's requests is hot as it is for one router seeing them all (`Shares.is_hot`).
                after = holds[i + 1] if i + 1 < len(holds) else None
                placed = (
                    after.key
                    if after is not None and after.kind == "key" and after.backend_id == hold.backend_id
                    else None
                )
                shares.record(hold.backend_id, (), placed)
            if hold.kind == "conversation" and self.share_conversations:  # and the conversations under way
                shares.converse(hold.backend_id, hold.key)
        return {"adopted": adopted, "held": len(holds) - adopted - opened, "groups": opened}

    def place_session(
        self, key: int, model: str | None, candidates: Sequence[kvroute.BackendState]
    ) -> kvroute.Decision:
        """Place a new session when replicas share their bindings: under the share bound, as a new conversation."""
        return self.place(key, model, candidates, choices=self.share_choices, balance=True)

    def place_home(self, key: int, model: str | None, candidates: Sequence[kvroute.BackendState]) -> kvroute.Decision:
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


def _balanced_decision(balanced: Balanced, chosen: kvroute.BackendState, key: int) -> kvroute.Decision:
    """The decision for ``chosen`` when it is the first of ``balanced.preferred()`` (no load limit passed it over)."""
    home = balanced.home
    detail: dict[str, object] = {"home": balanced.home_id}
    if chosen is balanced.holder:
        detail["held"] = balanced.held
    if chosen is home:
        return kvroute.Decision(chosen.backend, reason="hash", key=key, detail=detail)
    detail["rank"] = balanced.rank(chosen)
    if chosen is balanced.holder:
        return kvroute.Decision(chosen.backend, reason="held", key=key, detail=detail)
    if home is None:
        return kvroute.Decision(
            chosen.backend,
            reason="spilled",
            key=key,
            spilled=True,
            detail=detail,
            spill_reason=kvroute.SpillReason.HOME_UNROUTABLE,
        )
    return kvroute.Decision(chosen.backend, reason="balanced", key=key, detail=detail)


def _opens_conversation(request: kvroute.RouteRequest) -> bool:
    """Whether ``request`` is a conversation's first turn (`kvroute.keys.opens_conversation`).

    Hot groups count conversations, not turns: a few long conversations would otherwise make a
    group look hot early on, and moving them to their own keys costs their history.
    """
    return opens_conversation(request)


@kvroute.hookimpl
def kvroute_register_strategies(register: Callable[..., None]) -> None:
    register("consistent-hash", ConsistentHash)
