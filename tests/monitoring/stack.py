"""A monitored kvroute stack on loopback: engine emulators, `kvroute serve` over them, and a real Prometheus.

Prometheus (Debian's ``prometheus`` package) scrapes the proxy and every engine once a second and
evaluates contrib/deploy/monitoring/kvroute-rules.yml; engine targets carry the label
``backend=<kvroute backend id>``, as docs/monitoring.md asks of a deployment. Every process is
stopped by its PID.
"""

from __future__ import annotations

import json
import re
import shutil
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.replicas.processes import KVROUTE, Process, backend_tables, free_port, until

__all__ = [
    "ADMIN",
    "DASHBOARD",
    "MONITORING",
    "PEER_TOKEN",
    "RULES",
    "RULES_TEST",
    "Prometheus",
    "require",
    "serve_config",
    "start_proxy",
]

MONITORING = Path(__file__).resolve().parents[2] / "contrib" / "deploy" / "monitoring"
DASHBOARD = MONITORING / "kvroute-dashboard.json"
RULES = MONITORING / "kvroute-rules.yml"
RULES_TEST = MONITORING / "kvroute-rules.test.yml"

ADMIN = "monitoring-test-admin-token"
PEER_TOKEN = "monitoring-test-peer-token"


def require(program: str) -> str:
    """The path of ``program``; the test fails (not skips) when it is missing, naming the package to install."""
    found = shutil.which(program)
    if found is None:
        pytest.fail(
            f"{program!r} is not on PATH (expected an executable, got none): install Debian's prometheus package, "
            "which provides prometheus and promtool; the README's test command `bash tests/run` does it when run "
            "as root, or run `apt-get update && apt-get install -y --no-install-recommends prometheus`."
        )
    return found


def serve_config(
    fleet_file: Path, options: Mapping[str, Any], otlp_endpoint: str | None = None, extra: Sequence[str] = ()
) -> str:
    """A `kvroute serve` TOML file: fast probes, two shadow strategies, the fleet read from ``fleet_file`` by file
    discovery, tracing to ``otlp_endpoint`` when given (the histograms' exemplars), then the ``extra`` lines."""
    lines = [
        "[server]",
        f'admin_token = "{ADMIN}"',
        "access_log = false",
        "[routing]",
        'strategy = "bounded-load"',
        # Shadows, so that the dashboard's shadow panels have data (word units: the emulators' tokenizer).
        'shadow = ["consistent-hash", "least-outstanding"]',
        "[routing.options]",
        *(f"{k} = {json.dumps(v)}" for k, v in options.items()),
        "[routing.shadow_options.consistent-hash]",
        "prefix_length = 1024",
        "[routing.cache_view]",
        'units = "words"',
        "[health]",
        "interval = 0.2",
        "unhealthy_threshold = 1",
        "healthy_threshold = 1",
        "[[discovery]]",
        'kind = "file"',
        f"target = {json.dumps(str(fleet_file))}",
        "interval = 0.5",
    ]
    if otlp_endpoint is not None:
        lines += ["[tracing]", f"endpoint = {json.dumps(otlp_endpoint)}"]
    lines += extra
    return "\n".join(lines) + "\n"


def fleet_file(engines: Sequence[Process]) -> str:
    """The discovery file: the engines as ``vllm`` backends e0, e1, ..."""
    return "\n".join(backend_tables(engines)) + "\n"


async def start_proxy(
    client: httpx.AsyncClient,
    engines: Sequence[Process],
    directory: Path,
    options: Mapping[str, Any],
    otlp_endpoint: str | None = None,
    extra: Sequence[str] = (),
    name: str = "kvroute",
) -> Process:
    """`kvroute serve` over ``engines`` (found through a discovery file), ready once every engine is routable;
    ``extra`` TOML lines end its configuration file, ``name`` names its files in ``directory``."""
    fleet = directory / f"{name}-fleet.toml"
    fleet.write_text(fleet_file(engines))
    config = directory / f"{name}.toml"
    config.write_text(serve_config(fleet, options, otlp_endpoint, extra))
    port = free_port()
    proxy = Process(
        "kvroute-serve",
        [*KVROUTE, "serve", "--config", str(config), "--port", str(port), "--log-level", "warning"],
        port,
    )
    try:
        await proxy.ready(client, "/metrics")

        async def routable() -> bool:
            found = (await client.get(proxy.url + "/health")).json()
            return bool(found.get("routable") == len(engines))

        await until(routable)
    except BaseException:
        proxy.stop()
        raise
    return proxy


class Prometheus:
    """A Prometheus server on a loopback port scraping ``targets`` every second, with the kvroute rules loaded."""

    def __init__(self, directory: Path, proxy: Process, engines: Sequence[Process]) -> None:
        binary = require("prometheus")
        config = {
            "global": {"scrape_interval": "1s", "scrape_timeout": "900ms", "evaluation_interval": "1s"},
            "rule_files": [str(RULES)],
            "scrape_configs": [
                {"job_name": "kvroute", "static_configs": [{"targets": [f"127.0.0.1:{proxy.port}"]}]},
                {
                    "job_name": "vllm",
                    "static_configs": [
                        {"targets": [f"127.0.0.1:{engine.port}"], "labels": {"backend": f"e{i}"}}
                        for i, engine in enumerate(engines)
                    ],
                },
            ],
        }
        path = directory / "prometheus.yml"
        path.write_text(json.dumps(config, indent=2))  # JSON is YAML
        port = free_port()
        args = [
            binary,
            f"--config.file={path}",
            f"--storage.tsdb.path={directory / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--log.level=warn",
            "--enable-feature=exemplar-storage",  # the histograms' trace ids (docs/tracing.md)
        ]
        self.process = Process("prometheus", args, port)
        self.url = self.process.url

    async def ready(self, client: httpx.AsyncClient) -> None:
        await self.process.ready(client, "/-/ready")

    def stop(self) -> None:
        self.process.stop()

    async def query(self, client: httpx.AsyncClient, expr: str) -> list[dict[str, Any]]:
        """The instant vector (a scalar as one sample) ``expr`` is now; an error raises with Prometheus' message."""
        answer = await client.get(self.url + "/api/v1/query", params={"query": expr})
        found = answer.json()
        if answer.status_code != 200 or found.get("status") != "success":
            raise AssertionError(
                f"Prometheus refused {expr!r}: expected status success, got {answer.status_code} {found}"
            )
        data = found["data"]
        if data["resultType"] == "scalar":
            return [{"metric": {}, "value": data["result"]}]
        return list(data["result"])

    async def label_values(self, client: httpx.AsyncClient, label: str, selector: str) -> list[str]:
        """What Grafana's ``label_values(selector, label)`` lists."""
        answer = await client.get(self.url + f"/api/v1/label/{label}/values", params={"match[]": selector})
        found = answer.json()
        if found.get("status") != "success":
            raise AssertionError(f"Prometheus refused label values of {label!r} for {selector!r}: got {found}")
        return sorted(found["data"])

    async def targets_up(self, client: httpx.AsyncClient) -> dict[str, str]:
        """Each target's scrape URL and health."""
        found = (await client.get(self.url + "/api/v1/targets")).json()
        return {t["scrapeUrl"]: t["health"] for t in found["data"]["activeTargets"]}

    async def exemplars(self, client: httpx.AsyncClient, selector: str) -> list[dict[str, str]]:
        """The label sets of every exemplar Prometheus stored for ``selector`` in the last hour."""
        now = time.time()
        answer = await client.get(
            self.url + "/api/v1/query_exemplars", params={"query": selector, "start": now - 3600, "end": now}
        )
        found = answer.json()
        if found.get("status") != "success":
            raise AssertionError(f"Prometheus refused exemplars of {selector!r}: got {answer.status_code} {found}")
        return [e["labels"] for series in found["data"] for e in series["exemplars"]]

    async def rules(self, client: httpx.AsyncClient) -> list[dict[str, Any]]:
        """Every loaded rule with its health and last error."""
        found = (await client.get(self.url + "/api/v1/rules")).json()
        return [rule for group in found["data"]["groups"] for rule in group["rules"]]


_SAMPLE = re.compile(r"^kvroute_requests_total\{[^}]*\} ([0-9.eE+-]+)$", re.M)


async def proxy_requests(client: httpx.AsyncClient, proxy: Process) -> float:
    """Requests the proxy counted, read from its own /metrics."""
    return sum(float(v) for v in _SAMPLE.findall((await client.get(proxy.url + "/metrics")).text))
