"""`kvroute_server.http.asgi.RouteTable`: method and path to handler, 404 and 405 in OpenAI's error shape."""

from __future__ import annotations

import json
from typing import Any

import pytest

from kvroute_server.http.asgi import Refusal, RouteTable


def table() -> RouteTable[str]:
    routes: RouteTable[str] = RouteTable()
    routes.add("GET", "/v1/models", "models")
    routes.add("GET", "/items/{id}", "get")
    routes.add("PATCH", "/items/{id}", "patch")
    routes.add("DELETE", "/items/{id}", "delete")
    routes.add("POST", "/items/{id}/drain", "drain")
    return routes


class TestRouteTable:
    def test_exact_path(self) -> None:
        """An exact path and method find their handler, with no values."""
        assert table().find("GET", "/v1/models") == ("models", {})

    def test_pattern_values_by_name(self) -> None:
        """A ``{name}`` segment matches any one segment and its value comes back under that name."""
        assert table().find("POST", "/items/a.b-1/drain") == ("drain", {"id": "a.b-1"})

    def test_unknown_path(self) -> None:
        """A path no route has is a 404 naming the method and path, code ``unknown_url``."""
        assert table().find("GET", "/items") == Refusal(404, "Unknown route: GET /items.", "unknown_url")

    def test_pattern_needs_every_segment(self) -> None:
        """A pattern matches only paths with as many segments, its fixed ones equal."""
        routes = table()
        assert isinstance(routes.find("POST", "/items/a/undrain"), Refusal)
        assert isinstance(routes.find("GET", "/items/a/b/c"), Refusal)

    def test_wrong_method(self) -> None:
        """A known path with another method is a 405 listing the path's methods in the order added, also in Allow."""
        refusal = table().find("POST", "/items/x")
        assert refusal == Refusal(
            405,
            "Method POST is not allowed on /items/x (allowed: GET, PATCH, DELETE).",
            "method_not_allowed",
            ((b"allow", b"GET, PATCH, DELETE"),),
        )

    def test_wrong_method_without_405(self) -> None:
        """Without a ``not_allowed`` template, a known path with another method is the 404."""
        routes: RouteTable[str] = RouteTable(
            not_found="Not Found: {method} {path}", not_found_code="nf", not_allowed=None
        )
        routes.add("GET", "/x", "x")
        assert routes.find("PUT", "/x") == Refusal(404, "Not Found: PUT /x", "nf")

    def test_add_replaces(self) -> None:
        """Adding a method and path again replaces its handler; the other methods stay."""
        routes = table()
        routes.add("GET", "/items/{id}", "other")
        assert routes.find("GET", "/items/1") == ("other", {"id": "1"})
        assert routes.find("DELETE", "/items/1") == ("delete", {"id": "1"})

    def test_mount_after_routes(self) -> None:
        """A mount takes every method under its prefix, but only paths no other route takes."""
        routes = table()
        routes.mount("/v1/", "mounted")
        assert routes.find("PUT", "/v1/anything/at/all") == ("mounted", {})
        assert routes.find("GET", "/v1/models") == ("models", {})
        assert routes.find("POST", "/v1/models") == Refusal(
            405, "Method POST is not allowed on /v1/models (allowed: GET).", "method_not_allowed", ((b"allow", b"GET"),)
        )

    def test_segments_given(self) -> None:
        """Segments decoded by the caller are matched as given: a ``/`` inside one is not a separator."""
        found = table().find("GET", "/items/a/b", segments=["", "items", "a/b"])
        assert found == ("get", {"id": "a/b"})

    def test_contains_exact_paths(self) -> None:
        """``in`` tells whether an exact route has the path."""
        routes = table()
        assert "/v1/models" in routes and "/items/{id}" not in routes and "/nothing" not in routes


class TestRefusal:
    @pytest.mark.anyio
    async def test_send(self) -> None:
        """A refusal is sent as its status, its headers and OpenAI's error body."""
        sent: list[dict[str, Any]] = []

        async def send(message: Any) -> None:
            sent.append(message)

        await Refusal(405, "No.", "method_not_allowed", ((b"allow", b"GET"),)).send(send)
        start, body = sent
        assert start["status"] == 405 and (b"allow", b"GET") in start["headers"]
        assert json.loads(body["body"]) == {
            "error": {"message": "No.", "type": "invalid_request_error", "param": None, "code": "method_not_allowed"}
        }
