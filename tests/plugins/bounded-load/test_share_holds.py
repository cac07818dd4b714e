"""Router-replica sync in the consistent-hash family (consistent-hash and bounded-load): `Shares.adopt` and the
strategies' `kvroute.Holds` methods. Here because this env installs both plugins."""

from __future__ import annotations

from kvroute_bounded_load import BoundedLoad
from kvroute_consistent_hash import ConsistentHash, Shares
from kvroute_consistent_hash.groups import MIN_EVIDENCE

from kvroute import Backend, Fleet, Hold, Holds, Router
from tests.helpers import chat

PREAMBLE = "You are a coding agent. " * 300


def router(strategy: ConsistentHash, members: int = 4) -> Router:
    fleet = Fleet()
    for i in range(members):
        fleet.add(Backend(f"b{i}", f"http://10.0.0.{i}:8000"))
    return Router(fleet, strategy)


class TestSharesAdopt:
    def test_adopts_only_keys_not_held_and_counts_no_request(self) -> None:
        """A peer's hold is taken for a key nobody here holds, never over this replica's own holder."""
        shares = Shares(window=100)
        shares.record("a", (1,))
        assert not shares.adopt(1, "b") and shares.holder(1) == "a"
        assert shares.adopt(2, "b") and shares.holder(2) == "b"
        assert (len(shares), shares.count("b")) == (1, 0)

    def test_bounded_like_the_table(self) -> None:
        """Adopted holds count against ``max_keys``: the least recent key goes first."""
        shares = Shares(max_keys=2)
        for key in (1, 2, 3):
            shares.adopt(key, "a")
        assert (shares.holder(1), shares.holder(3)) == (None, "a")


class TestStrategyHolds:
    def test_share_bound_strategies_take_part_and_off_makes_none(self) -> None:
        """With the share bound a started conversation makes conversation, key and group holds; off, none."""
        request = chat([{"role": "system", "content": PREAMBLE}, {"role": "user", "content": "task"}])
        on = router(BoundedLoad())
        assert isinstance(on.strategy, Holds)
        with on.route(request) as lease:
            made = on.strategy.holds_made(request, lease.decision)
        assert [h.kind for h in made] == ["conversation", "key", "group"]
        assert {h.backend_id for h in made} == {lease.backend.id}
        off = router(ConsistentHash())
        with off.route(request) as lease:
            assert off.strategy.holds_made(request, lease.decision) == []

    def test_a_later_turn_makes_no_group_hold(self) -> None:
        """Only a conversation's first turn counts as a conversation its group opened."""
        request = chat(
            [
                {"role": "system", "content": PREAMBLE},
                {"role": "user", "content": "task"},
                {"role": "assistant", "content": "done"},
                {"role": "user", "content": "more"},
            ]
        )
        r = router(BoundedLoad())
        with r.route(request) as lease:
            assert "group" not in {h.kind for h in r.strategy.holds_made(request, lease.decision)}

    def test_peers_openers_make_a_group_hot(self) -> None:
        """Conversations other replicas started count towards a hot group, as this replica's own would."""
        r = router(BoundedLoad())
        strategy = r.strategy
        assert isinstance(strategy, BoundedLoad)
        request = chat([{"role": "system", "content": PREAMBLE}, {"role": "user", "content": "task"}])
        group = strategy._group(request)[1]
        assert not strategy.hot_groups.is_hot(group)
        counts = r.adopt_holds([Hold("group", group, "b1")] * MIN_EVIDENCE)
        assert counts["strategy_groups"] == MIN_EVIDENCE
        assert strategy.hot_groups.is_hot(group)

    def test_peers_requests_count_in_the_window(self) -> None:
        """A peer's conversation hold counts one request on its backend; a key hold counts none."""
        r = router(BoundedLoad())
        strategy = r.strategy
        assert isinstance(strategy, BoundedLoad) and strategy.shares is not None
        r.adopt_holds([Hold("conversation", 5, "b2"), Hold("key", 6, "b2")])
        assert (strategy.shares.count("b2"), strategy.shares.holder(5), strategy.shares.holder(6)) == (1, "b2", "b2")
