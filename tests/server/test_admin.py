"""The admin API: bearer-token protected, changes go through the fleet, no request lost under load."""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.server.harness import Servers, chat_body, http

pytestmark = pytest.mark.e2e

TOKEN = "admin-token-0123456789"
AUTH = {"authorization": f"Bearer {TOKEN}"}


def _admin(method: str, url: str, body: object = None) -> tuple[int, dict[str, object]]:
    status, _, raw = http(method, url, body, headers=AUTH)
    return status, json.loads(raw) if raw else {}


class TestAdminAccess:
    def test_off_without_token(self, servers: Servers) -> None:
        """With no admin token configured the admin routes do not exist (404)."""
        proxy = servers.proxy(servers.emulators(1))
        assert http("GET", proxy.url + "/admin/backends", headers=AUTH)[0] == 404

    @pytest.mark.parametrize("header", [None, "Bearer wrong-token-000000000", f"Basic {TOKEN}", TOKEN])
    def test_wrong_or_missing_token_is_401(self, servers: Servers, header: str | None) -> None:
        """Any credential but 'Bearer <token>' gets 401 with WWW-Authenticate."""
        proxy = servers.proxy(servers.emulators(1), admin_token=TOKEN)
        headers = {"authorization": header} if header else {}
        status, response_headers, body = http("GET", proxy.url + "/admin/backends", headers=headers)
        assert status == 401
        assert response_headers["www-authenticate"].startswith("Bearer")
        assert json.loads(body)["error"]["code"] == "invalid_admin_token"


class TestAdminChanges:
    def test_list_add_patch_remove(self, servers: Servers) -> None:
        """Backends can be listed, added, re-weighted and removed, and new ones take traffic."""
        a, b = servers.emulators(2)
        proxy = servers.proxy([a], admin_token=TOKEN)
        status, listing = _admin("GET", proxy.url + "/admin/backends")
        assert status == 200 and [x["id"] for x in listing["backends"]] == ["e0"]  # type: ignore[index]
        status, added = _admin("POST", proxy.url + "/admin/backends", {"id": "new", "url": b.url, "weight": 2})
        assert status == 201 and added["id"] == "new" and added["weight"] == 2.0
        assert _admin("PATCH", proxy.url + "/admin/backends/new", {"weight": 3})[1]["weight"] == 3.0
        assert _admin("DELETE", proxy.url + "/admin/backends/e0")[0] == 200
        assert http("POST", proxy.url + "/v1/chat/completions", chat_body("hi"))[1]["x-kvroute-backend"] == "new"
        assert _admin("GET", proxy.url + "/admin/backends/e0")[0] == 404

    @pytest.mark.parametrize(
        ("method", "path", "body", "status"),
        [
            ("POST", "/admin/backends", {"url": "ftp://x"}, 400),
            ("POST", "/admin/backends", {"url": "http://127.0.0.1:1", "kind": "nope"}, 400),
            ("POST", "/admin/backends", {"url": "http://127.0.0.1:1", "colour": "red"}, 400),
            ("POST", "/admin/backends", {"id": "e0", "url": "http://127.0.0.1:1"}, 400),
            ("PATCH", "/admin/backends/e0", {"weight": -1}, 400),
            ("PATCH", "/admin/backends/e0", {"name": "x"}, 400),
            ("POST", "/admin/backends/missing/drain", None, 404),
            ("PUT", "/admin/backends", None, 405),
            ("GET", "/admin/elsewhere", None, 404),
        ],
    )
    def test_bad_admin_requests(self, servers: Servers, method: str, path: str, body: object, status: int) -> None:
        """Invalid admin calls get a clear 4xx and change nothing."""
        proxy = servers.proxy(servers.emulators(1), admin_token=TOKEN)
        got, error = _admin(method, proxy.url + path, body)
        assert got == status and error["error"]["message"]  # type: ignore[index]
        assert [x["id"] for x in _admin("GET", proxy.url + "/admin/backends")[1]["backends"]] == ["e0"]  # type: ignore[index]

    def test_hostile_admin_body_is_a_400(self, servers: Servers) -> None:
        """An admin body nested 5,000 deep gets a 400 JSON error and changes nothing."""
        proxy = servers.proxy(servers.emulators(1), admin_token=TOKEN)
        raw = b'{"url": ' + b"[" * 5_000 + b"]" * 5_000 + b"}"
        status, _, answer = http("POST", proxy.url + "/admin/backends", raw=raw, headers=AUTH)
        assert status == 400 and "UTF-8 JSON" in json.loads(answer)["error"]["message"]
        assert [x["id"] for x in _admin("GET", proxy.url + "/admin/backends")[1]["backends"]] == ["e0"]  # type: ignore[index]

    def test_drain_then_remove_when_idle(self, servers: Servers) -> None:
        """A drained backend takes no new requests, finishes its stream, then is removed."""
        a, b = servers.emulators(2, time_scale=0.2)  # the long stream lasts 400 x 3 ms = 1.2 s
        proxy = servers.proxy([a, b], admin_token=TOKEN, strategy="least-outstanding", options={"seed": 2})
        result: list[bytes] = []

        def long_stream() -> None:
            _, headers, body = http(
                "POST", proxy.url + "/v1/chat/completions", chat_body("long", max_tokens=400, stream=True)
            )
            result.append(headers["x-kvroute-backend"].encode() + b" " + body[-14:])

        thread = threading.Thread(target=long_stream)
        thread.start()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not any(
            x["in_flight"] for x in _admin("GET", proxy.url + "/admin/backends")[1]["backends"]
        ):  # type: ignore[index]
            time.sleep(0.01)
        busy = next(x["id"] for x in _admin("GET", proxy.url + "/admin/backends")[1]["backends"] if x["in_flight"])  # type: ignore[index]
        status, drained = _admin("POST", proxy.url + f"/admin/backends/{busy}/drain", {"remove": True})
        assert status == 202 and drained["draining"] is True
        for i in range(5):
            assert http("POST", proxy.url + "/v1/chat/completions", chat_body(f"n{i}"))[1]["x-kvroute-backend"] != busy
        thread.join(timeout=60)
        assert result and result[0].endswith(b"data: [DONE]\n\n")
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and _admin("GET", proxy.url + f"/admin/backends/{busy}")[0] != 404:
            time.sleep(0.02)
        assert _admin("GET", proxy.url + f"/admin/backends/{busy}")[0] == 404

    def test_membership_changes_under_load_lose_nothing(self, servers: Servers) -> None:
        """Adding, draining, undraining and removing backends while requests run loses no request."""
        fleet = servers.emulators(4)
        proxy = servers.proxy(fleet[:2], admin_token=TOKEN, strategy="bounded-load")
        statuses: list[int] = []
        lock = threading.Lock()

        def one(i: int) -> None:
            status, _, body = http(
                "POST",
                proxy.url + "/v1/chat/completions",
                chat_body(f"prefix {i % 7} " * 30, max_tokens=8, stream=i % 3 == 0),
            )
            ok = status == 200 and (body.endswith(b"[DONE]\n\n") or bool(json.loads(body)["choices"]))
            with lock:
                statuses.append(status if ok else -status)

        with ThreadPoolExecutor(max_workers=16) as pool:
            futures = [pool.submit(one, i) for i in range(300)]
            steps = [
                ("POST", "/admin/backends", {"id": "e2", "url": fleet[2].url}),
                ("POST", "/admin/backends", {"id": "e3", "url": fleet[3].url}),
                ("POST", "/admin/backends/e0/drain", {}),
                ("DELETE", "/admin/backends/e1", None),
                ("POST", "/admin/backends/e0/undrain", {}),
                ("POST", "/admin/backends/e2/drain", {"remove": True}),
            ]
            for method, path, body in steps:
                time.sleep(0.1)
                assert _admin(method, proxy.url + path, body)[0] in (200, 201, 202)
            for future in futures:
                future.result(timeout=120)
        assert len(statuses) == 300 and set(statuses) == {200}
