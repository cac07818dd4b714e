"""Router-replica sync through real proxies on loopback: shared holds keep a conversation on one engine."""

from __future__ import annotations

import json
import socket
import time
from typing import Any

import pytest

from kvroute_server import ProxyApp, ServerConfig, ServerThread
from kvroute_server.config import BackendConfig, HealthConfig, PeerConfig
from kvroute_server.ops.peers import PATH
from tests.server.harness import PROXY_HTTP, Servers, http
from tests.server.test_sessions import send, turn_body

TOKEN = "peer-token-0123456789"
AUTH = {"authorization": f"Bearer {TOKEN}"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def replicas(
    servers: Servers, engines: list[Any], count: int, *, sync: bool, peers: list[str] | None = None
) -> list[Any]:
    """``count`` proxies over ``engines`` (backend ids e0, e1...), each given every replica's URL (itself too)."""
    ports = [free_port() for _ in range(count)]
    urls = peers if peers is not None else [f"http://127.0.0.1:{p}" for p in ports]
    started = []
    for port in ports:
        config = ServerConfig(
            backends=tuple(BackendConfig(id=f"e{i}", url=e.url) for i, e in enumerate(engines)),
            health=HealthConfig(interval=0.2, timeout=1.0, unhealthy_threshold=2, healthy_threshold=1),
            access_log=False,
            peers=PeerConfig(urls=tuple(urls), token=TOKEN, interval=0.01) if sync else PeerConfig(),
        )
        server = ServerThread(ProxyApp(config), port=port, http=PROXY_HTTP).start()
        servers.started.append(server)
        started.append(server)
    return started


def metric(proxy: Any, name: str) -> float:
    """The sum of a metric's samples in the proxy's exposition."""
    _, _, raw = http("GET", proxy.url + "/metrics")
    total = 0.0
    for line in raw.decode().splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


def settle(proxies: list[Any], sent_before: float) -> None:
    """Wait (bounded) until the proxies' peers answered every hold sent so far (the sync is asynchronous)."""
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        if sum(metric(p, "kvroute_peer_holds_received_total") for p in proxies) > sent_before:
            return
        time.sleep(0.02)
    raise AssertionError("peers received no holds within 5 s")


def conversation_homes(proxies: list[Any], sync: bool, conversations: int = 12, turns: int = 4) -> dict[str, set[str]]:
    """Send each conversation's turns to the replicas in turn (turn t to replica t mod N); the engines each used."""
    homes: dict[str, set[str]] = {}
    received = 0.0
    for turn in range(1, turns + 1):
        for c in range(conversations):
            name = f"conv-{c}"
            proxy = proxies[(turn + c) % len(proxies)]
            homes.setdefault(name, set()).add(send(proxy, turn_body(turn, name)))
        if sync:
            settle(proxies, received)
            received = sum(metric(p, "kvroute_peer_holds_received_total") for p in proxies)
    return homes


class TestPeerSync:
    def test_a_conversation_alternating_replicas_stays_on_one_engine_with_sync(self, servers: Servers) -> None:
        """With sync, every conversation whose turns alternate between two replicas keeps one engine."""
        engines = servers.emulators(4)
        homes = conversation_homes(replicas(servers, engines, 2, sync=True), sync=True)
        assert all(len(used) == 1 for used in homes.values()), homes

    def test_without_sync_alternating_replicas_split_conversations(self, servers: Servers) -> None:
        """Without sync the same traffic splits some conversations between engines (what sync fixes)."""
        engines = servers.emulators(4)
        homes = conversation_homes(replicas(servers, engines, 2, sync=False), sync=False)
        assert any(len(used) > 1 for used in homes.values()), homes

    def test_a_session_placed_by_one_replica_is_followed_by_the_other(self, servers: Servers) -> None:
        """A session id's binding made by replica A is adopted by B, and its status page counts it."""
        engines = servers.emulators(4)
        a, b = replicas(servers, engines, 2, sync=True)
        for s in range(8):
            name = f"sess-{s}"
            before = metric(b, "kvroute_peer_holds_received_total")
            first = send(a, turn_body(1, name), **{"x-session-id": name})
            settle([b], before)
            assert send(b, turn_body(2, name), **{"x-session-id": name}) == first
        _, _, raw = http("GET", b.url + "/status.json")
        peers = json.loads(raw)["peers"]
        assert peers["received"] >= 8 and peers["adopted"].get("new", 0) >= 8, peers

    def test_itself_in_the_peer_list_is_recognised(self, servers: Servers) -> None:
        """A replica whose peer list names itself stops sending there and reports that peer as itself (-1)."""
        engines = servers.emulators(2)
        (a,) = replicas(servers, engines, 1, sync=True)
        send(a, turn_body(1, "x"))
        deadline = time.monotonic() + 5
        while metric(a, "kvroute_peer_up") != -1 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert metric(a, "kvroute_peer_up") == -1
        assert metric(a, "kvroute_peer_holds_adopted_total") == 0

    def test_a_peer_down_is_counted_and_requests_still_succeed(self, servers: Servers) -> None:
        """Holds for a peer nobody listens on are dropped as peer_down; every request still gets its answer."""
        engines = servers.emulators(2)
        (a,) = replicas(servers, engines, 1, sync=True, peers=[f"http://127.0.0.1:{free_port()}"])
        before = json.loads(http("GET", a.url + "/status.json")[2])["peers"]["peers"]
        assert [peer["state"] for peer in before] == ["unknown"]  # nothing sent yet: not known to be down
        for c in range(6):
            send(a, turn_body(1, f"c{c}"))
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            _, _, raw = http("GET", a.url + "/metrics")
            if 'reason="peer_down"' in raw.decode():
                break
            time.sleep(0.02)
        text = raw.decode()
        assert "kvroute_peer_holds_dropped_total{peer=" in text and 'reason="peer_down"' in text
        assert metric(a, "kvroute_peer_up") == 0
        status = json.loads(http("GET", a.url + "/status.json")[2])
        assert status["peers"]["dropped"].get("peer_down", 0) >= 1


class TestSyncEndpointBadInput:
    @pytest.fixture
    def proxy(self, servers: Servers) -> Any:
        return replicas(servers, servers.emulators(1), 1, sync=True, peers=[f"http://127.0.0.1:{free_port()}"])[0]

    def post(
        self, proxy: Any, body: Any = None, raw: bytes | None = None, **headers: str
    ) -> tuple[int, dict[str, Any]]:
        status, _, answer = http("POST", proxy.url + PATH, body, raw=raw, headers=headers)
        return status, json.loads(answer)

    def test_no_token_is_401_and_a_wrong_one_403(self, proxy: Any) -> None:
        """Holds without the peer token are refused (401), with a wrong one too (403), in OpenAI's error shape."""
        body = {"from": "x", "holds": []}
        status, answer = self.post(proxy, body)
        assert status == 401 and answer["error"]["code"] == "invalid_peer_token"
        status, answer = self.post(proxy, body, authorization="Bearer wrong-token-000000000")
        assert status == 403 and answer["error"]["code"] == "invalid_peer_token"

    @pytest.mark.parametrize(
        ("raw", "param"),
        [
            (b"not json", None),
            (b"[]", None),
            (b'{"holds": []}', "from"),
            (b'{"from": "x", "holds": 3}', "holds"),
            (b'{"from": "x", "holds": [[1, 2]]}', "holds[0]"),
            (b'{"from": "x", "holds": [["door", "00000000000000ff", "e0", 0]]}', "holds[0]"),
            (b'{"from": "x", "holds": [["key", "ff", "e0", 0]]}', "holds[0]"),
            (b'{"from": "x", "holds": [["key", "00000000000000ff", 7, 0]]}', "holds[0]"),
            (b'{"from": "x", "holds": [["key", "00000000000000ff", "e0", -1]]}', "holds[0]"),
            (b'{"from": "x", "holds": [["key", "00000000000000ff", "e0", true]]}', "holds[0]"),
        ],
    )
    def test_malformed_bodies_are_400(self, proxy: Any, raw: bytes, param: str | None) -> None:
        """A body that is not a sync batch gets a 400 naming the field, never a 500."""
        status, answer = self.post(proxy, raw=raw, **AUTH)
        assert status == 400, answer
        assert answer["error"]["param"] == param

    def test_an_oversize_body_is_413(self, proxy: Any) -> None:
        """A sync body over 1 MiB is refused with 413."""
        status, answer = self.post(proxy, raw=b'{"from": "' + b"x" * (2 << 20) + b'"}', **AUTH)
        assert status == 413 and answer["error"]["code"] == "request_too_large"

    def test_unknown_backends_are_counted_not_adopted(self, proxy: Any) -> None:
        """A hold naming a backend this replica does not have is counted as unknown_backend."""
        body = {"from": "x", "holds": [["conversation", "00000000000000ff", "nope", 0.1], ["key", "0f" * 8, "e0", 0]]}
        status, answer = self.post(proxy, body, **AUTH)
        assert status == 200
        assert answer["adopted"]["unknown_backend"] == 1 and answer["adopted"]["strategy_adopted"] == 1

    def test_without_peers_there_is_no_sync_route(self, servers: Servers) -> None:
        """A proxy without peers has no sync endpoint (404)."""
        proxy = servers.proxy(servers.emulators(1), strategy="bounded-load")
        status, _, _ = http("POST", proxy.url + PATH, {"from": "x", "holds": []}, headers=AUTH)
        assert status == 404
