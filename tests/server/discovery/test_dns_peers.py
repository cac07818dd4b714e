"""Three `kvroute serve` replicas find each other through a real dnsmasq (``[peers] discovery``) and share holds.

The replicas listen on 127.0.0.2, 127.0.0.3 and 127.0.0.4 (every 127.0.0.x is loopback on Linux), all on the
same port, so one A-record name with that port names them all, as a Kubernetes headless Service does for the
pods of a Deployment. A replica that joins the name becomes a peer of the others; each skips its own
address (no 409 from itself), sends its holds to the other two, and adopts theirs. Then one replica leaves
the name: the others stop sending to it. Then the name disappears and dnsmasq stops: the replicas keep the
last good peers and count the failures.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.replicas.processes import KVROUTE, Process, body, free_port, until, wait_ready
from tests.server.discovery.dnsmasq import DOMAIN, Dnsmasq
from tests.server.discovery.test_dns_fleet import common_port

pytestmark = [pytest.mark.e2e, pytest.mark.anyio]

NAME = f"routers.{DOMAIN}"
ADDRESSES = ["127.0.0.2", "127.0.0.3", "127.0.0.4"]
TOKEN = "peer-discovery-test-token"
ENGINES = 2


def config(dns: Dnsmasq, port: int, engines: list[Process]) -> str:
    lines = [
        "[server]",
        "access_log = false",
        "[health]",
        "interval = 0.5",
        "[peers]",
        f'token = "{TOKEN}"',
        "interval = 0.05",
        "[[peers.discovery]]",
        'kind = "dns"',
        f'target = "{NAME}:{port}"',
        f'nameserver = "{dns.nameserver}"',
        "min_interval = 0.2",
        "max_interval = 1.0",
    ]
    for i, engine in enumerate(engines):
        lines += ["[[backends]]", f'id = "e{i}"', f'url = "{engine.url}"']
    return "\n".join(lines) + "\n"


async def start(client: httpx.AsyncClient, path: Path, port: int) -> list[Process]:
    replicas = []
    for address in ADDRESSES:
        args = [*KVROUTE, "serve", "--config", str(path), "--host", address, "--port", str(port)]
        replica = Process(f"replica-{address}", [*args, "--log-level", "warning"], port)
        replica.url = f"http://{address}:{port}"
        replicas.append(replica)
    return await wait_ready(client, replicas, "/metrics")


async def peers(client: httpx.AsyncClient, replica: Process) -> dict[str, Any]:
    answer = await client.get(replica.url + "/status.json")
    answer.raise_for_status()
    found: dict[str, Any] = answer.json()["peers"]
    return found


def states(status: dict[str, Any]) -> dict[str, str]:
    return {p["url"]: p["state"] for p in status["peers"]}


async def metric(client: httpx.AsyncClient, replica: Process, name: str, **labels: str) -> float:
    """The sum of ``name``'s samples whose labels include ``labels``."""
    text = (await client.get(replica.url + "/metrics")).text
    total = 0.0
    for line in text.splitlines():
        match = re.match(rf"^{re.escape(name)}(?:\{{([^}}]*)\}})? (\S+)$", line)
        if match and all(f'{k}="{v}"' in (match.group(1) or "") for k, v in labels.items()):
            total += float(match.group(2))
    return total


async def test_replicas_find_each_other_by_dns(dnsmasq_factory: Callable[..., Dnsmasq], tmp_path: Path) -> None:
    """Each replica sends to the two others (itself skipped), they adopt; a replica gone from DNS is no longer
    sent to; a DNS outage keeps the last peers and is counted."""
    port = common_port(ADDRESSES)
    dns = dnsmasq_factory(ttl=1, hosts={NAME: ADDRESSES[:2]})
    urls = [f"http://{a}:{port}" for a in ADDRESSES]
    async with httpx.AsyncClient(timeout=30) as client:
        engines: list[Process] = []
        replicas: list[Process] = []
        try:
            for i in range(ENGINES):
                engine_port = free_port()
                args = [*KVROUTE, "emulate", "--port", str(engine_port), "--model", "m", "--time-scale", "0.05"]
                engines.append(Process(f"engine-{i}", args, engine_port))
            await wait_ready(client, engines)
            path = tmp_path / "kvroute.toml"
            path.write_text(config(dns, port, engines))
            replicas = await start(client, path, port)

            async def each_sees(
                expected: Callable[[Process], dict[str, str]], among: list[Process] | None = None
            ) -> None:
                async def check() -> bool:
                    return all([states(await peers(client, r)) == expected(r) for r in among or replicas])

                await until(check, within=30)

            async def chat(replica: Process, session: int) -> None:
                sent = body(session, "first turn")
                headers = {"x-session-id": f"s{session}"}
                answer = await client.post(replica.url + "/v1/chat/completions", json=sent, headers=headers)
                assert answer.status_code == 200, answer.text

            # The name lists two replicas: each sees the other and itself; the third, not listed, sees both.
            await each_sees(lambda r: {u: "self" if u == r.url else "unknown" for u in urls[:2]})
            # The third joins the name: every replica has the two others as peers, itself recognised by its address.
            await dns.set_hosts({NAME: ADDRESSES})
            await each_sees(lambda r: {u: "self" if u == r.url else "unknown" for u in urls})
            for r in replicas:
                status = await peers(client, r)
                assert {p["origin"] for p in status["peers"]} == {"discovery"}, status
                assert status["discovery"]["changes"] == {"added": 2, "self": 1}, status

            # Sessions placed by each replica reach the two others as holds, which they adopt (2 x 2 sessions each).
            for s in range(6):
                await chat(replicas[s % 3], s)

            async def adopted() -> bool:
                return all([await metric(client, r, "kvroute_peer_holds_adopted_total") >= 4 for r in replicas])

            await until(adopted, within=30)
            await each_sees(lambda r: {u: "self" if u == r.url else "up" for u in urls})
            for r in replicas:  # the listen address told each replica itself: no body was ever sent to itself
                assert await metric(client, r, "kvroute_rejected_requests_total", status="409") == 0
                assert await metric(client, r, "kvroute_peer_holds_sent_total", peer=r.url) == 0

            # 127.0.0.4 leaves the name: the other two stop sending to it.
            gone = urls[2]
            await dns.set_hosts({NAME: ADDRESSES[:2]})
            await each_sees(lambda r: {u: "self" if u == r.url else "up" for u in urls[:2]}, replicas[:2])
            before = await metric(client, replicas[0], "kvroute_peer_holds_sent_total", peer=gone)
            to_b = await metric(client, replicas[0], "kvroute_peer_holds_sent_total", peer=urls[1])
            for s in range(6, 12):
                await chat(replicas[0], s)

            async def b_got_them() -> bool:
                return await metric(client, replicas[0], "kvroute_peer_holds_sent_total", peer=urls[1]) >= to_b + 6

            await until(b_got_them, within=30)
            assert await metric(client, replicas[0], "kvroute_peer_holds_sent_total", peer=gone) == before
            assert (await peers(client, replicas[0]))["discovery"]["changes"] == {"added": 2, "removed": 1, "self": 1}

            # The name disappears (NXDOMAIN), then dnsmasq stops: the last good peers are kept, failures counted.
            await dns.set_hosts({})
            dns.stop()

            async def failing() -> bool:
                sources = [(await peers(client, r))["discovery"]["sources"] for r in replicas[:2]]
                return all(s[0]["stale"] and s[0]["failures"] >= 2 for s in sources)

            await until(failing, within=30)
            for r in replicas[:2]:
                assert states(await peers(client, r)) == {u: "self" if u == r.url else "up" for u in urls[:2]}
                assert r.popen.poll() is None, f"{r.name} stopped: {r.output()}"
        finally:
            for process in [*replicas, *engines]:
                process.stop()
