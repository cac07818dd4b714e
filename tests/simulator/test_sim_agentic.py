"""Agent traffic in the simulator: the hash strategies keep sessions together and spread them over the fleet.

A small seeded ``agentic`` run (a 2,000-token preamble, about 14,000 characters, shared by every
session; 5-8 turns; tool results of 200-2,000 tokens) on 7 instances, loaded enough that
bounded-load's bound applies. Before the conversation key, the message-boundary key of every
request was the preamble's first 4,096 characters: one instance took every session until the
bound spilled them, and spills cost the sessions their history.
"""

from __future__ import annotations

import functools

from kvroute_simulator.driver import Comparison, SimulationConfig, compare, simulate
from kvroute_simulator.workloads import make_workload

INSTANCES = 7
OPTIONS = {
    "requests": 1200,
    "rate": 8.0,
    "turns": (5, 8),
    "preamble_tokens": 2000,
    "tool_tokens": (200, 2000),
    "seed": 0,
}


@functools.cache
def run() -> Comparison:
    arrivals = list(make_workload("agentic", **OPTIONS).arrivals())
    return compare(arrivals, ["bounded-load"], SimulationConfig(instances=INSTANCES), workload="agentic")


class TestAgenticBoundedLoad:
    def test_no_instance_takes_more_than_its_load_bound(self) -> None:
        """No instance takes more than 1.25x its fair share of the requests (bounded-load's load_factor)."""
        (result,) = run().results
        assert result.share_max <= 1.25 / INSTANCES, f"busiest instance took {result.share_max:.3f}"

    def test_sessions_keep_their_history(self) -> None:
        """The hit rate is at least 90 % of the upper bound (sessions stay where their history is cached)."""
        comparison = run()
        (result,) = comparison.results
        assert result.hit_rate >= 0.9 * comparison.upper_bound_hit_rate, (
            f"hit rate {result.hit_rate:.3f} against a bound of {comparison.upper_bound_hit_rate:.3f}"
        )


class TestSimulatedSessions:
    @staticmethod
    def session_decisions(think_time: float) -> tuple[int, int]:
        """Requests sent to their session's bound backend, and all requests, of a multi-turn run with sessions."""
        workload = make_workload(
            "multi-turn",
            requests=300,
            rate=0.01,
            system_tokens=50,
            think_time=think_time,
            session_ids=True,
            mean_turns=6,
        )
        result = simulate(list(workload.arrivals()), "random", config=SimulationConfig(instances=4, sessions=True))
        return result.decisions.get("session", 0), result.completed

    def test_sessions_keep_turns_on_their_backend(self) -> None:
        """With --sessions every later turn of a conversation goes to its bound backend, even under random."""
        bound, completed = self.session_decisions(think_time=2.0)
        assert completed == 300 and bound >= 200

    def test_bindings_expire_in_simulated_time(self) -> None:
        """Sessions run on the simulated clock: with turns ~20 minutes apart (TTL 300 s), bindings have expired."""
        bound, completed = self.session_decisions(think_time=1200.0)
        assert completed == 300 and bound < 60
