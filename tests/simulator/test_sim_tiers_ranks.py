"""The engine model's CPU tier and data-parallel ranks: offload on eviction, reload cost, the ranks' balancer."""

from __future__ import annotations

import random

import pytest

from kvroute.plugins import PluginManager
from kvroute_simulator.driver import SimulationConfig, simulate
from kvroute_simulator.engine import (
    CostModel,
    DataParallelEngine,
    Engine,
    EngineConfig,
    EngineRequest,
    StoredRun,
    make_engine,
)
from kvroute_simulator.kv_cache import HostTier
from kvroute_simulator.tokens import TokenSeq
from kvroute_simulator.workloads import LongPrefix


def _request(tag: int, tokens: int = 65, output: int = 1) -> EngineRequest:
    return EngineRequest(f"r{tag}-{tokens}", TokenSeq.of(range(tag * 1000, tag * 1000 + tokens)), output)


def _run(engine: Engine | DataParallelEngine) -> None:
    while (t := engine.next_event_time()) is not None:
        engine.step(t)


class _Recorder:
    """A KV event listener that keeps every event in order."""

    def __init__(self) -> None:
        self.events: list[tuple[str, str, tuple[int, ...]]] = []

    def blocks_stored(self, engine: Engine, run: StoredRun, now: float) -> None:
        self.events.append(("stored", "GPU", run.hashes))

    def blocks_removed(self, engine: Engine, hashes: list[int], medium: str, now: float) -> None:
        self.events.append(("removed", medium, tuple(hashes)))

    def blocks_offloaded(self, engine: Engine, hashes: list[int], now: float) -> None:
        self.events.append(("stored", "CPU", tuple(hashes)))


def _serve(engine: Engine, request: EngineRequest, now: float) -> float:
    """Submit ``request`` to an idle ``engine`` at ``now``, run it to the end; return its TTFT."""
    seq = engine.submit(request, now)
    _run(engine)
    assert seq.ttft is not None
    return seq.ttft


class TestHostTier:
    def test_lru_capacity_and_exclusive_moves(self) -> None:
        """Offloaded blocks queue in LRU order up to capacity; a take moves them out; a discard drops them."""
        tier = HostTier(3)
        assert tier.offload([1, 2]) == ([1, 2], [])
        assert tier.offload([3, 4]) == ([3, 4], [1])
        assert tier.match([2, 3, 9, 4]) == 2
        tier.take([2, 3])
        assert len(tier) == 1 and 4 in tier
        assert tier.discard([4, 5]) == [4] and len(tier) == 0

    def test_more_than_capacity_keeps_the_newest(self) -> None:
        """Offloading more blocks than fit keeps the most recent ones and reports no store of the others."""
        tier = HostTier(2)
        assert tier.offload([1, 2, 3]) == ([2, 3], [])

    def test_needs_a_block(self) -> None:
        """A CPU tier of no block is refused (the engine has none instead)."""
        with pytest.raises(ValueError, match="at least one block"):
            HostTier(0)


class TestCpuTier:
    CONFIG = EngineConfig(capacity_blocks=8, cpu_capacity_blocks=64, max_model_len=4096)

    def test_evicted_blocks_move_to_cpu_and_hit_there(self) -> None:
        """GPU evictions are offloaded (GPU removed, then CPU stored); the prompt asked again hits the CPU tier."""
        recorder = _Recorder()
        engine = Engine(self.CONFIG, listener=recorder)
        now = 0.0
        for tag in range(4):
            _serve(engine, _request(tag), now)
            now += 10.0
        head = engine._scheduler.waiting  # nothing left waiting
        assert not head
        first = _request(0).block_hashes(16)[0]
        assert not engine.is_cached(first) and engine.is_cpu_cached(first)
        kinds = [(kind, medium) for kind, medium, hashes in recorder.events if first in hashes]
        assert kinds[:3] == [("stored", "GPU"), ("removed", "GPU"), ("stored", "CPU")]
        _serve(engine, _request(0), now)
        assert engine.stats.cpu_hit_tokens == 64 and engine.stats.gpu_hit_tokens == 0
        assert engine.stats.reload_time == pytest.approx(CostModel().reload_ms(64) / 1000)
        kinds = [(kind, medium) for kind, medium, hashes in recorder.events if first in hashes]
        assert kinds[3:] == [("removed", "CPU"), ("stored", "GPU")]
        assert engine.is_cached(first) and not engine.is_cpu_cached(first)
        assert engine.audit() == []

    def test_cpu_hit_costs_reload_not_recompute(self) -> None:
        """A CPU hit's TTFT lies between a GPU hit's and a cold prefill's, and grows as the bandwidth shrinks."""
        long = 4000

        def ttft_after_eviction(cost: CostModel) -> tuple[float, int]:
            engine = Engine(EngineConfig(capacity_blocks=300, cpu_capacity_blocks=2000), cost)
            _serve(engine, _request(0, long), 0.0)
            _serve(engine, _request(1, long), 10.0)  # pushes most of request 0 out of the GPU
            return _serve(engine, _request(0, long), 20.0), engine.stats.cpu_hit_tokens

        cold = _serve(Engine(EngineConfig(capacity_blocks=300)), _request(0, long), 0.0)
        gpu = Engine(EngineConfig(capacity_blocks=600))
        _serve(gpu, _request(0, long), 0.0)
        gpu_hit = _serve(gpu, _request(0, long), 10.0)
        slow_cost = CostModel(cpu_reload_gb_per_s=1.0)
        fast, reloaded = ttft_after_eviction(CostModel())
        slow, _ = ttft_after_eviction(slow_cost)
        assert reloaded > long // 2
        assert gpu_hit < fast < cold
        assert slow - fast == pytest.approx((slow_cost.reload_ms(reloaded) - CostModel().reload_ms(reloaded)) / 1000)

    def test_block_computed_again_leaves_the_cpu_tier(self) -> None:
        """A CPU-held block the lookup may not reuse (the prompt's last) is computed again and leaves the CPU tier."""
        recorder = _Recorder()
        engine = Engine(self.CONFIG, listener=recorder)
        for tag in range(4):
            _serve(engine, _request(tag, 64), tag * 10.0)
        last = _request(0, 64).block_hashes(16)[3]
        assert engine.is_cpu_cached(last)
        _serve(engine, _request(0, 64), 50.0)
        assert engine.stats.cpu_hit_tokens == 48  # at most prompt - 1 tokens are reused: 3 of the 4 blocks
        assert engine.is_cached(last) and not engine.is_cpu_cached(last)
        assert ("removed", "CPU", (last,)) in recorder.events
        assert engine.audit() == []

    def test_random_traffic_keeps_the_tiers_consistent(self) -> None:
        """Under seeded random traffic sharing prefixes, the tiers stay exclusive and within capacity, and hit more."""
        rng = random.Random(7)
        prefixes = [list(range(p * 10_000, p * 10_000 + rng.randint(20, 200))) for p in range(12)]
        requests = []
        for i in range(150):
            tail = [5_000_000 + i * 1000 + j for j in range(rng.randint(1, 60))]
            tokens = prefixes[rng.randrange(len(prefixes))] + tail
            requests.append((rng.uniform(0, 20), EngineRequest(f"q{i}", TokenSeq.of(tokens), rng.randint(1, 20))))
        requests.sort(key=lambda r: r[0])

        def run(config: EngineConfig) -> Engine:
            engine = Engine(config, listener=_Recorder())
            pending = list(requests)
            while pending or engine.next_event_time() is not None:
                t = engine.next_event_time()
                if pending and (t is None or pending[0][0] <= t):
                    at, request = pending.pop(0)
                    engine.submit(request, at)
                else:
                    assert t is not None
                    engine.step(t)
                assert engine.audit() == []
            return engine

        tiered = run(EngineConfig(capacity_blocks=40, cpu_capacity_blocks=60, max_model_len=400))
        alone = run(EngineConfig(capacity_blocks=40, max_model_len=400))
        assert tiered.stats.finished == alone.stats.finished == 150
        assert tiered.stats.cpu_hit_tokens > 0 and tiered.stats.cpu_evicted_blocks > 0
        assert tiered.stats.hit_tokens > alone.stats.hit_tokens

    def test_without_a_tier_evictions_are_gone(self) -> None:
        """With no CPU tier (the default) evicted blocks are gone and nothing is offloaded."""
        engine = Engine(EngineConfig(capacity_blocks=8, max_model_len=4096))
        for tag in range(4):
            _serve(engine, _request(tag), tag * 10.0)
        _serve(engine, _request(0), 50.0)
        assert engine.stats.offloaded_blocks == 0 and engine.stats.hit_tokens == 0 and engine.cpu_cached_blocks == 0


class TestDataParallelEngine:
    CONFIG = EngineConfig(capacity_blocks=512, data_parallel_size=2)

    def test_balancer_spreads_by_load(self) -> None:
        """Without a rank, requests arriving together alternate between the ranks (lowest 4 x waiting + running)."""
        engine = DataParallelEngine(self.CONFIG)
        for i in range(4):
            engine.submit(_request(i), 0.0)
        assert engine.balanced == [2, 2] and [e.num_waiting for e in engine.ranks] == [2, 2]
        _run(engine)
        assert engine.stats.finished == 4 and engine.audit() == []

    def test_named_rank_and_separate_caches(self) -> None:
        """A named rank takes the request; the same prompt on the other rank misses (each rank has its own cache)."""
        engine = make_engine(self.CONFIG)
        assert isinstance(engine, DataParallelEngine)
        engine.submit(_request(0), 0.0, rank=1)
        _run(engine)
        engine.submit(_request(0), 10.0, rank=1)
        engine.submit(_request(0), 10.0, rank=0)
        _run(engine)
        assert engine.routed == [1, 2] and engine.balanced == [0, 0]
        assert [e.stats.hit_tokens for e in engine.ranks] == [0, 64]
        assert engine.stats.hit_tokens == 64 and engine.stats.prompt_tokens == 3 * 65

    def test_rank_out_of_range(self) -> None:
        """A rank outside 0..size-1 is refused with vLLM's message, on a DP engine and on a plain one."""
        with pytest.raises(ValueError, match=r"data_parallel_rank 2 is out of range \[0, 2\)\."):
            DataParallelEngine(self.CONFIG).submit(_request(0), 0.0, rank=2)
        with pytest.raises(ValueError, match=r"data_parallel_rank 1 is out of range \[0, 1\)\."):
            Engine(EngineConfig()).submit(_request(0), 0.0, rank=1)

    def test_simulated_fleet_of_dp_instances(self) -> None:
        """A simulated fleet of 2-rank instances serves a seeded workload, every rank taking a share."""
        arrivals = list(LongPrefix(groups=6, prefix_tokens=1000, requests=120, rate=40.0, seed=3).arrivals())
        config = SimulationConfig(instances=2, engine=EngineConfig(data_parallel_size=2), seed=3)
        run = simulate(arrivals, "random", config=config, plugins=PluginManager())
        assert run.completed == 120
        single = simulate(arrivals, "random", config=SimulationConfig(instances=2, seed=3), plugins=PluginManager())
        # Same routing over the instances; the ranks' separate caches lose hits a single cache would keep.
        assert [i.requests for i in run.instances] == [i.requests for i in single.instances]
        assert run.hit_rate < single.hit_rate
