"""kvroute-litellm in front of `kvroute emulate` engines (vLLM-like, with prefix caching), as processes on loopback."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import httpx
import kvroute_litellm
import litellm
import pytest
from kvroute_litellm import DECISION_KEY

from tests.examples.openai_fake import eventually
from tests.replicas.processes import start_engines

pytestmark = pytest.mark.filterwarnings("ignore:Items? .* the `ReadOnly` qualifier:UserWarning")

DOCUMENT = "".join(f"Article {i}: engines keep the KV cache of prefixes they have seen. " for i in range(20))


class TestAgainstEmulatedEngines:
    @pytest.mark.anyio
    async def test_repeated_prefixes_hit_the_engine_cache(self) -> None:
        """Through LiteLLM with consistent-hash, each prefix stays on one engine, whose prefix cache then serves it."""
        async with httpx.AsyncClient(timeout=30) as client:
            engines = await start_engines(client, 3, time_scale=0.05)
        try:
            model_list = [
                {
                    "model_name": "m",
                    "litellm_params": {"model": "openai/m", "api_base": f"{e.url}/v1", "api_key": "unused"},
                    "model_info": {"id": f"e{i}"},
                }
                for i, e in enumerate(engines)
            ]
            router = litellm.Router(model_list=model_list)
            routing = kvroute_litellm.install(router, "consistent-hash", {"prefix_length": 1024})
            try:
                placed: dict[int, set[str]] = defaultdict(set)
                cached: list[int] = []
                for rnd in range(3):
                    for prefix in range(12):
                        metadata: dict[str, Any] = {}
                        messages = [
                            {"role": "system", "content": f"Source {prefix}. {DOCUMENT}"},
                            {"role": "user", "content": f"Round {rnd}: summarize."},
                        ]
                        response = await router.acompletion(
                            model="m", messages=messages, max_tokens=2, metadata=metadata
                        )
                        placed[prefix].add(metadata[DECISION_KEY].split(" -> ")[1].split(" ")[0])
                        if rnd:
                            details = response.usage.prompt_tokens_details
                            cached.append(details.cached_tokens if details else 0)
                assert all(len(engines_used) == 1 for engines_used in placed.values())
                assert {next(iter(s)) for s in placed.values()} == {"e0", "e1", "e2"}
                assert len(cached) == 24 and all(c > 0 for c in cached)
                await eventually(lambda: routing.open_leases() == 0)
            finally:
                routing.uninstall()
        finally:
            for engine in engines:
                engine.stop()
