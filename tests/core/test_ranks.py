"""Data-parallel ranks in the core: the backend's size, the decision's rank, and the stable rank per key."""

from __future__ import annotations

import pytest

from kvroute import Backend, BackendState, Decision, EngineLoad
from kvroute.backend import RankLoad
from kvroute.ranks import choose_rank, rank_for, rank_order


def state(size: int = 1, load: EngineLoad | None = None) -> BackendState:
    return BackendState(Backend("b", data_parallel_size=size), load=load)


class TestBackendRanks:
    def test_configured_and_reported_size(self) -> None:
        """The size is the configured one, or the engine's when it reports more."""
        assert state().data_parallel_size == 1
        assert state(2).data_parallel_size == 2
        assert state(2, EngineLoad(data_parallel_size=4)).data_parallel_size == 4

    @pytest.mark.parametrize("size", [0, -1, 1 << 17, "2"])
    def test_bad_size_refused(self, size: object) -> None:
        """A size that is not an integer from 1 to 65536 is a ValueError naming what was expected."""
        with pytest.raises(ValueError, match="'data_parallel_size' must be an integer from 1 to 65536"):
            Backend("b", data_parallel_size=size)  # type: ignore[arg-type]


class TestRankFor:
    def test_no_rank_without_data_parallelism(self) -> None:
        """A one-rank backend never gets a rank, whatever the key."""
        assert rank_for(Decision(Backend("b"), key=123), state()) is None

    def test_keyless_decision_leaves_it_to_the_engine(self) -> None:
        """A decision without a key names no rank (the engine's balancer places it)."""
        assert rank_for(Decision(Backend("b")), state(4)) is None

    def test_same_key_same_rank_and_keys_spread(self) -> None:
        """A key always reaches the same rank, and many keys use every rank."""
        s = state(4)
        ranks = [rank_for(Decision(s.backend, key=k), s) for k in range(200)]
        assert ranks == [rank_for(Decision(s.backend, key=k), s) for k in range(200)]
        assert set(ranks) == {0, 1, 2, 3}
        assert ranks[0] == rank_order(0, 4)[0]

    def test_decision_rank_wins_within_size(self) -> None:
        """The decision's own rank is used when the backend has it, dropped when it does not."""
        s = state(2)
        assert rank_for(Decision(s.backend, key=1, data_parallel_rank=1), s) == 1
        assert rank_for(Decision(s.backend, key=1, data_parallel_rank=5), s) is None

    def test_overloaded_rank_passed_over(self) -> None:
        """A key's first rank is skipped while its reported load is over the bound, for the next in order."""
        order = rank_order(42, 3)
        loads = tuple(RankLoad(r, running=30 if r == order[0] else 1) for r in range(3))
        s = state(3, EngineLoad(ranks=loads))
        assert choose_rank(s, order) == order[1]
        assert choose_rank(state(3), order) == order[0]


class TestExplain:
    def test_rank_in_explain(self) -> None:
        """explain() names the rank when the decision has one."""
        d = Decision(Backend("b2"), reason="prefix", strategy="tp", data_parallel_rank=1)
        assert d.explain() == "tp -> b2 rank 1 (prefix)"
        assert Decision(Backend("b2"), reason="hash", strategy="ch").explain() == "ch -> b2 (hash)"
