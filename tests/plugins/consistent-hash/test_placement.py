"""kvroute_consistent_hash.placement: weighted rendezvous hashing over a membership snapshot."""

from __future__ import annotations

from collections import Counter

from hypothesis import given
from hypothesis import strategies as st
from kvroute_consistent_hash import CandidateView, Rendezvous, backend_seed

from kvroute import Backend, BackendState
from tests.hypothesis_strategies import backend_ids, weights

members = st.lists(st.tuples(backend_ids, weights), min_size=1, max_size=12, unique_by=lambda t: t[0]).map(
    lambda pairs: [BackendState(Backend(b, weight=w)) for b, w in pairs]
)
keys = st.integers(0, 2**64 - 1)


class TestRendezvous:
    @given(members, keys)
    def test_home_is_first_of_ranking(self, states: list[BackendState], key: int) -> None:
        """The fast home (one logarithm per weight group) is always the first of the full order."""
        placement = Rendezvous(states)
        ranking = placement.ranking(key)
        assert placement.home(key) == ranking[0]
        assert sorted(ranking) == list(range(len(states)))

    @given(members, keys)
    def test_order_does_not_depend_on_insertion_order(self, states: list[BackendState], key: int) -> None:
        """Two snapshots of the same members in different orders prefer the same backends."""
        a, b = Rendezvous(states), Rendezvous(list(reversed(states)))
        assert list(a.preference(key)) == list(b.preference(key))

    @given(members, keys, st.integers(0, 11))
    def test_removing_a_member_keeps_the_others_order(self, states: list[BackendState], key: int, drop: int) -> None:
        """Without one member, the key's order is the same order with that member left out."""
        gone = states[drop % len(states)]
        full = [s.id for s in Rendezvous(states).preference(key)]
        rest = [s.id for s in Rendezvous([s for s in states if s is not gone]).preference(key)]
        assert rest == [i for i in full if i != gone.id]

    def test_cache_never_changes_an_answer(self) -> None:
        """With and without the memo cache, homes and orders are identical."""
        states = [BackendState(Backend(f"b{i}", weight=1 + i % 3)) for i in range(9)]
        cached, plain = Rendezvous(states, cache_size=16), Rendezvous(states, cache_size=0)
        for key in range(0, 10**6, 997):
            assert cached.home(key) == plain.home(key)
            assert cached.ranking(key) == plain.ranking(key)

    def test_weighted_shares(self) -> None:
        """Over 60,000 keys, weights 1:2:3 give homes in shares within 1 point of 1/6, 2/6, 3/6."""
        states = [BackendState(Backend(n, weight=w)) for n, w in (("a", 1), ("b", 2), ("c", 3))]
        placement = Rendezvous(states)
        counts = Counter(placement.states[placement.home(k * 0x9E3779B97F4A7C15 % 2**64) or 0].id for k in range(60000))
        for name, expected in (("a", 1 / 6), ("b", 2 / 6), ("c", 3 / 6)):
            assert abs(counts[name] / 60000 - expected) < 0.01  # ~ 5 binomial standard deviations

    def test_models_restrict_the_order(self) -> None:
        """Only members serving the model appear in its order; none serving it means no home."""
        states = [
            BackendState(Backend("a", models={"m1"})),
            BackendState(Backend("b")),
            BackendState(Backend("c", models={"m2"})),
        ]
        placement = Rendezvous(states)
        assert {placement.states[i].id for i in placement.ranking(7, "m1")} == {"a", "b"}
        assert {placement.states[i].id for i in placement.ranking(7, "m2")} == {"b", "c"}
        only = Rendezvous([BackendState(Backend("x", models={"m1"}))])
        assert only.home(7, "m3") is None

    def test_backend_seed_is_pinned(self) -> None:
        """Per-backend seeds are stable across versions and processes (a change would move every key)."""
        assert f"{backend_seed('backend-0'):016x}" == "cc988efcb299a849"


class TestCandidateView:
    def test_fast_path_and_table(self) -> None:
        """Members are found among candidates whether or not some were filtered out."""
        states = [BackendState(Backend(f"b{i}")) for i in range(4)]
        placement = Rendezvous(states)
        every = CandidateView(placement, states)
        assert [every.get(i) for i in range(4)] == states and not every.foreign
        some = CandidateView(placement, [states[0], states[3]])
        assert [some.get(i) for i in range(4)] == [states[0], None, None, states[3]] and not some.foreign

    def test_foreign_candidates(self) -> None:
        """A candidate the snapshot never saw makes the view foreign; a same-id copy is recognised."""
        states = [BackendState(Backend(f"b{i}")) for i in range(3)]
        placement = Rendezvous(states)
        assert CandidateView(placement, [BackendState(Backend("new"))]).foreign
        copy = BackendState(Backend("b1"))
        view = CandidateView(placement, [copy])
        assert view.get(1) is copy and not view.foreign
