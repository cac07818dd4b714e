"""Sessions through ``kvroute serve`` to two real vLLM servers: a session keeps its engine, which holds its history.

Three agent-like sessions (one shared ~1,900-token preamble as the system message, a task of its
own, then five more turns, each resending the whole history with the engine's previous answer and a
new user message), interleaved turn by turn, each request carrying ``x-session-id``. Asserted from
the engines' own answers and ``/metrics``:

* every session's six turns reach one engine (the proxy's ``x-kvroute-backend``), with the default
  strategy (bounded-load) and with ``random``, which without sessions sends the same turns to both
  engines (the control run, ``[sessions] enabled = false``);
* from the second turn on, each turn finds at least the previous turn's whole prompt blocks cached
  (``usage.prompt_tokens_details.cached_tokens``), and each engine's ``vllm:prefix_cache_hits_total``
  grew by exactly the cached tokens of the requests it answered;
* the proxy's ``/status.json`` counts 3 new sessions and 15 requests that stayed.

The per-run figures are written to ``$KVROUTE_E2E_SESSIONS_RESULTS`` (JSON) when it is set.
"""

from __future__ import annotations

import itertools
import json
import os
import urllib.request
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.vllm.proxy import start_proxy
from tests.e2e.vllm.servers import SERVED_MODEL_NAME, VllmServer, get_text, metric_value
from tests.e2e.vllm.test_routing_e2e import BLOCK, HITS, QUERIES, _reset_caches, _words

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(not os.environ.get("KVROUTE_VLLM_PYTHON"), reason="KVROUTE_VLLM_PYTHON is not set"),
]

SESSIONS = 3
TURNS = 6
RESULTS: dict[str, Any] = {}


def _counters(server: VllmServer) -> tuple[float, float]:
    text = get_text(server.base_url + "/metrics")
    return (
        metric_value(text, HITS, model_name=server.model),
        metric_value(text, QUERIES, model_name=server.model),
    )


def _post(url: str, body: Mapping[str, Any], headers: Mapping[str, str]) -> tuple[dict[str, Any], str]:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json", **headers}
    )
    with urllib.request.urlopen(req, timeout=120) as resp:
        return json.loads(resp.read()), str(resp.headers.get("x-kvroute-backend"))


def _run_sessions(
    servers: list[VllmServer], strategy: str, options: Mapping[str, Any], workdir: Path, *, sessions: bool
) -> dict[str, Any]:
    """Reset both caches, send the interleaved sessions through a fresh proxy; return placements, usage, deltas."""
    _reset_caches(servers)
    before = [_counters(s) for s in servers]
    preamble = "Tools and instructions. " + _words(2300, 1000) + "."
    histories = [
        [
            {"role": "system", "content": preamble},
            {"role": "user", "content": f"Task {i}: " + _words(2400 + i, 150) + "."},
        ]
        for i in range(SESSIONS)
    ]
    turns: list[list[dict[str, Any]]] = [[] for _ in range(SESSIONS)]
    label = f"{strategy}-sessions-{'on' if sessions else 'off'}"
    extra = {} if sessions else {"sessions": {"enabled": False}}
    with start_proxy([s.base_url for s in servers], strategy, options, workdir, name=label, sections=extra) as proxy:
        for turn in range(TURNS):
            for i in range(SESSIONS):
                if turn > 0:
                    histories[i].append(
                        {"role": "user", "content": f"Step {turn}: " + _words(2500 + 10 * i + turn, 40)}
                    )
                body = {
                    "model": SERVED_MODEL_NAME,
                    "messages": histories[i],
                    "max_tokens": 8,
                    "temperature": 0,
                    "ignore_eos": True,
                }
                answer, backend = _post(proxy.url + "/v1/chat/completions", body, {"x-session-id": f"agent-{i}"})
                usage = answer["usage"]
                turns[i].append(
                    {
                        "backend": backend,
                        "prompt_tokens": usage["prompt_tokens"],
                        "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"],
                    }
                )
                histories[i].append({"role": "assistant", "content": answer["choices"][0]["message"]["content"]})
        status = json.loads(get_text(proxy.url + "/status.json"))
    after = [_counters(s) for s in servers]
    result = {
        "strategy": strategy,
        "sessions": sessions,
        "turns": turns,
        "engine_hit_tokens": {f"vllm-{k}": a[0] - b[0] for k, (a, b) in enumerate(zip(after, before, strict=True))},
        "engine_query_tokens": {f"vllm-{k}": a[1] - b[1] for k, (a, b) in enumerate(zip(after, before, strict=True))},
        "status_sessions": status.get("sessions"),
    }
    RESULTS[label] = result
    if os.environ.get("KVROUTE_E2E_SESSIONS_RESULTS"):
        Path(os.environ["KVROUTE_E2E_SESSIONS_RESULTS"]).write_text(json.dumps(RESULTS, indent=2))
    return result


def _check_pinned(run: dict[str, Any]) -> None:
    """Each session stays on one engine, each later turn hits its history, and the engines' counters agree."""
    summary = json.dumps(run, indent=1)
    served: dict[str, float] = {}
    for turns in run["turns"]:
        assert len({t["backend"] for t in turns}) == 1, summary
        for previous, turn in itertools.pairwise(turns):
            # The previous prompt's full blocks were computed on this engine; the new prompt extends it.
            assert turn["cached_tokens"] >= previous["prompt_tokens"] // BLOCK * BLOCK, summary
        for turn in turns:
            served[turn["backend"]] = served.get(turn["backend"], 0) + turn["cached_tokens"]
    for engine, hits in run["engine_hit_tokens"].items():
        assert hits == served.get(engine, 0), summary
    assert run["status_sessions"]["requests"] == {
        "session/new": SESSIONS,
        "session/stayed": SESSIONS * (TURNS - 1),
    }, summary


class TestSessionsThroughProxy:
    def test_a_session_keeps_its_engine_across_six_turns(
        self, vllm_servers: list[VllmServer], tmp_path_factory: pytest.TempPathFactory
    ) -> None:
        """With sessions on, every session's six turns reach one engine, whose prefix cache serves the history."""
        workdir = tmp_path_factory.mktemp("sessions")
        control = _run_sessions(vllm_servers, "random", {"seed": 7}, workdir, sessions=False)
        default = _run_sessions(vllm_servers, "bounded-load", {}, workdir, sessions=True)
        pinned_random = _run_sessions(vllm_servers, "random", {"seed": 7}, workdir, sessions=True)
        # The control: without sessions, random sends some session's turns to both engines.
        assert any(len({t["backend"] for t in turns}) == 2 for turns in control["turns"]), json.dumps(control)
        assert control["status_sessions"] is None
        _check_pinned(default)
        _check_pinned(pinned_random)
        total = sum(t["cached_tokens"] for turns in pinned_random["turns"] for t in turns)
        assert total > sum(t["cached_tokens"] for turns in control["turns"] for t in turns), json.dumps(RESULTS)
