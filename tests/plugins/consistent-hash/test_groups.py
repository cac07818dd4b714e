"""HotGroups: which group keys carry more than one backend's share of the recent requests."""

from __future__ import annotations

import random
from collections import Counter

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule
from kvroute_consistent_hash.groups import MIN_EVIDENCE, HotGroups


class TestHotGroups:
    def test_a_group_over_one_backends_share_turns_hot(self) -> None:
        """A group with more than 1/members of the window turns hot once it has MIN_EVIDENCE requests."""
        groups = HotGroups(window=100)
        for i in range(MIN_EVIDENCE - 1):
            groups.observe(1, members=7)
            groups.observe(1000 + i, members=7)
        assert not groups.is_hot(1)
        groups.observe(1, members=7)
        assert groups.is_hot(1) and groups.hot == {1}

    def test_uniform_groups_never_turn_hot(self) -> None:
        """24 groups drawn uniformly over a fleet of 7 stay cold through 5,000 requests."""
        groups, rng = HotGroups(), random.Random(1)
        for _ in range(5000):
            groups.observe(rng.randrange(24), members=7)
            assert not groups.hot

    def test_one_backend_has_no_hot_group(self) -> None:
        """On a single backend nothing is gained by spreading: no group turns hot."""
        groups = HotGroups()
        for _ in range(100):
            groups.observe(1, members=1)
        assert not groups.hot

    def test_hot_stays_hot_until_under_half_the_share(self) -> None:
        """A hot group turns cold only when its share falls below 1/(2 x members) (hysteresis)."""
        groups = HotGroups(window=100)
        for _ in range(100):
            groups.observe(1, members=4)
        for i in range(77):  # 23 of 100 left: under 1/4, over 1/8
            groups.observe(2000 + i, members=4)
        assert groups.is_hot(1)
        for i in range(11):  # 12 of 100 left: under 1/8
            groups.observe(3000 + i, members=4)
        assert not groups.is_hot(1)

    def test_bad_window(self) -> None:
        """A window under 1 is a ValueError saying what was got."""
        with pytest.raises(ValueError, match=r"'window' must be a positive integer \(got 0\)"):
            HotGroups(window=0)


class HotGroupsModel(RuleBasedStateMachine):
    """HotGroups against a plain list of the last ``window`` groups and the rule applied from scratch."""

    window = 40

    def __init__(self) -> None:
        super().__init__()
        self.groups = HotGroups(window=self.window)
        self.recent: list[int] = []
        self.hot: set[int] = set()

    def _judge(self, group: int, members: int) -> None:
        count, seen = self.recent.count(group), len(self.recent)
        if group in self.hot and (not count or count / seen < 1 / (2 * members)):
            self.hot.discard(group)
        elif group not in self.hot and members > 1 and count >= MIN_EVIDENCE and count / seen > 1 / members:
            self.hot.add(group)

    @rule(group=st.integers(0, 2), members=st.integers(1, 4))
    def observe(self, group: int, members: int) -> None:
        self.groups.observe(group, members)
        if len(self.recent) == self.window:
            self._judge(self.recent.pop(0), members)
        self.recent.append(group)
        self._judge(group, members)

    @invariant()
    def same_hot_groups(self) -> None:
        """The hot set is the model's, and only groups still in the window are hot."""
        assert self.groups.hot == self.hot
        assert self.hot <= set(Counter(self.recent))


TestHotGroupsModel = HotGroupsModel.TestCase
TestHotGroupsModel.settings = settings(max_examples=60, stateful_step_count=120, derandomize=True, deadline=None)
