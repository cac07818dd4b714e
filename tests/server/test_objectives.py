"""Reading objectives from headers over the configured defaults (`kvroute_server.proxy.objectives`)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvroute.slo import Objectives, Priority
from kvroute_server.config import MAX_OBJECTIVE_MS, SloConfig
from kvroute_server.proxy.objectives import OBJECTIVE_HEADERS, IgnoredObjective, ObjectiveReader

READER = ObjectiveReader()


def read(reader: ObjectiveReader = READER, model: str = "m", **headers: str) -> tuple[Objectives | None, list[str]]:
    ignored: list[IgnoredObjective] = []
    pairs = [(name.replace("_", "-").encode(), value.encode()) for name, value in headers.items()]
    return reader.read(pairs, model, ignored), [str(reason) for reason in ignored]


class TestObjectiveReader:
    """Headers in milliseconds become `Objectives` in seconds; anything else is ignored with its reason."""

    def test_no_headers_no_defaults_is_none(self) -> None:
        """A request without objective headers and without configured defaults has no objectives."""
        assert read(x_other="1") == (None, [])

    def test_kvroute_and_llm_d_names(self) -> None:
        """Both spellings are read; kvroute's wins when both are sent."""
        assert read(x_slo_ttft_ms="500", x_slo_tpot_ms="50.5")[0] == Objectives(0.5, 0.0505)
        assert read(x_llm_d_slo_ttft_ms="300", x_llm_d_slo_tpot_ms="40")[0] == Objectives(0.3, 0.04)
        assert read(x_llm_d_slo_ttft_ms="300", x_slo_ttft_ms="200")[0] == Objectives(0.2)

    def test_priority_alone(self) -> None:
        """A priority class without latency objectives is kept (it has no objective to judge by)."""
        objectives, _ = read(x_priority="Critical")
        assert objectives == Objectives(priority=Priority.CRITICAL) and not objectives.any

    @pytest.mark.parametrize(
        ("value", "reason"),
        [
            ("fast", "not_a_number"),
            ("500ms", "not_a_number"),
            ("nan", "not_a_number"),
            ("inf", "not_a_number"),
            ("", "not_a_number"),
            ("0", "not_positive"),
            ("-20", "not_positive"),
            (str(MAX_OBJECTIVE_MS + 1), "too_large"),
        ],
    )
    def test_bad_values_are_ignored_with_a_reason(self, value: str, reason: str) -> None:
        """A value that is no objective is ignored, its reason reported, and the default stands."""
        reader = ObjectiveReader(SloConfig(ttft_ms=700))
        objectives, ignored = read(reader, x_slo_ttft_ms=value)
        assert objectives == Objectives(0.7) and ignored == [reason]

    def test_repeated_header_is_ignored(self) -> None:
        """The same header twice: which one was meant is unknown, so neither is used."""
        ignored: list[IgnoredObjective] = []
        pairs = [(b"x-slo-ttft-ms", b"100"), (b"x-slo-ttft-ms", b"200")]
        assert READER.read(pairs, "m", ignored) is None
        assert ignored == [IgnoredObjective.REPEATED]

    def test_unknown_priority(self) -> None:
        """A priority that is no class is ignored; the configured class stands."""
        reader = ObjectiveReader(SloConfig(priority="sheddable", ttft_ms=100))
        objectives, ignored = read(reader, x_priority="urgent")
        assert objectives == Objectives(0.1, priority=Priority.SHEDDABLE) and ignored == ["unknown_priority"]

    def test_model_table_over_global_defaults(self) -> None:
        """A model's table overrides the global defaults key by key; headers override both."""
        config = SloConfig(ttft_ms=1000, tpot_ms=100, models={"big": {"ttft_ms": 3000, "priority": "critical"}})
        reader = ObjectiveReader(config)
        assert read(reader, model="small")[0] == Objectives(1.0, 0.1)
        assert read(reader, model="big")[0] == Objectives(3.0, 0.1, Priority.CRITICAL)
        assert read(reader, model="big", x_slo_tpot_ms="20")[0] == Objectives(3.0, 0.02, Priority.CRITICAL)

    @given(
        st.lists(
            st.tuples(
                st.sampled_from([*OBJECTIVE_HEADERS, b"x-other", b"x-slo-ttft"]),
                st.binary(max_size=80) | st.text(max_size=20).map(str.encode),
            ),
            max_size=8,
        )
    )
    def test_any_header_bytes_give_valid_objectives_or_reasons(self, headers: list[tuple[bytes, bytes]]) -> None:
        """Whatever the header bytes, reading never raises and any objective it keeps is in (0, 1 h]."""
        ignored: list[IgnoredObjective] = []
        objectives = READER.read(headers, "m", ignored)
        if objectives is not None:
            for value in (objectives.ttft_s, objectives.tpot_s):
                assert value is None or 0 < value <= MAX_OBJECTIVE_MS / 1000
        assert all(isinstance(reason, IgnoredObjective) for reason in ignored)
