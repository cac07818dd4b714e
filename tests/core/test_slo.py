"""The latency-objective value types shared by the host, the router and the strategies."""

from __future__ import annotations

import pytest

from kvroute import Objectives, Prediction, Priority


class TestObjectives:
    def test_rejects_non_positive(self) -> None:
        """An objective of zero or less seconds is refused with the value named."""
        with pytest.raises(ValueError, match=r"'ttft_s' must be a positive .* \(got 0\)"):
            Objectives(ttft_s=0)
        with pytest.raises(ValueError, match=r"'tpot_s'.*\(got -1\.0\)"):
            Objectives(tpot_s=-1.0)

    def test_priority_from_text(self) -> None:
        """A priority given as text becomes the enum; an unknown one is refused."""
        assert Objectives(priority="critical").priority is Priority.CRITICAL  # type: ignore[arg-type]
        with pytest.raises(ValueError):
            Objectives(priority="urgent")  # type: ignore[arg-type]

    def test_any(self) -> None:
        """``any`` is true only when a latency objective is set, not for a priority alone."""
        assert not Objectives(priority=Priority.CRITICAL).any
        assert Objectives(tpot_s=0.05).any


class TestPrediction:
    def test_meets(self) -> None:
        """A prediction meets objectives only when every set objective is met; no objectives gives None."""
        fast = Prediction(ttft_s=0.2, tpot_s=0.03)
        assert fast.meets(None) is None
        assert fast.meets(Objectives()) is None
        assert fast.meets(Objectives(ttft_s=0.5, tpot_s=0.05)) is True
        assert fast.meets(Objectives(ttft_s=0.1)) is False
        assert fast.meets(Objectives(tpot_s=0.02)) is False
        assert Prediction(ttft_s=0.2).meets(Objectives(tpot_s=0.02)) is True
