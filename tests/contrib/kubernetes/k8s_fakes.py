"""Test doubles for the Kubernetes provider: a loopback HTTP server that answers like the API server's
EndpointSlice list and watch, a kubeconfig pointing at it, slice builders, and a recording sink.

The server follows the documented wire format (API concepts: "Efficient detection of changes",
"Watch bookmarks", "410 Gone responses"): a list is a ``EndpointSliceList`` with
``metadata.resourceVersion``; a watch (``?watch=true``) is a chunked ``application/json`` body of
one JSON event per line, ``{"type": ADDED|MODIFIED|DELETED|BOOKMARK|ERROR, "object": ...}``; an
expired resourceVersion is an ERROR event whose object is a ``Status`` with ``code: 410``, or an
HTTP 410 answer carrying that ``Status``. Each test scripts the stream live through `WatchConnection`.
"""

from __future__ import annotations

import asyncio
import json
import ssl
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import attrs
from aiohttp import web

from kvroute.discovery import Snapshot

PATH = "/apis/discovery.k8s.io/v1/namespaces/{namespace}/endpointslices"
TOKEN = "kvroute-test-token"
FIXTURES = Path(__file__).resolve().parent / "fixtures"
#: Self-signed for 127.0.0.1 (see fixtures/README.md).
CA_CERT = FIXTURES / "apiserver.crt"


def endpoint(
    pod: str | None,
    address: str,
    *,
    ready: bool | None = True,
    serving: bool | None = None,
    terminating: bool | None = None,
    zone: str | None = None,
) -> dict[str, Any]:
    """One entry of a slice's ``endpoints``, as the API serialises it (unset conditions omitted)."""
    conditions = {
        k: v for k, v in (("ready", ready), ("serving", serving), ("terminating", terminating)) if v is not None
    }
    out: dict[str, Any] = {"addresses": [address], "conditions": conditions}
    if pod is not None:
        out["targetRef"] = {"kind": "Pod", "namespace": "inference", "name": pod, "uid": f"uid-{pod}"}
        out["nodeName"] = "node-a"
    if zone is not None:
        out["zone"] = zone
    return out


def endpoint_slice(
    name: str,
    endpoints: Sequence[dict[str, Any]] | None,
    *,
    service: str = "vllm",
    namespace: str = "inference",
    ports: Sequence[tuple[str, int]] = (("http", 8000),),
    address_type: str = "IPv4",
    labels: dict[str, str] | None = None,
    annotations: dict[str, str] | None = None,
) -> dict[str, Any]:
    """An ``EndpointSlice`` as the EndpointSlice controller writes it (``endpoints: null`` when empty)."""
    meta: dict[str, Any] = {
        "name": name,
        "namespace": namespace,
        "generateName": f"{service}-",
        "uid": f"uid-{name}",
        "labels": {
            "kubernetes.io/service-name": service,
            "endpointslice.kubernetes.io/managed-by": "endpointslice-controller.k8s.io",
            **(labels or {}),
        },
        "ownerReferences": [{"apiVersion": "v1", "kind": "Service", "name": service, "uid": f"uid-svc-{service}"}],
    }
    if annotations:
        meta["annotations"] = annotations
    return {
        "kind": "EndpointSlice",
        "apiVersion": "discovery.k8s.io/v1",
        "metadata": meta,
        "addressType": address_type,
        "endpoints": list(endpoints) if endpoints is not None else None,
        "ports": [{"name": n, "protocol": "TCP", "port": p} for n, p in ports],
    }


def gone_status(version: str) -> dict[str, Any]:
    """The ``Status`` the API server sends for a compacted resourceVersion."""
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": f"too old resource version: {version} (1000)",
        "reason": "Expired",
        "code": 410,
    }


@attrs.define(eq=False)
class WatchConnection:
    """One open watch request; the test writes its stream."""

    query: dict[str, str]
    headers: dict[str, str]
    _actions: asyncio.Queue[tuple[str, Any]] = attrs.field(factory=asyncio.Queue)
    done: asyncio.Event = attrs.field(factory=asyncio.Event)

    async def send(self, event: dict[str, Any]) -> None:
        """Write one event line in one chunk."""
        await self._actions.put(("write", (json.dumps(event) + "\n").encode()))

    async def send_slowly(self, event: dict[str, Any], pieces: int, pause: float) -> None:
        """Write one event line split into ``pieces`` chunks with ``pause`` seconds between them."""
        data = (json.dumps(event) + "\n").encode()
        step = -(-len(data) // pieces)
        for i in range(0, len(data), step):
            await self._actions.put(("write", data[i : i + step]))
            await self._actions.put(("sleep", pause))

    async def bookmark(self, version: str) -> None:
        """A BOOKMARK: an object of the watched kind carrying only ``metadata.resourceVersion``."""
        await self.send(
            {
                "type": "BOOKMARK",
                "object": {
                    "kind": "EndpointSlice",
                    "apiVersion": "discovery.k8s.io/v1",
                    "metadata": {"resourceVersion": version},
                    "addressType": "",
                    "endpoints": None,
                },
            }
        )

    async def gone(self, version: str) -> None:
        """An ERROR event with a 410 ``Status``; the server then ends the stream, as the API server does."""
        await self.send({"type": "ERROR", "object": gone_status(version)})
        await self.end()

    async def drop(self, partial: bytes = b"") -> None:
        """Write ``partial`` (half a line, say) and cut the TCP connection without ending the chunked body."""
        if partial:
            await self._actions.put(("write", partial))
        await self._actions.put(("drop", None))
        await self.done.wait()

    async def end(self) -> None:
        """End the body cleanly, as the server does when ``timeoutSeconds`` runs out."""
        await self._actions.put(("end", None))

    async def serve(self, request: web.Request, response: web.StreamResponse) -> None:
        try:
            while True:
                action, arg = await self._actions.get()
                if action == "write":
                    await response.write(arg)
                elif action == "sleep":
                    await asyncio.sleep(arg)
                elif action == "drop":
                    assert request.transport is not None
                    request.transport.abort()
                    return
                else:
                    await response.write_eof()
                    return
        finally:
            self.done.set()


@attrs.define(eq=False)
class FakeApiServer:
    """EndpointSlices in one store with a resourceVersion counter, served on loopback."""

    port: int = 0
    #: The bearer token the server accepts; any other gets 401 Unauthorized, as the API server answers.
    token: str = TOKEN
    slices: dict[str, dict[str, Any]] = attrs.field(factory=dict)
    version: int = 100
    #: Every request: ("list" | "watch", query, headers).
    requests: list[tuple[str, dict[str, str], dict[str, str]]] = attrs.field(factory=list)
    #: Statuses to answer the next list / watch requests with instead of the normal answer.
    list_failures: deque[int] = attrs.field(factory=deque)
    watch_failures: deque[int] = attrs.field(factory=deque)
    _watches: asyncio.Queue[WatchConnection] = attrs.field(factory=asyncio.Queue)
    _open: list[WatchConnection] = attrs.field(factory=list)

    def store(self, event_type: str, obj: dict[str, Any]) -> dict[str, Any]:
        """Apply a change to the store as the API server would; return the watch event for it."""
        self.version += 1
        obj = json.loads(json.dumps(obj))
        obj["metadata"]["resourceVersion"] = str(self.version)
        name = obj["metadata"]["name"]
        if event_type == "DELETED":
            self.slices.pop(name, None)
        else:
            self.slices[name] = obj
        return {"type": event_type, "object": obj}

    def put(self, *objs: dict[str, Any]) -> None:
        """Create or replace slices without any watcher seeing it (state before a list or relist)."""
        for obj in objs:
            self.store("ADDED", obj)

    def requests_of(self, kind: str) -> list[dict[str, str]]:
        return [q for k, q, _ in self.requests if k == kind]

    async def next_watch(self, within: float = 5.0) -> WatchConnection:
        """The next watch request the provider opens, within ``within`` seconds."""
        with anyio.fail_after(within):
            return await self._watches.get()

    async def handle(self, request: web.Request) -> web.StreamResponse:
        query = dict(request.query)
        headers = dict(request.headers)
        namespace = request.match_info["namespace"]
        is_watch = go_bool(query.get("watch", "false"))
        self.requests.append(("watch" if is_watch else "list", query, headers))
        failures = self.watch_failures if is_watch else self.list_failures
        if headers.get("Authorization") != f"Bearer {self.token}":
            status = {"kind": "Status", "status": "Failure", "message": "Unauthorized", "reason": "Unauthorized"}
            return web.json_response({**status, "code": 401}, status=401)
        if failures:
            code = failures.popleft()
            body = gone_status(query.get("resourceVersion", "")) if code == 410 else {"kind": "Status", "code": code}
            return web.json_response(body, status=code)
        selected = [s for s in self.slices.values() if _selected(s, namespace, query.get("labelSelector", ""))]
        if not is_watch:
            return web.json_response(
                {
                    "kind": "EndpointSliceList",
                    "apiVersion": "discovery.k8s.io/v1",
                    "metadata": {"resourceVersion": str(self.version)},
                    "items": sorted(selected, key=lambda s: s["metadata"]["name"]),
                }
            )
        response = web.StreamResponse(status=200, headers={"Content-Type": "application/json"})
        response.enable_chunked_encoding()
        await response.prepare(request)
        connection = WatchConnection(query, headers)
        self._open.append(connection)
        await self._watches.put(connection)
        await connection.serve(request, response)
        return response

    async def close(self) -> None:
        for connection in self._open:
            if not connection.done.is_set():
                await connection.end()


def go_bool(text: str) -> bool:
    """A query flag as the API server parses it (Go's strconv.ParseBool); anything else is a 400 there."""
    if text in ("1", "t", "T", "TRUE", "true", "True"):
        return True
    if text in ("0", "f", "F", "FALSE", "false", "False"):
        return False
    raise ValueError(f"not a boolean query value: {text!r}")


def _selected(obj: dict[str, Any], namespace: str, selector: str) -> bool:
    if obj["metadata"].get("namespace") != namespace:
        return False
    labels = obj["metadata"].get("labels") or {}
    for term in filter(None, selector.split(",")):
        key, _, value = term.partition("=")
        if labels.get(key) != value:
            return False
    return True


@asynccontextmanager
async def fake_api(*, tls: bool = False) -> AsyncIterator[FakeApiServer]:
    """A `FakeApiServer` listening on 127.0.0.1 (an ephemeral port) until the block ends.

    With ``tls`` it serves HTTPS with the certificate in fixtures/ (``CA_CERT`` verifies it), as
    the in-cluster address ``https://KUBERNETES_SERVICE_HOST:KUBERNETES_SERVICE_PORT`` requires.
    """
    api = FakeApiServer()
    app = web.Application()
    app.router.add_get(PATH, api.handle)
    runner = web.AppRunner(app, handler_cancellation=True)
    await runner.setup()
    context = None
    if tls:
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(CA_CERT, FIXTURES / "apiserver.key")
    site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=context)
    await site.start()
    api.port = runner.addresses[0][1]
    try:
        yield api
    finally:
        await api.close()
        await runner.cleanup()


def write_kubeconfig(path: Path, port: int, token: str = TOKEN) -> Path:
    """A kubeconfig whose current context points at ``http://127.0.0.1:PORT`` with a bearer token."""
    path.write_text(
        "apiVersion: v1\n"
        "kind: Config\n"
        "clusters:\n"
        f"- name: fake\n  cluster:\n    server: http://127.0.0.1:{port}\n"
        "users:\n"
        f"- name: tester\n  user:\n    token: {token}\n"
        "contexts:\n"
        "- name: fake\n  context:\n    cluster: fake\n    user: tester\n    namespace: inference\n"
        "current-context: fake\n",
        encoding="utf-8",
    )
    return path


@attrs.define(eq=False)
class RecordingSink:
    """A `kvroute.discovery.DiscoverySink` that keeps every call, in order."""

    calls: list[Snapshot | tuple[str, str]] = attrs.field(factory=list)
    _changed: anyio.Event = attrs.field(factory=anyio.Event)

    def publish(self, snapshot: Snapshot) -> None:
        self.calls.append(snapshot)
        self._notify()

    def failed(self, source: str, reason: str) -> None:
        self.calls.append((source, reason))
        self._notify()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = anyio.Event()

    @property
    def snapshots(self) -> list[Snapshot]:
        return [c for c in self.calls if isinstance(c, Snapshot)]

    @property
    def failures(self) -> list[tuple[str, str]]:
        return [c for c in self.calls if not isinstance(c, Snapshot)]

    @property
    def last(self) -> Snapshot:
        return self.snapshots[-1]

    async def wait_for(self, predicate: Callable[[RecordingSink], bool], within: float = 5.0) -> None:
        """Wait until ``predicate(self)`` holds, at most ``within`` seconds."""
        with anyio.fail_after(within):
            while not predicate(self):
                await self._changed.wait()


def view(snapshot: Snapshot) -> list[tuple[str, str, bool]]:
    """(id, url, draining) per backend, in snapshot order."""
    return [(b.id, b.url, b.draining) for b in snapshot.backends]
