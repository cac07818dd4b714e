"""Sessions: the requests of one session, or of one conversation, stay on one backend.

An agent or a chat resends its growing history every turn, so each turn finds the previous
turn's KV blocks only on the backend that served it. `Sessions` remembers that backend, for
two kinds of keys:

* ``session``: the request names its session (`RouteRequest.session_id`, read from the sources
  in `kvroute.session_ids`). With no binding yet, the session is placed by its own key: a
  strategy with ``place(key, model, candidates)`` (the consistent-hash family) puts it on the
  key's rendezvous home under its load bound (not under bounded-load's share bound, which
  depends on the traffic each replica saw), so every router replica sends a new session to the
  same backend without talking to the others; any other strategy picks as usual.
* ``conversation``: no session id, but the strategy can tell one conversation's turns apart
  (an optional ``conversation_key(request) -> int | None`` method: the same key for every
  turn). The first turn goes where the strategy sends it; later turns follow it, even after
  the strategy's own key for them changed (a system prompt that turned hot).

Router replicas that do not talk to each other each see a part of every conversation's turns. A
turn that reaches a replica which never saw its conversation would be placed by that replica's own
share and holder state, often elsewhere than its history. So, with ``agree`` (``auto``: when the
replica's own traffic shows other routers, `kvroute.agreement.Strangers`; ``on``; ``off``), a
conversation is placed as a session id is: by the strategy's ``place`` on its conversation key
(its home, moved only by the load bound), a pure function of the request that every replica
computes alike. A binding made before that by the strategy's own pick (an ``unagreed`` one) is
placed again once, by the same rule, so replicas that switched at different times converge.

Router replicas that share their holds (``kvroute serve --peer``; `holds_made` and `adopt_holds`,
the `kvroute.strategy.Holds` methods) agree on bindings without the pure hash: with ``shared``, a new
session is placed by the strategy's ``place_session(key, model, candidates)`` when it has one (the
consistent-hash family's share bound: the less loaded of the first two backends of the session's
order), so sessions spread like conversations do; the other replicas learn the binding from its
sender within a batch interval.

A bound request goes to its backend while that backend is a candidate (healthy, not draining,
not excluded for a retry) and, for a strategy with a load bound (a ``bound`` attribute with
``measure(candidates).limit(state)``, as ``bounded-load`` has), has room under it. Otherwise
the request is placed again as if new, the binding moves to the backend it went to, and stays
there: the session does not move back when its old backend recovers.

Bindings expire ``ttl_s`` seconds after their last request, and the least recently used go
first beyond ``max_sessions`` (about 200 bytes each). The router calls `pick` under its lock
and `request_started` once the request is counted in flight; nothing here does I/O.
"""

from __future__ import annotations

import functools
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from typing import Any, Literal

import attrs
import xxhash

from kvroute.agreement import Strangers
from kvroute.backend import BackendState
from kvroute.hashing import hash_parts
from kvroute.keys import opens_conversation
from kvroute.options import float_option, int_option, str_option
from kvroute.request import RouteRequest
from kvroute.strategy import Decision, Hold, Pick, Strategy

__all__ = ["AGREE", "Binding", "Kind", "Sessions", "session_key"]

#: Values of ``Sessions.agree``: place conversations by their key's home when other routers are seen, always, never.
AGREE = ("auto", "on", "off")

#: What a binding's key stands for.
Kind = Literal["session", "conversation"]


_SESSION_KEY_VERSION = "kvroute-session-key/1"
_xxh3 = xxhash.xxh3_64_intdigest


@functools.lru_cache(maxsize=4096)
def _scope(model: str, lora: str | None, cache_salt: str | None) -> int:
    return hash_parts(_SESSION_KEY_VERSION, model, lora, cache_salt)


def session_key(request: RouteRequest) -> int | None:
    """The 64-bit key of ``request``'s session id, scoped like a prefix key (model, LoRA adapter, salt)."""
    session = request.session_id
    if session is None:
        return None
    return _xxh3(session.encode("utf-8", "surrogatepass"), _scope(request.model, request.lora, request.cache_salt))


@attrs.define(slots=True)
class Binding:
    """Where one session's requests go, and when its last request arrived."""

    backend_id: str
    last_used: float
    kind: Kind
    #: Placed by a pure function of the request (``agree``), so other replicas would place it alike.
    agreed: bool = False


@attrs.define
class Sessions:
    """Session and conversation bindings for one router (see the module docstring).

    Counters: ``new`` (bindings made), ``stayed`` (requests sent to their bound backend),
    ``moved`` (bindings moved, by reason: ``unroutable`` or the load limit's reason),
    ``expired`` (dropped after ``ttl_s`` idle), ``evicted`` (dropped beyond ``max_sessions``).
    """

    ttl_s: float = float_option(300.0, min=1.0, max=86400.0)
    max_sessions: int = int_option(100_000, min=1, max=10_000_000)
    #: Bind conversations without a session id too, when the strategy has ``conversation_key``.
    conversations: bool = True
    #: Replicas share their bindings (`adopt_holds`): place new sessions by the strategy's ``place_session``.
    shared: bool = False
    #: Place conversations by their key's home (``AGREE``): ``auto`` when `Strangers` sees other routers.
    agree: str = str_option("auto", choices=AGREE)
    clock: Callable[[], float] = time.monotonic
    new: int = attrs.field(default=0, init=False)
    stayed: int = attrs.field(default=0, init=False)
    moved: Counter[str] = attrs.field(factory=Counter, init=False)
    expired: int = attrs.field(default=0, init=False)
    evicted: int = attrs.field(default=0, init=False)
    #: Other replicas' holds taken by `adopt_holds`, by result.
    adopted: Counter[str] = attrs.field(factory=Counter, init=False)
    #: New conversations, and which arrived with a history (``agree=auto``).
    strangers: Strangers = attrs.field(factory=Strangers, init=False)
    _table: OrderedDict[int, Binding] = attrs.field(factory=OrderedDict, init=False)
    _kinds: Counter[str] = attrs.field(factory=Counter, init=False)
    #: What the last `pick` found, for `request_started` on the same request: (request, key, kind, move
    #: reason, placed by the pure rule).
    _last: tuple[RouteRequest, int, Kind, str | None, bool] | None = attrs.field(default=None, init=False, repr=False)
    #: The last request `request_started` bound, and its key, for `holds_made` on the same request.
    _started: tuple[RouteRequest, int] | None = attrs.field(default=None, init=False, repr=False)

    def __len__(self) -> int:
        return len(self._table)

    def bound(self, kind: Kind | None = None) -> int:
        """Bindings held now (of one kind, or all)."""
        return len(self._table) if kind is None else self._kinds[kind]

    def binding(self, request: RouteRequest, strategy: Strategy | None = None) -> Binding | None:
        """The live binding of ``request``'s session or conversation, if any (does not refresh it)."""
        found = self._key(strategy, request)
        if found is None:
            return None
        binding = self._table.get(found[0])
        if binding is None or binding.last_used + self.ttl_s <= self.clock():
            return None
        return binding

    # -- deciding ----------------------------------------------------------------------

    def _key(self, strategy: Strategy | None, request: RouteRequest) -> tuple[int, Kind] | None:
        key = session_key(request)
        if key is not None:
            return key, "session"
        if not self.conversations or strategy is None:
            return None
        conversation_key = getattr(strategy, "conversation_key", None)
        if conversation_key is None:
            return None
        key = conversation_key(request)
        return None if key is None else (key, "conversation")

    @property
    def agreeing(self) -> bool:
        """Whether conversations are placed now by their key's home (``agree``; ``auto``: `Strangers` and no sync)."""
        agree = self.agree
        return agree == "on" or (agree == "auto" and not self.shared and self.strangers.on)

    def pick(self, strategy: Strategy, request: RouteRequest, candidates: Sequence[BackendState]) -> Pick:
        """``strategy``'s pick, or the bound backend when the request's session has one with room."""
        found = self._key(strategy, request)
        if found is None:
            self._last = None
            return strategy.pick(request, candidates)
        key, kind = found
        binding = self._live(key, self.clock())
        place = getattr(strategy, "place", None)
        agreeing = kind == "conversation" and callable(place) and self.agreeing
        move: str | None = None
        if binding is not None:
            state = _find(candidates, binding.backend_id)
            if state is None:
                move = "unroutable"
            else:
                move = _over_limit(strategy, state, candidates)
                if move is None and agreeing and not binding.agreed:
                    move = "agree"  # placed by this replica's own state: place it again, as every replica would
                if move is None:
                    self._last = (request, key, kind, None, binding.agreed)
                    return Decision(state.backend, reason="session", key=key, detail={"bound": kind})
        if kind == "session":
            if self.shared:
                place = getattr(strategy, "place_session", None) or place
            agreeing = callable(place) and not self.shared
        elif not agreeing:
            place = None
        self._last = (request, key, kind, move, agreeing)
        pick = place(key, request.model, candidates) if callable(place) else strategy.pick(request, candidates)
        if isinstance(pick, Decision):
            extra: dict[str, Any] = {"binds": kind}
            if agreeing and kind == "conversation":
                extra["agreed"] = True
            if binding is not None:
                extra.update(moved_from=binding.backend_id, move_reason=move)
            if move == "agree" and binding is not None and pick.backend.id == binding.backend_id:
                # The pure rule keeps it where it is: no move, the binding is agreed from now on.
                extra = {"bound": kind, "agreed": True}
                pick = attrs.evolve(pick, reason="session", detail=extra)
                return pick
            pick = attrs.evolve(pick, detail={**pick.detail, **extra})
        return pick

    def request_started(self, request: RouteRequest, decision: Decision) -> None:
        """``request`` was sent to ``decision.backend``: bind its session there, or refresh the binding."""
        last = self._last
        self._last = None
        if last is None or last[0] is not request:
            return  # not a request of a session (or decided elsewhere): nothing to bind
        _, key, kind, move, agreed = last
        self._started = (request, key)
        now = self.clock()
        backend_id = decision.backend.id
        binding = self._live(key, now)
        if binding is None:
            self._add(key, Binding(backend_id, now, kind, agreed))
            self.new += 1
            if kind == "conversation":
                self.strangers.observe(not opens_conversation(request))
            return
        if binding.backend_id != backend_id:
            binding.backend_id = backend_id
            self.moved[move or "strategy"] += 1
        else:
            self.stayed += 1
        binding.last_used = now
        binding.agreed = binding.agreed or agreed

    # -- router-replica sync -----------------------------------------------------------

    def holds_made(self, request: RouteRequest, decision: Decision) -> list[Hold]:
        """The binding ``request`` made or refreshed in `request_started`, as a hold for the other replicas."""
        started = self._started
        self._started = None
        if started is None or started[0] is not request:
            return []
        binding = self._table.get(started[1])
        if binding is None:
            return []
        return [Hold(binding.kind, started[1], binding.backend_id, max(0.0, self.clock() - binding.last_used))]

    def adopt_holds(self, holds: Sequence[Hold]) -> Counter[str]:
        """Take another replica's session and conversation bindings (other kinds are skipped).

        A key with no live binding here is bound (``new``); one bound to another backend moves when the
        peer's hold is the more recent (``newer``), else stays (``older``); one bound to the same backend
        is refreshed (``same``). Counted in ``adopted`` too.
        """
        results: Counter[str] = Counter()
        now = self.clock()
        for hold in holds:
            if hold.kind != "session" and hold.kind != "conversation":
                continue
            made = now - hold.age_s
            binding = self._live(hold.key, now)
            if binding is None:
                if made + self.ttl_s <= now:
                    results["expired"] += 1
                    continue
                self._add(hold.key, Binding(hold.backend_id, made, hold.kind))
                results["new"] += 1
            elif binding.backend_id == hold.backend_id:
                binding.last_used = max(binding.last_used, made)
                results["same"] += 1
            elif binding.last_used < made:
                binding.backend_id, binding.last_used = hold.backend_id, made
                results["newer"] += 1
            else:
                results["older"] += 1
        self.adopted.update(results)
        return results

    # -- the table ---------------------------------------------------------------------

    def _live(self, key: int, now: float) -> Binding | None:
        """The binding of ``key`` if it has not expired (expired ones are dropped, oldest first)."""
        self._expire(now)
        binding = self._table.get(key)
        if binding is not None:
            self._table.move_to_end(key)
        return binding

    def _expire(self, now: float) -> None:
        table = self._table
        deadline = now - self.ttl_s
        while table:
            key, oldest = next(iter(table.items()))
            if oldest.last_used > deadline:
                return
            del table[key]
            self._kinds[oldest.kind] -= 1
            self.expired += 1

    def _add(self, key: int, binding: Binding) -> None:
        table = self._table
        while len(table) >= self.max_sessions:
            _, dropped = table.popitem(last=False)
            self._kinds[dropped.kind] -= 1
            self.evicted += 1
        table[key] = binding
        self._kinds[binding.kind] += 1

    def stats(self) -> dict[str, Any]:
        """Counters and sizes, for the status page and metrics."""
        return {
            "bound": len(self._table),
            "bound_by_kind": {"session": self._kinds["session"], "conversation": self._kinds["conversation"]},
            "new": self.new,
            "stayed": self.stayed,
            "moved": dict(sorted(self.moved.items())),
            "expired": self.expired,
            "evicted": self.evicted,
            "adopted": dict(sorted(self.adopted.items())),
            "agree": self.agree,
            "agreeing": self.agreeing,
            "strangers": {"seen": self.strangers.seen, "with_history": self.strangers.foreign},
            "ttl_s": self.ttl_s,
            "max_sessions": self.max_sessions,
        }


def _find(candidates: Sequence[BackendState], backend_id: str) -> BackendState | None:
    for state in candidates:
        if state.id == backend_id:
            return state
    return None


def _over_limit(strategy: Strategy, state: BackendState, candidates: Sequence[BackendState]) -> str | None:
    """The strategy's load limit ``state`` is at (a reason word), or None when it has room or no bound."""
    measure = getattr(getattr(strategy, "bound", None), "measure", None)
    if measure is None:
        return None
    limit = measure(candidates).limit(state)
    return None if limit is None else str(limit)
