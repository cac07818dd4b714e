"""What a strategy claims, what a run exercised, and the checks of those claims (`ClaimChecks`).

`kvroute.testing.stateful.ScalingStateMachine` drives a fleet through changes and hands what it
observes (assignments of the sample keys before and after a change, loads at each start) to a
`ClaimChecks`, which asserts the claimed properties listed in that module's documentation.
Nothing here needs Hypothesis.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping
from fractions import Fraction

import attrs

from kvroute.testing.measure import Movement, Tolerance, exact, load_factor_cap

__all__ = ["ClaimChecks", "Claims", "Coverage"]


@attrs.frozen
class Claims:
    """Which invariants of `ScalingStateMachine` a strategy promises (see the module docs)."""

    deterministic: bool = True
    minimal_disruption: bool = True
    returns: bool = True
    balance: bool = True
    load_factor: float | None = None
    concurrency_threshold: int | None = None
    #: A floor under the ``load_factor`` cap (bounded-load's ``min_capacity``).
    min_capacity: int = 0
    #: Every start goes to a candidate with the fewest requests in flight per unit of weight.
    least_loaded: bool = False
    #: Held prefixes stay home: a start whose key some candidate holds (`kvroute.testing.footprint`)
    #: goes to a holder, unless every holder is full under the claimed load limits.
    resident: bool = False
    #: A cold key (no candidate holds it) goes to a candidate with cache room under this factor
    #: and ``cache_fill`` whenever one has room under the load limits too, else to one with room
    #: under this factor alone if one has (`footprint.cache_room`).
    cache_factor: float | None = None
    #: The fraction of a backend's KV capacity placed prefixes may fill (with ``kv_blocks`` telemetry).
    cache_fill: float | None = None

    @classmethod
    def none(cls) -> Claims:
        """No placement claim: only that picks are candidates and in-flight counts are conserved."""
        return cls(deterministic=False, minimal_disruption=False, returns=False, balance=False)

    @property
    def bounded(self) -> bool:
        return self.load_factor is not None or self.concurrency_threshold is not None

    @property
    def cache_bounded(self) -> bool:
        return self.cache_factor is not None or self.cache_fill is not None

    @property
    def live_checks(self) -> tuple[str, ...]:
        """The claimed checks that must meet a case able to fail them at least once per run."""
        names = []
        if self.load_factor is not None:
            names.append("load_factor")
        if self.concurrency_threshold is not None:
            names.append("concurrency_threshold")
        if self.least_loaded:
            names.append("least_loaded")
        if self.resident:
            names.append("resident")
        if self.cache_bounded:
            names.append("cache")
        return tuple(names)


@attrs.define
class Coverage:
    """What one run of a `ScalingStateMachine` exercised.

    ``live`` counts, per load check, the starts at which it could have failed: some candidate
    was full under ``load_factor`` (``concurrency_threshold``), or, for ``least_loaded``, the
    candidates' loads per unit of weight were not all equal; for ``resident``, some candidates
    held the key and others did not; for ``cache``, a cold key met a candidate without cache
    room. ``at_cap`` counts the starts at which some candidate sat exactly at its
    ``load_factor`` cap (the case an off-by-one misses).
    """

    examples: int = 0
    starts: int = 0
    live: Counter[str] = attrs.field(factory=Counter)
    at_cap: int = 0

    def require(self, claims: Claims, name: str) -> None:
        """Raise ``AssertionError`` for each claimed load check that never met a case it could fail."""
        why = {
            "load_factor": "a candidate full under load_factor",
            "concurrency_threshold": "a candidate at the concurrency threshold",
            "least_loaded": "candidates with unequal loads per unit of weight",
            "resident": "a key held by some candidates and not others",
            "cache": "a cold key and a candidate without cache room for it",
        }
        dead = [check for check in claims.live_checks if not self.live[check]]
        assert not dead, "; ".join(
            f"{name}: the {check} check never met {why[check]} in {self.starts} starts over {self.examples} "
            f"examples (expected at least one such start, got 0): raise burst, steps or max_examples, or lower "
            f"min_capacity (or the backends' kv_blocks), until the check can fail"
            for check in dead
        )


def _per_weight(loads: Mapping[str, int], weights: Mapping[str, float]) -> dict[str, Fraction]:
    """Each candidate's requests in flight per unit of weight, exactly."""
    return {b: Fraction(loads[b]) / exact(weights[b]) for b in loads}


def _assert_least_loaded(
    chosen: str, per_weight: Mapping[str, Fraction], loads: Mapping[str, int], weights: Mapping[str, float], what: str
) -> None:
    best = min(per_weight.values())
    assert per_weight[chosen] == best, (
        f"{what} expected a least loaded candidate ({float(best):.3f} in flight per unit of weight), got {chosen!r} "
        f"with {loads[chosen]} in flight at weight {weights[chosen]}; loads {dict(loads)}, weights {dict(weights)}"
    )


@attrs.frozen
class ClaimChecks:
    """The checks of what ``claims`` promises, on what one machine observed; each is a no-op unless claimed.

    Assignments are tuples of backend ids, one per sample key; ``shares`` give the routable
    backends' weight shares (computed only when a check needs them). Failures raise
    ``AssertionError`` saying what was expected and what was got.
    """

    claims: Claims
    tolerance: Tolerance
    #: The strategy's name, for messages.
    name: str

    # -- placement of the sample keys ----------------------------------------------------

    def balance(self, after: tuple[str, ...], shares: Callable[[], Mapping[str, float]]) -> None:
        """Each routable backend's share of the keys is within tolerance of its weight share."""
        if not self.claims.balance:
            return
        tol, k = self.tolerance, len(after)
        counts = Counter(after)
        for backend_id, p in shares().items():
            share = counts[backend_id] / k
            assert tol.allows(share, p, k), (
                f"balance: {backend_id} got {share:.4f} of {k} keys, expected {p:.4f} "
                f"+/- {tol.bound(p, k):.4f} (weight share; {tol.z} binomial deviations)"
            )

    def deterministic(self, after: tuple[str, ...], replica: Callable[[], tuple[str, ...]]) -> None:
        """A fresh strategy over the same members (``replica()``) places every key as ``after`` does."""
        if not self.claims.deterministic:
            return
        differ = sum(a != b for a, b in zip(after, replica(), strict=True))
        assert differ == 0, (
            f"determinism: a fresh {self.name} over the same members placed {differ} of {len(after)} keys "
            f"differently from the one that saw the history of changes"
        )

    def returns(
        self,
        after: tuple[str, ...],
        membership: Callable[[], frozenset[tuple[str, float]]],
        seen: dict[frozenset[tuple[str, float]], tuple[str, ...]],
    ) -> None:
        """A routable membership (ids, weights) seen before gives exactly the assignment seen then (``seen``, by
        membership, is updated here)."""
        if not self.claims.returns:
            return
        signature = membership()
        previous = seen.setdefault(signature, after)
        differ = sum(a != b for a, b in zip(after, previous, strict=True))
        assert differ == 0, (
            f"return: the routable membership {sorted(signature)} was seen before, "
            f"but {differ} of {len(after)} keys are now placed differently"
        )

    def gain(
        self,
        backend_id: str,
        before: tuple[str, ...],
        after: tuple[str, ...],
        what: str,
        shares: Callable[[], Mapping[str, float]],
    ) -> None:
        """Keys may only move to ``backend_id``, about its weight share of them."""
        if not self.claims.minimal_disruption:
            return
        movement = Movement(before, after)
        wrong = {b: n for b, n in movement.destinations().items() if b != backend_id}
        assert not wrong, f"{what} {backend_id!r}: keys moved to other backends too: {wrong}"
        moved_from = movement.origins()
        if what in ("add", "restore"):
            p, k = shares()[backend_id], len(after)
            assert self.tolerance.allows(movement.fraction, p, k), (
                f"{what} {backend_id!r}: {movement.fraction:.4f} of {k} keys moved, expected {p:.4f} "
                f"+/- {self.tolerance.bound(p, k):.4f} (its weight share; from {dict(moved_from)})"
            )

    def loss(
        self,
        backend_id: str,
        before: tuple[str, ...],
        after: tuple[str, ...],
        what: str,
        shares: Callable[[], Mapping[str, float]],
    ) -> None:
        """Keys may only move away from ``backend_id``, spread over the others by weight."""
        if not self.claims.minimal_disruption:
            return
        movement = Movement(before, after)
        wrong = {b: n for b, n in movement.origins().items() if b != backend_id}
        assert not wrong, f"{what} {backend_id!r}: keys of other backends moved too: {wrong}"
        if what == "down-weight":
            return
        orphans = len(movement.moved)
        if orphans:
            for survivor, p in shares().items():
                got = movement.destinations().get(survivor, 0)
                limit = self.tolerance.max_count(p, orphans)
                assert got <= limit + 1e-9, (
                    f"{what} {backend_id!r}: survivor {survivor!r} took {got} of {orphans} orphaned keys; "
                    f"its fair share is {orphans * p:.1f}, allowed at most {limit:.1f}"
                )

    # -- starts --------------------------------------------------------------------------

    def start(self, chosen: str, loads: Mapping[str, int], weights: Mapping[str, float], coverage: Coverage) -> None:
        """The claimed load checks of one start: the candidates' ``loads`` before it, ``chosen`` its backend."""
        if self.claims.bounded:
            self.bounded(chosen, loads, weights, coverage)
        if self.claims.least_loaded:
            per_weight = _per_weight(loads, weights)
            coverage.live["least_loaded"] += len(set(per_weight.values())) > 1
            _assert_least_loaded(chosen, per_weight, loads, weights, "least loaded:")

    def load_room(self, loads: Mapping[str, int], weights: Mapping[str, float]) -> set[str]:
        """The candidates with room for one more request under the claimed load limits (all when none is claimed)."""
        _, full_lf, full_threshold = self._full(loads, weights)
        return {b for b in loads if b not in full_lf and b not in full_threshold}

    def _full(
        self, loads: Mapping[str, int], weights: Mapping[str, float]
    ) -> tuple[dict[str, int], set[str], set[str]]:
        """The ``load_factor`` caps, and the candidates full under ``load_factor`` and under the threshold."""
        claims = self.claims
        lf, threshold = claims.load_factor, claims.concurrency_threshold
        total = sum(loads.values())
        caps = (
            {b: load_factor_cap(lf, weights[b], total, weights.values(), claims.min_capacity) for b in loads}
            if lf is not None
            else {}
        )
        full_lf = {b for b in caps if loads[b] + 1 > caps[b]}
        full_threshold = {b for b in loads if threshold is not None and loads[b] >= threshold}
        return caps, full_lf, full_threshold

    def bounded(self, chosen: str, loads: Mapping[str, int], weights: Mapping[str, float], coverage: Coverage) -> None:
        """A candidate with room under ``load_factor`` / ``concurrency_threshold`` is chosen if there is one, else
        a least loaded one."""
        claims = self.claims
        lf, threshold = claims.load_factor, claims.concurrency_threshold
        caps, full_lf, full_threshold = self._full(loads, weights)
        coverage.live["load_factor"] += bool(full_lf)
        coverage.live["concurrency_threshold"] += bool(full_threshold)
        coverage.at_cap += any(loads[b] == caps[b] for b in caps)
        with_room = sorted(b for b in loads if b not in full_lf and b not in full_threshold)
        if with_room:
            limits = []
            if chosen in full_lf:
                limits.append(f"load_factor cap {caps[chosen]}")
            if chosen in full_threshold:
                limits.append(f"concurrency_threshold {threshold}")
            assert not limits, (
                f"bounded load: placed on {chosen!r} (load {loads[chosen]}, weight {weights[chosen]}), full under "
                f"{' and '.join(limits)}, while {with_room} had room; expected a backend with room. Loads "
                f"{dict(loads)}, weights {dict(weights)}, caps {caps}, load_factor {lf}, min_capacity "
                f"{claims.min_capacity}, threshold {threshold}"
            )
        else:
            what = "bounded load: every candidate was full, so"
            _assert_least_loaded(chosen, _per_weight(loads, weights), loads, weights, what)

    def placement(
        self,
        chosen: str,
        key: int,
        holders: set[str],
        rooms: tuple[set[str], set[str]],
        load_room: set[str],
        candidates: set[str],
        coverage: Coverage,
    ) -> None:
        """The ``resident`` and cache-bound checks of one start of ``key``, on the model's state before it.

        ``rooms`` are the candidates with cache room under both bounds, and under ``cache_factor`` alone.
        """
        claims = self.claims
        if claims.resident and holders:
            coverage.live["resident"] += holders != candidates
            if holders & load_room:
                assert chosen in holders, (
                    f"resident: key {key} is held by {sorted(holders)} (of which {sorted(holders & load_room)} had "
                    f"room for a request), expected one of them, got {chosen!r}"
                )
        if claims.cache_bounded and not holders:
            both, factor_only = rooms
            coverage.live["cache"] += both != candidates
            for room, what in ((both, "cache room"), (factor_only, "room under cache_factor alone")):
                fits = room & load_room
                if fits:
                    assert chosen in fits, (
                        f"cache bound: cold key {key} placed on {chosen!r}, while {sorted(fits)} had {what} "
                        f"(cache_factor {claims.cache_factor}, cache_fill {claims.cache_fill}) and room for a "
                        f"request; expected one of them (cache room: {sorted(both)}, under cache_factor alone: "
                        f"{sorted(factor_only)}, load room: {sorted(load_room)})"
                    )
                    return
