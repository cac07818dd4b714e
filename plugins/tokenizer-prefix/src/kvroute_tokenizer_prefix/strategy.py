"""The ``tokenizer-prefix`` strategy: send a request to the backend that holds most of the prompt's KV blocks,
within the load cap.

Per request (``pick``, under the router's lock, no I/O):

1. Tokens: the client's ``token_ids`` as they are, else the prompt as the engine builds it
   (chat template + the model's tokenizer, or the word-level fallback), lazily, piece by piece.
2. Blocks: chained hashes of full ``block_size`` blocks, LoRA and ``cache_salt`` in the first
   block's key, at most ``max_prefix_tokens`` tokens. Pieces whose whole prefix was hashed
   before come from a memo. A chat prompt longer than that also gets one hash per message
   (``messages_past_cap``), chained from its last block: sessions under a shared preamble
   longer than the cap are told apart by their messages, without tokenizing them.
3. Match: for each candidate, how many leading blocks it holds (index of what the router sent
   or what KV events reported, plus recent decisions). Hashing stops as soon as no candidate
   can match further, so a prompt nobody has seen costs its first fine piece or so. The
   prompt's *hot head* (`kvroute_tokenizer_prefix.heat`: leading blocks that more than one
   backend's share of the recent requests start with) does not count: it is worth its prefill
   once on every backend, and counting it would send every new prompt under it to whoever
   held it first.
4. Choice:
   * no candidate holds anything past the hot head (*cold*): the rendezvous order of the hash
     of the prompt's first ``key_blocks`` blocks past its hot head, and the ``bounded-load``
     plugin's `choose` takes the first with room under its bound without the ``min_capacity``
     floor (the floor keeps hits, and a cold prompt has none to keep): cold prompts spread
     evenly and, at equal loads, every router replica agrees;
   * else each candidate scores ``matched tokens - load_cost_tokens * load / weight`` (matched
     past the hot head; ``load_cost_tokens`` is 0 by default) and the candidates are ordered
     best score first (ties in the key's rendezvous order); the ``bounded-load`` plugin's
     `choose` takes the first with room under ``load_factor`` / ``concurrency_threshold``,
     else the least loaded.
   * with ``share_factor`` (the share bound, `kvroute_tokenizer_prefix.choice.StartWindow`): a new
     chat conversation under a short shared prefix does not count its match on a backend over its
     share of the recent starts (it is then cold, keyed by its own first user message), and a cold
     prompt goes first to its key's last backend, then to starved backends, then to those with room.

When the router sends the request (``on_request_start``) the blocks ``pick`` hashed are
recorded for that backend at once. The rest of the prompt is not tokenized then: it is kept
as a *pending tail* of that backend, keyed by the last recorded block. A later request whose
match reaches that block on that backend extends the tail exactly as far as the two prompts
agree (the shared pieces are tokenized once, for both) and records those blocks before
matching on. So a prompt's first sighting costs about what its ``pick`` cost, a prompt never
shared is never tokenized in full, and a burst of siblings still co-locates: the second
sibling finds the first one's blocks. With ``prefetch`` on, a background thread tokenizes
pending tails ahead of time, so that extending one usually finds its pieces cached.

The strategy composes the pieces: `kvroute_tokenizer_prefix.match` (step 3),
`kvroute_tokenizer_prefix.choice` (step 4), `kvroute_tokenizer_prefix.tails` (pending tails),
`kvroute_tokenizer_prefix.prefetch`, the block index (`kvroute_tokenizer_prefix.index`) and
the tokenizers.
"""

from __future__ import annotations

from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import xxhash
from kvroute_bounded_load import BoundedLoad, LoadBound

import kvroute
from kvroute.adapters.kv_events import CPU, DISK, GPU
from kvroute.errors import InvalidRequest
from kvroute.logs import get_logger
from kvroute.options import (
    bool_option,
    float_option,
    int_option,
    optional_float_option,
    optional_int_option,
    str_option,
)
from kvroute.ranks import choose_rank, rank_for, rank_order
from kvroute_tokenizer_prefix.blocks import PromptBlocks, root_hash
from kvroute_tokenizer_prefix.choice import COLD_EVIDENCE, EVIDENCE, SHARE_FACTOR, Chooser, StartWindow
from kvroute_tokenizer_prefix.choice import START_WINDOW as START_WINDOW
from kvroute_tokenizer_prefix.heat import HotPrefixes
from kvroute_tokenizer_prefix.index import DEFAULT_CAPACITY_BLOCKS, BlockIndex, RecentDecisions
from kvroute_tokenizer_prefix.match import match_bisect, match_walk
from kvroute_tokenizer_prefix.memo import PieceMemo
from kvroute_tokenizer_prefix.prefetch import Prefetcher

# The pending tails' bounds, importable from here too; `kvroute_tokenizer_prefix.tails` reads them (change them there).
from kvroute_tokenizer_prefix.tails import MAX_TAIL_BYTES as MAX_TAIL_BYTES
from kvroute_tokenizer_prefix.tails import MAX_TAILS as MAX_TAILS
from kvroute_tokenizer_prefix.tails import PendingTail, PendingTails
from kvroute_tokenizer_prefix.tokenizer import ModelTokenizer, PromptTokenizer, WordTokenizer, load_tokenizer

__all__ = ["DEFAULT_BLOCK_SIZE", "TokenizerPrefix"]

log = get_logger(__name__)

#: Block size used until an option or an adapter says otherwise (vLLM's default on GPUs).
DEFAULT_BLOCK_SIZE = 16
_WORDS = ("words", "none", "whitespace")
_MAX_PENDING = 1024
#: Started requests per data-parallel backend over which a new prompt's rank is chosen (the least used rank).
RANK_WINDOW = 64
#: A conversation's first turn whose match past the hot head is at most this many tokens (a short shared prefix,
#: such as an application's system prompt: cheap to compute again) leaves a holder without share room.
COPY_TOKENS = 256
#: Keys whose last backend the strategy remembers (`TokenizerPrefix.holds_made` and the cold placement).
MAX_HELD = 65536


@attrs.define
class TokenizerPrefix(kvroute.BaseStrategy):
    """Route to the candidate holding the longest prefix of the request's KV blocks, load-bounded.

    Options (all documented with their defaults and ranges in docs/tokenizer-prefix.md):
    ``tokenizer``, ``chat_template``, ``content_format``, ``block_size``, ``max_prefix_tokens``,
    ``messages_past_cap``, ``capacity_blocks``, ``load_cost_tokens``, ``key_blocks``, ``cold_choices``,
    ``share_factor``, ``hot_window``, ``load_factor``,
    ``concurrency_threshold``, ``min_capacity``, ``engine_load``, ``recent_ttl``, ``recent_grace``,
    ``cpu_credit``, ``disk_credit``, ``piece_bytes``,
    ``fine_bytes``, ``cache_tokens``, ``memo_blocks``, ``prefetch``.

    Decisions: ``prefix`` (the best-scoring candidate with matched blocks had room), ``cold``
    (nothing matched past the hot head: the key's first backend had room), ``spilled`` (a later candidate of
    the order; ``spill_reason`` says which limit), ``least_loaded`` (every candidate was full),
    ``untokenizable`` (the prompt could not be tokenized: placed by its text prefix).
    """

    tokenizer: str | None = str_option(None)
    chat_template: str | None = str_option(None)
    content_format: str = str_option("auto", choices=("auto", "string", "openai"))
    block_size: int | None = optional_int_option(min=1, max=4096)
    max_prefix_tokens: int = int_option(8192, min=1, max=1 << 20)
    messages_past_cap: bool = bool_option(True)
    capacity_blocks: int = int_option(DEFAULT_CAPACITY_BLOCKS, min=1, max=1 << 26)
    load_cost_tokens: float = float_option(0.0, min=0.0, max=1e9)
    key_blocks: int = int_option(4, min=1, max=4096)
    cold_choices: int = int_option(1, min=1, max=64)
    share_factor: float | None = optional_float_option(SHARE_FACTOR, min=1.0, max=100.0)
    hot_window: int = int_option(1024, min=0, max=1 << 20)
    load_factor: float | None = optional_float_option(1.25, min=1.0, max=100.0)
    concurrency_threshold: int | None = optional_int_option(min=1, max=1024)
    min_capacity: int = int_option(16, min=0, max=1024)
    engine_load: bool = bool_option(False)
    recent_ttl: float = float_option(30.0, min=0.0, max=86400.0)
    recent_grace: float = float_option(5.0, min=0.0, max=3600.0)
    cpu_credit: float = float_option(0.85, min=0.0, max=1.0)
    disk_credit: float = float_option(0.35, min=0.0, max=1.0)
    piece_bytes: int = int_option(2048, min=1, max=1 << 20)
    fine_bytes: int = int_option(128, min=1, max=1 << 20)
    cache_tokens: int = int_option(1 << 19, min=0, max=1 << 32)
    memo_blocks: int = int_option(1 << 19, min=0, max=1 << 32)
    prefetch: bool = bool_option(True)
    #: Decisions by reason, since the strategy was built.
    reasons: Counter[str] = attrs.field(factory=Counter, init=False)
    #: Spilled decisions that were started, by spill reason.
    spill_reasons: Counter[str] = attrs.field(factory=Counter, init=False)
    _tok: PromptTokenizer = attrs.field(init=False)
    _index: BlockIndex = attrs.field(init=False)
    _recent: RecentDecisions = attrs.field(init=False)
    _placer: BoundedLoad = attrs.field(init=False)
    _chooser: Chooser = attrs.field(init=False)
    #: Per request picked and not started yet: its blocks and how many leading blocks it shared.
    _pending: OrderedDict[str, tuple[PromptBlocks, int]] = attrs.field(init=False, factory=OrderedDict)
    _heat: HotPrefixes | None = attrs.field(init=False, default=None)
    _totals: Counter[str] = attrs.field(factory=Counter, init=False)
    #: Tokens of the chosen backend's match, by the tier its blocks were on; decisions naming a rank, by rank.
    tier_hits: Counter[str] = attrs.field(factory=Counter, init=False)
    rank_decisions: Counter[int] = attrs.field(factory=Counter, init=False)
    _credit: dict[str, float] = attrs.field(init=False, factory=dict)
    _rank_started: dict[str, _RankWindow] = attrs.field(init=False, factory=dict)
    _started: StartWindow = attrs.field(init=False, factory=StartWindow)
    #: key -> the backend its last request went to (here, or on another replica: `adopt_holds`), oldest first.
    _held: OrderedDict[int, str] = attrs.field(init=False, factory=OrderedDict)
    _caches_memo: tuple[object, int, int] = attrs.field(init=False, default=(None, 0, 0))
    _memo: PieceMemo = attrs.field(init=False)
    _prefetcher: Prefetcher | None = attrs.field(init=False, default=None)
    _tails: PendingTails = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        if self.tokenizer is None or self.tokenizer.strip().lower() in _WORDS:
            self._tok = WordTokenizer()
        else:
            self._tok = load_tokenizer(
                self.tokenizer,
                chat_template=self.chat_template,
                content_format=self.content_format,
                piece_bytes=self.piece_bytes,
                fine_bytes=self.fine_bytes,
                cache_tokens=self.cache_tokens,
            )
        self._index = BlockIndex(self.block_size or DEFAULT_BLOCK_SIZE, self.capacity_blocks)
        self._recent = RecentDecisions(self.recent_ttl, grace_s=self.recent_grace)
        self._credit = {CPU: self.cpu_credit, DISK: self.disk_credit}
        self._memo = PieceMemo(max_blocks=self.memo_blocks)
        self._tails = PendingTails(self._index)
        if self.hot_window:
            self._heat = HotPrefixes(self.hot_window)
        self._placer = BoundedLoad(
            load_factor=self.load_factor,
            concurrency_threshold=self.concurrency_threshold,
            engine_load=self.engine_load,
            min_capacity=self.min_capacity,
        )
        self._chooser = Chooser(self._placer, self.load_cost_tokens, self.cold_choices, self._started.counts)

    # -- what adapters and operators use ---------------------------------------------------

    @property
    def bound(self) -> LoadBound:
        """The load limits this strategy applies (sessions read them to keep a bound session or move it)."""
        return self._placer.bound

    def place(self, key: int, model: str | None, candidates: Sequence[kvroute.BackendState]) -> kvroute.Decision:
        """Place a key by rendezvous under the load bound, as ``bounded-load`` does (a new session's first request)."""
        return self._placer.place(key, model, candidates)

    @property
    def index(self) -> BlockIndex:
        """The block index: adapters feed KV events into it (``set_exact``, ``blocks_stored``...)."""
        return self._index

    @property
    def recent(self) -> RecentDecisions:
        """Recent decisions to exact-mode backends (burst co-location)."""
        return self._recent

    @property
    def prompt_tokenizer(self) -> PromptTokenizer:
        """The tokenizer in use (`ModelTokenizer` or `WordTokenizer`)."""
        return self._tok

    @property
    def current_block_size(self) -> int:
        """The block size hashes are computed with now."""
        return self._index.block_size

    def stats(self) -> dict[str, Any]:
        """Counters for operators: decisions by reason, spills, tokens hashed / available / chosen, index size."""
        return {
            "decisions": dict(self.reasons),
            "spill_reasons": dict(self.spill_reasons),
            "prompt_tokens": self._totals["prompt_tokens"],
            "reuse_available_tokens": self._totals["available"],
            "reuse_chosen_tokens": self._totals["chosen"],
            "index_blocks": len(self._index),
            "hot_blocks": self._heat.hot if self._heat is not None else 0,
            "recent_requests": len(self._recent),
            "recent_kept_after_finish": self._recent.kept_after_finish,
            "tier_hit_tokens": dict(self.tier_hits),
            "tier_blocks": self._tier_blocks(),
            "rank_decisions": {str(rank): n for rank, n in sorted(self.rank_decisions.items())},
            "pending_tails": len(self._tails),
            "pending_tail_bytes": self._tails.bytes,
            "tails_extended": self._tails.extended,
            "tail_blocks_recorded": self._tails.blocks_recorded,
            "memo_pieces": len(self._memo),
            "memo_blocks": self._memo.blocks,
            "prefetched_pieces": self._prefetcher.pieces if self._prefetcher is not None else 0,
            "prefetch_dropped": self._prefetcher.dropped if self._prefetcher is not None else 0,
        }

    def _tier_blocks(self) -> dict[str, int]:
        """Blocks the index holds per slower tier (the GPU's are ``index_blocks``)."""
        return {tier: len(masks) for tier, masks in self._index.tier_holders.items() if masks}

    def wait_prefetched(self, timeout: float | None = None) -> bool:
        """Block until the prefetch thread has nothing left to do (benchmarks, tests); False on timeout."""
        return self._prefetcher is None or self._prefetcher.wait_idle(timeout)

    def prompt_blocks(self, request: kvroute.RouteRequest) -> PromptBlocks:
        """A lazy view of ``request``'s block hashes with this strategy's settings."""
        return PromptBlocks(
            self._tok.segments(request),
            self._index.block_size,
            max(1, self.max_prefix_tokens // self._index.block_size),
            root_hash(request.lora, request.cache_salt),
            self._memo,
            beyond=(request.text, request.message_offsets)
            if self.messages_past_cap and request.message_offsets is not None
            else None,
        )

    # -- callbacks -----------------------------------------------------------------------

    def on_fleet_change(self, event: kvroute.FleetEvent, members: Sequence[kvroute.BackendState]) -> None:
        self._placer.on_fleet_change(event, members)
        if event.kind == "removed" and event.backend is not None:
            with self._index.lock:
                for slot in self._index.slots_of(event.backend.id):  # the backend's own, and its ranks'
                    bit = self._index.bit(slot)
                    self._recent.drop_bit(bit)
                    self._tails.clear(bit)
                self._index.remove_backend(event.backend.id)
                self._rank_started.pop(event.backend.id, None)

    def on_request_start(self, request: kvroute.RouteRequest, decision: kvroute.Decision) -> None:
        if decision.spilled:
            self.spill_reasons[str(decision.spill_reason or decision.reason)] += 1
        index = self._index
        with index.lock:
            blocks, shared = self._pending.pop(request.request_id, (None, 0))
            try:
                if blocks is None or blocks.block_size != index.block_size:
                    blocks = self.prompt_blocks(request)
                    blocks.ensure(self.key_blocks)
                    shared = 0
                elif not blocks.hashes:
                    blocks.ensure(1)
                if not blocks.done and blocks.remaining_bytes() <= self._tok.inline_bytes:
                    blocks.complete()  # little left, and cheap to tokenize: no pending tail
            except InvalidRequest:
                return  # pick() already placed it by its text
            self._started.add(decision.backend.id, self._caches())
            if decision.key is not None and decision.reason != "session":
                self._hold(decision.key, decision.backend.id)
            rank = self._rank_sent(decision)
            if rank is not None:
                window = self._rank_started.get(decision.backend.id)
                if window is None:
                    window = self._rank_started[decision.backend.id] = _RankWindow()
                window.add(rank)
            backend = index.slot(decision.backend.id, rank)
            hashes = blocks.hashes
            if self._heat is not None:
                self._heat.observe(hashes[:shared], self._caches())
            exact = index.is_exact(backend)
            if exact:
                self._recent.add(request.request_id, index.bit(backend), tuple(hashes))
            else:
                index.record(backend, hashes)
            if blocks.done or not hashes:
                return
            self._tails.add(
                PendingTail(
                    blocks,
                    backend,
                    index.bit(backend),
                    request.request_id if exact else None,
                    hashes[-1],
                    blocks.text_bytes(),
                )
            )
            if self.prefetch and isinstance(self._tok, ModelTokenizer):
                if self._prefetcher is None:
                    self._prefetcher = Prefetcher(index.lock)
                self._prefetcher.submit(blocks)

    def _hold(self, key: int, backend_id: str) -> None:
        """Make ``backend_id`` the holder of ``key`` (the most recent entry; past `MAX_HELD` the oldest go)."""
        held = self._held
        if key in held:
            held.move_to_end(key)
        elif len(held) >= MAX_HELD:
            held.popitem(last=False)
        held[key] = backend_id

    # -- router-replica sync (kvroute.strategy.Holds) -----------------------------------------

    def holds_made(self, request: kvroute.RouteRequest, decision: kvroute.Decision) -> list[kvroute.Hold]:
        """The key ``request`` was placed by and its backend, for the other replicas.

        None for a request the session table placed or bound (``session`` decisions, ``binds`` in the
        detail): its own hold stands for it.
        """
        if decision.key is None or decision.reason == "session" or "binds" in decision.detail:
            return []
        return [kvroute.Hold("key", decision.key, decision.backend.id)]

    def adopt_holds(self, holds: Sequence[kvroute.Hold]) -> dict[str, int]:
        """Take another replica's holds: each is one request it started (counted in the window of starts, so that
        replicas measure the same use) and, for a key not held here, where that key's requests go."""
        adopted = counted = 0
        with self._index.lock:
            caches = self._caches()
            for hold in holds:
                if hold.kind == "group":
                    continue
                self._started.add(hold.backend_id, caches)
                counted += 1
                if hold.kind == "key" and hold.key not in self._held:
                    self._hold(hold.key, hold.backend_id)
                    adopted += 1
        return {"adopted": adopted, "held": counted - adopted, "counted": counted}

    def _rank_sent(self, decision: kvroute.Decision) -> int | None:
        """The rank the request reaches: the decision's, or for a decision this strategy did not make (a session's
        binding) the one the host derives from its key (`kvroute.ranks.rank_for`)."""
        if decision.data_parallel_rank is not None:
            return decision.data_parallel_rank
        placement = self._placer.placement
        if self._caches() == len(placement.states):
            return None  # no data-parallel backend in the fleet
        for state in placement.states:
            if state.backend.id == decision.backend.id:
                return rank_for(decision, state)
        return None

    def on_request_finish(
        self, request: kvroute.RouteRequest, decision: kvroute.Decision, outcome: kvroute.Outcome
    ) -> None:
        if len(self._recent) or self._tails.has_requests:
            with self._index.lock:
                self._recent.finish(request.request_id, self._covered)
                self._tails.finish(request.request_id)

    def _covered(self, bit: int, hashes: Sequence[int]) -> bool:
        """Whether the index (the engine's events) holds the last of ``hashes`` for the slot of ``bit``."""
        return not hashes or bool(
            (self._index.holders.get(hashes[-1], 0) | self._index.tiered.get(hashes[-1], 0)) & bit
        )

    # -- deciding ------------------------------------------------------------------------

    def _sync_block_size(self, candidates: Sequence[kvroute.BackendState]) -> None:
        if self.block_size is not None:
            return
        load = candidates[0].load
        reported = load.block_size if load is not None else None
        if reported and reported != self._index.block_size:
            log.info("block_size_changed", old=self._index.block_size, new=reported, backend=candidates[0].id)
            self._index.reset(reported)
            self._recent = RecentDecisions(self.recent_ttl, grace_s=self.recent_grace)
            self._pending.clear()
            self._memo.clear()
            self._tails.clear()
            if self._heat is not None:
                self._heat.clear()

    def _caches(self) -> int:
        """Separate KV caches in the fleet: one per backend, one per rank of a data-parallel one (hot-head share).

        Counted again when the membership changes and every 256 calls (engines report their ranks in their load).
        """
        placement = self._placer.placement
        memo = self._caches_memo
        if memo[0] is placement and memo[2] < 256:
            self._caches_memo = (placement, memo[1], memo[2] + 1)
            return memo[1]
        count = sum(state.data_parallel_size for state in placement.states)
        self._caches_memo = (placement, count, 0)
        return count

    def _hot_depth(self, blocks: PromptBlocks) -> int:
        """Leading blocks of the prompt that are hot (0 with ``hot_window`` 0 or a one-backend fleet)."""
        if self._heat is None:
            return 0
        return self._heat.depth(blocks, self._caches())

    def _key(self, request: kvroute.RouteRequest, blocks: PromptBlocks, hot: int) -> int:
        """The caller's affinity key, else the hash of the first ``key_blocks`` blocks past the hot head (past the cap:
        through the first user message)."""
        if request.affinity_key is not None:
            return xxhash.xxh3_64_intdigest(request.affinity_key.encode("utf-8", "surrogatepass"), blocks.root)
        end = hot + self.key_blocks
        cap = blocks.max_blocks
        if end > cap and request.messages:
            # Past the cap the hashes are messages': the key runs through the first user message (the
            # conversation's own, the same in every later turn), or the first message past the head.
            first_user = next((i for i, m in enumerate(request.messages) if m.get("role") == "user"), 0)
            end = max(hot + 1, cap + first_user + 1)
        blocks.ensure(end)
        if blocks.hashes:
            return blocks.hashes[min(end, len(blocks.hashes)) - 1]
        return blocks.tail_key()

    def _short(self, request: kvroute.RouteRequest, blocks: PromptBlocks, best: int, hot: int) -> bool:
        """Whether ``request`` is a chat request matching at most `COPY_TOKENS` tokens past its hot head."""
        if request.messages is None or request.message_offsets is None or best > blocks.max_blocks:
            return False
        return (best - hot) * blocks.block_size <= COPY_TOKENS

    def _opens_short(self, request: kvroute.RouteRequest, blocks: PromptBlocks, best: int, hot: int) -> bool:
        """Whether ``request`` opens a chat conversation (no answer after its first user message) and matches at
        most `COPY_TOKENS` tokens past its hot head (a shared prefix that is cheap to compute on another backend)."""
        if not self._short(request, blocks, best, hot):
            return False
        messages = request.messages
        assert messages is not None
        first_user = next((i for i, m in enumerate(messages) if m.get("role") == "user"), len(messages))
        return not any(m.get("role") == "assistant" for m in messages[first_user + 1 :])

    def _conversation_key(self, request: kvroute.RouteRequest, blocks: PromptBlocks, key: int) -> int:
        """A conversation's own key: the hash of its text through its first user message (the caller's key if any)."""
        if request.affinity_key is not None or request.messages is None or request.message_offsets is None:
            return key
        first_user = next((i for i, m in enumerate(request.messages) if m.get("role") == "user"), 0)
        end = request.message_offsets[min(first_user + 1, len(request.message_offsets) - 1)]
        return xxhash.xxh3_64_intdigest(request.text[:end].encode("utf-8", "surrogatepass"), blocks.root)

    def _slots(self, candidates: Sequence[kvroute.BackendState]) -> tuple[list[int], list[int | None], list[str]]:
        """The index slots to match: each candidate's, or each of its ranks' (owner index, rank, slot name)."""
        for state in candidates:
            load = state.load
            if state.backend.data_parallel_size != 1 or (load is not None and load.data_parallel_size is not None):
                break
        else:  # no data parallelism (the usual case): one slot per candidate, its own name
            n = len(candidates)
            return list(range(n)), [None] * n, [state.backend.id for state in candidates]
        owners: list[int] = []
        ranks: list[int | None] = []
        names: list[str] = []
        slot = self._index.slot
        for j, state in enumerate(candidates):
            size = state.data_parallel_size
            if size == 1:
                owners.append(j)
                ranks.append(None)
                names.append(state.id)
                continue
            for rank in range(size):
                owners.append(j)
                ranks.append(rank)
                names.append(slot(state.id, rank))
        return owners, ranks, names

    def _match(self, blocks: PromptBlocks, names: Sequence[str]) -> tuple[list[int], list[int]]:
        """Leading blocks held by each slot (index or recent decisions), hashing only as far as needed; and the bits.

        Where a slot stops matching, a pending tail of that slot ending right there is
        extended first. Slots the index learns about from the router's own records are
        prefix-closed (see `BlockIndex.record`: holding a block means holding every block
        before it), so their match lengths are found by bisection; with an exact-mode
        candidate (KV events may remove any block) or blocks on slower tiers, every block is looked up.
        """
        index = self._index
        bits = [index.bit(name) for name in names]
        matched = [0] * len(names)
        exact = index.exact_backends
        if index.tiered or (exact and any(index.is_exact(name) for name in names)):
            match_walk(blocks, bits, matched, index, self._tails, self._recent)
        else:
            match_bisect(blocks, bits, matched, index, self._tails, self._recent)
        return matched, bits

    def _credited(self, hashes: Sequence[int], bit: int, start: int, end: int) -> tuple[float, Counter[str]]:
        """Blocks ``start .. end - 1`` of the slot of ``bit`` weighed by their tier's credit, and counted per tier."""
        gpu = self._index.holders.get
        recent = self._recent.holders.get
        tiers = self._index.tier_holders
        credit = 0.0
        counts: Counter[str] = Counter()
        for h in hashes[start:end]:
            if (gpu(h, 0) | recent(h, 0)) & bit:
                credit += 1.0
                counts[GPU] += 1
                continue
            best, where = 0.0, None
            for tier, masks in tiers.items():
                if masks.get(h, 0) & bit:
                    value = self._credit.get(tier, 0.0)
                    if where is None or value > best:
                        best, where = value, tier
            credit += best
            counts[where or GPU] += 1
        return credit, counts

    def pick(self, request: kvroute.RouteRequest, candidates: Sequence[kvroute.BackendState]) -> kvroute.Decision:
        with self._index.lock:
            self._sync_block_size(candidates)
            if len(self._recent):
                self._recent.expire()
            owners, ranks, names = self._slots(candidates)
            try:
                blocks = self.prompt_blocks(request)
                blocks.ensure(self.key_blocks)
                hot = self._hot_depth(blocks)
                key = self._key(request, blocks, hot)
                slot_matched, bits = self._match(blocks, names)
            except InvalidRequest as exc:
                log.info("tokenize_failed", request_id=request.request_id, error=str(exc))
                decision = self._placer.pick(request, candidates)
                self.reasons["untokenizable"] += 1
                return attrs.evolve(decision, reason="untokenizable", detail={**decision.detail, "error": str(exc)})
            # What the request shares with the traffic seen: its longest match and one block more.
            self._pending[request.request_id] = (blocks, max(slot_matched) + 1)
            self._pending.move_to_end(request.request_id)
            while len(self._pending) > _MAX_PENDING:
                self._pending.popitem(last=False)
            # Each slot's score in blocks past the hot head (slower tiers at their credit).
            hashes = blocks.hashes
            tiered = bool(self._index.tiered)
            slot_scores = [
                (self._credited(hashes, bit, hot, m)[0] if tiered else float(m - hot)) if m > hot else 0.0
                for m, bit in zip(slot_matched, bits, strict=True)
            ]
        if len(owners) == len(candidates):
            matched, scores = slot_matched, slot_scores
        else:
            matched = [0] * len(candidates)
            scores = [0.0] * len(candidates)
            for j, m, score in zip(owners, slot_matched, slot_scores, strict=True):
                matched[j] = max(matched[j], m)
                scores[j] = max(scores[j], score)
        bs = blocks.block_size
        best = max(matched)
        tokens_of = blocks.tokens_of  # message hashes past the cap count no tokens
        detail: dict[str, Any] = {
            "best_matched_tokens": tokens_of(best),
            "tokenized": blocks.tokens,
            "hot_tokens": tokens_of(hot),
        }
        if len(hashes) > blocks.max_blocks:
            detail["best_matched_messages"] = max(0, best - blocks.max_blocks)
        self._totals["prompt_tokens"] += blocks.tokens
        self._totals["available"] += tokens_of(best)
        room = None
        if self.share_factor is not None and len(candidates) > 1:
            room = self._started.levels(candidates, self.share_factor, COLD_EVIDENCE)
            if (
                best > hot
                and max(room) > 1
                and len(self._started) >= EVIDENCE * len(candidates)
                and self._opens_short(request, blocks, best, hot)
            ):
                # A new conversation under a short shared prefix (not hot) leaves a holder without share room, and
                # one at or over its share while another backend is starved.
                limit = 1 if 0 in room else 2
                kept = [m if level <= limit else min(m, hot) for m, level in zip(matched, room, strict=True)]
                if max(kept) <= hot:
                    detail["left"] = candidates[max(range(len(matched)), key=matched.__getitem__)].id
                    key = self._conversation_key(request, blocks, key)
                best = max(kept)
                matched = kept
                scores = [score if level <= limit else 0.0 for score, level in zip(scores, room, strict=True)]
        held = None
        if self._held:
            holder = None
            if best <= hot:
                holder = self._held.get(key)
            elif room is not None and self._short(request, blocks, best, hot):
                # A conversation's later turn with little history matched: where its first turn went, among the
                # backends that match it best (its first turn may have left its system prompt's holder).
                holder = self._held.get(self._conversation_key(request, blocks, key))
            held = next((j for j, state in enumerate(candidates) if state.id == holder), None)
            if held is not None:
                detail["held"] = holder
        decision = self._chooser.decide(
            key, request.model, candidates, matched, best, hot, bs, detail, scores if tiered else None, room, held
        )
        if len(owners) == len(candidates):
            slot = next(j for j, state in enumerate(candidates) if state.backend is decision.backend)
        else:
            chosen = next(j for j, state in enumerate(candidates) if state.backend is decision.backend)
            slot = next(i for i, j in enumerate(owners) if j == chosen)
            if ranks[slot] is not None:
                slot = self._choose_rank(candidates[chosen], key, owners, ranks, slot_scores, chosen)
                rank = ranks[slot]
                decision = attrs.evolve(decision, data_parallel_rank=rank)
                self.rank_decisions[rank or 0] += 1
        detail["matched_tokens"] = tokens_of(slot_matched[slot])
        if slot_matched[slot] and tiered:
            with self._index.lock:
                _, counts = self._credited(hashes, bits[slot], 0, min(slot_matched[slot], blocks.max_blocks))
            for tier, n in counts.items():
                self.tier_hits[tier] += n * bs
            if set(counts) - {GPU}:
                detail["tier_tokens"] = {tier: n * bs for tier, n in sorted(counts.items())}
        elif slot_matched[slot]:
            self.tier_hits[GPU] += tokens_of(slot_matched[slot])
        self.reasons[decision.reason] += 1
        self._totals["chosen"] += detail["matched_tokens"]
        return decision

    def _choose_rank(
        self,
        state: kvroute.BackendState,
        key: int,
        owners: Sequence[int],
        ranks: Sequence[int | None],
        scores: Sequence[float],
        chosen: int,
    ) -> int:
        """The slot of ``state``'s rank that gets the request, under the ranks' reported loads
        (`kvroute.ranks.choose_rank`).

        A prompt some rank holds part of: best score first, ties in the key's rank order. A prompt no
        rank holds anything of (past the hot head): the rank that started the fewest of the backend's
        last `RANK_WINDOW` requests first, ties in the key's rank order, so new prompts spread evenly
        over the ranks; their siblings then follow by score (they match the first one's blocks).
        """
        slots = {ranks[i]: i for i, j in enumerate(owners) if j == chosen}
        position = {rank: p for p, rank in enumerate(rank_order(key, len(slots)))}
        if any(scores[i] > 0 for i in slots.values()):
            order = sorted((r for r in slots if r is not None), key=lambda rank: (-scores[slots[rank]], position[rank]))
        else:
            started = self._rank_started.get(state.id)
            counts = started.counts if started is not None else {}
            order = sorted((r for r in slots if r is not None), key=lambda rank: (counts.get(rank, 0), position[rank]))
        return slots[choose_rank(state, order)]


@attrs.define
class _RankWindow:
    """The ranks of a data-parallel backend's last `RANK_WINDOW` started requests, and how many each got."""

    ranks: deque[int] = attrs.field(factory=lambda: deque(maxlen=RANK_WINDOW))
    counts: Counter[int] = attrs.field(factory=Counter)

    def add(self, rank: int) -> None:
        """Count one started request on ``rank`` (the oldest leaves the window)."""
        if len(self.ranks) == RANK_WINDOW:
            self.counts[self.ranks[0]] -= 1
        self.ranks.append(rank)
        self.counts[rank] += 1


@kvroute.hookimpl
def kvroute_register_strategies(register: Callable[..., None]) -> None:
    register("tokenizer-prefix", TokenizerPrefix)
