"""The admin journal of `kvroute serve --workers N`, and proxies sharing it in one process.

The processes themselves (supervisor, shared socket, merged metrics, restarts) are tested in
tests/replicas/test_workers.py; here the journal and the admin fan-out run in threads.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import anyio
import pytest
from click.testing import CliRunner

from kvroute_server import BackendConfig, HealthConfig, ProxyApp, ServerConfig, ServerThread
from kvroute_server.cli import serve
from kvroute_server.ops.journal import AdminJournal, WorkerContext
from tests.server.harness import Servers, chat_body, http

TOKEN = "journal-test-admin-token"
AUTH = {"authorization": f"Bearer {TOKEN}"}


def journal(
    run_dir: Path, index: int, applied: list[tuple[int, dict[str, Any]]] | None = None, **kw: Any
) -> AdminJournal:
    """A worker's journal handle whose replays are recorded as (worker index, entry)."""
    out = applied if applied is not None else []
    context = WorkerContext(index=index, count=2, run_dir=str(run_dir), shared_metrics=False)
    return AdminJournal(context, lambda entry: out.append((index, entry)), **kw)


def dead_pid() -> int:
    """The pid of a process that has exited and been reaped."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


class TestAdminJournal:
    @pytest.mark.anyio
    async def test_changes_reach_the_other_worker_in_order(self, tmp_path: Path) -> None:
        """Changes appended by either worker are replayed by the other in one order, numbered from 1."""
        seen: list[tuple[int, dict[str, Any]]] = []
        a, b = journal(tmp_path, 0, seen), journal(tmp_path, 1, seen)
        for backend in ("x", "y"):
            async with a.exclusive():
                a.append("drain", backend, {})
        assert b.catch_up() == 2
        async with b.exclusive():
            b.append("undrain", "x", {})
        assert a.catch_up() == 1
        assert [(w, e["seq"], e["action"], e["backend"]) for w, e in seen] == [
            (1, 1, "drain", "x"),
            (1, 2, "drain", "y"),
            (0, 3, "undrain", "x"),
        ]
        assert a.applied == b.applied == 3

    @pytest.mark.anyio
    async def test_taking_the_lock_catches_up_first(self, tmp_path: Path) -> None:
        """A worker that writes a change has first applied every earlier change, so its number follows them."""
        seen: list[tuple[int, dict[str, Any]]] = []
        a, b = journal(tmp_path, 0, seen), journal(tmp_path, 1, seen)
        async with a.exclusive():
            a.append("drain", "x", {})
        async with b.exclusive():
            assert seen == [(1, {"seq": 1, "action": "drain", "backend": "x", "body": {}})]
            assert b.append("remove", "x", None) == 2

    def test_a_line_still_being_written_waits(self, tmp_path: Path) -> None:
        """An entry without its newline yet is left for the next look."""
        seen: list[tuple[int, dict[str, Any]]] = []
        b = journal(tmp_path, 1, seen)
        line = json.dumps({"seq": 1, "action": "drain", "backend": "x", "body": {}}) + "\n"
        with open(tmp_path / "admin.jsonl", "a", encoding="utf-8") as f:
            f.write(line[:10])
            f.flush()
            assert b.catch_up() == 0
            f.write(line[10:])
        assert b.catch_up() == 1 and seen[0][1]["backend"] == "x"

    @pytest.mark.anyio
    async def test_a_change_refused_here_does_not_stop_the_rest(self, tmp_path: Path) -> None:
        """A replay that raises is logged and skipped; later changes still apply."""
        a = journal(tmp_path, 0)
        done: list[str] = []

        def apply(entry: dict[str, Any]) -> None:
            if entry["backend"] == "gone":
                raise KeyError("gone")
            done.append(entry["backend"])

        b = AdminJournal(WorkerContext(1, 2, str(tmp_path), shared_metrics=False), apply)
        for backend in ("x", "gone", "y"):
            async with a.exclusive():
                a.append("drain", backend, {})
        assert b.catch_up() == 3
        assert done == ["x", "y"] and b.applied == 3

    @pytest.mark.anyio
    async def test_the_lock_excludes_other_workers(self, tmp_path: Path) -> None:
        """While one worker holds the journal lock another cannot take it (bounded wait, then TimeoutError)."""
        a, b = journal(tmp_path, 0), journal(tmp_path, 1, lock_timeout_s=0.2)
        async with a.exclusive():
            with pytest.raises(TimeoutError, match="admin journal lock"):
                async with b.exclusive():
                    pass
        async with b.exclusive():
            assert b.append("drain", "x", {}) == 1

    @pytest.mark.anyio
    async def test_waits_for_live_workers_only(self, tmp_path: Path) -> None:
        """The writer waits until a live sibling applied the change; a dead sibling's position is ignored."""
        a, b = journal(tmp_path, 0, ack_timeout_s=0.2), journal(tmp_path, 1)
        (tmp_path / "workers" / "1.json").write_text(json.dumps({"pid": dead_pid(), "applied": 0}))
        async with a.exclusive():
            seq = a.append("drain", "x", {})
        assert await a.wait_for_siblings(seq) == {"applied": 1, "live": 1}
        b.publish()  # alive (this process) and behind: the wait times out and says so
        assert await a.wait_for_siblings(seq) == {"applied": 1, "live": 2}
        async with anyio.create_task_group() as tg:
            tg.start_soon(b.follow)
            assert await a.wait_for_siblings(seq) == {"applied": 2, "live": 2}
            tg.cancel_scope.cancel()


def start_worker(servers: Servers, run_dir: Path, index: int, backends: list[ServerThread]) -> ServerThread:
    """A proxy acting as worker ``index`` of 2 (journal shared through ``run_dir``), in a thread."""
    config = ServerConfig(
        backends=tuple(BackendConfig(id=f"e{i}", url=b.url) for i, b in enumerate(backends)),
        strategy="consistent-hash",
        options={"prefix_length": 1024},
        admin_token=TOKEN,
        access_log=False,
        health=HealthConfig(interval=0.5, timeout=1.0),
    )
    app = ProxyApp(config, worker=WorkerContext(index=index, count=2, run_dir=str(run_dir), shared_metrics=False))
    server = ServerThread(app).start()
    servers.started.append(server)
    return server


def admin(server: ServerThread, method: str, path: str, body: Any = None) -> tuple[int, dict[str, Any]]:
    status, _, raw = http(method, server.url + "/admin" + path, body, headers=AUTH)
    return status, json.loads(raw)


class TestSharedAdmin:
    def test_a_drain_through_one_worker_stops_new_requests_on_both(self, servers: Servers, tmp_path: Path) -> None:
        """Draining through worker 0 answers once worker 1 applied it; then neither routes to the drained backend."""
        engines = servers.emulators(3)
        w0, w1 = start_worker(servers, tmp_path, 0, engines), start_worker(servers, tmp_path, 1, engines)
        homes = {
            http("POST", w1.url + "/v1/chat/completions", chat_body(f"doc {i} " * 300))[1]["x-kvroute-backend"]
            for i in range(12)
        }
        assert "e1" in homes  # the drain below changes where some of these go
        status, answer = admin(w0, "POST", "/backends/e1/drain")
        assert status == 202 and answer["draining"] is True and answer["workers"] == {"applied": 2, "live": 2}
        assert admin(w1, "GET", "/backends/e1")[1]["draining"] is True
        for worker in (w0, w1):
            chosen = {
                http("POST", worker.url + "/v1/chat/completions", chat_body(f"doc {i} " * 300))[1]["x-kvroute-backend"]
                for i in range(12)
            }
            assert "e1" not in chosen

    def test_add_weight_and_remove_reach_both(self, servers: Servers, tmp_path: Path) -> None:
        """Adding, re-weighting and removing a backend through alternating workers leaves both with the same fleet."""
        engines = servers.emulators(3)
        w0, w1 = start_worker(servers, tmp_path, 0, engines[:2]), start_worker(servers, tmp_path, 1, engines[:2])
        status, answer = admin(w1, "POST", "/backends", {"id": "e2", "url": engines[2].url})
        assert status == 201 and answer["workers"]["applied"] == 2
        assert admin(w0, "PATCH", "/backends/e2", {"weight": 3})[0] == 200
        assert admin(w1, "DELETE", "/backends/e0")[0] == 200
        views = [{b["id"]: b["weight"] for b in admin(w, "GET", "/backends")[1]["backends"]} for w in (w0, w1)]
        assert views[0] == views[1] == {"e1": 1.0, "e2": 3.0}

    def test_a_refused_change_is_not_shared(self, servers: Servers, tmp_path: Path) -> None:
        """A change the receiving worker refuses (unknown backend, bad weight) answers 4xx and is not written."""
        engines = servers.emulators(1)
        w0 = start_worker(servers, tmp_path, 0, engines)
        assert admin(w0, "POST", "/backends/nope/drain")[0] == 404
        assert admin(w0, "PATCH", "/backends/e0", {"weight": "heavy"})[0] == 400
        assert (tmp_path / "admin.jsonl").read_text() == ""

    def test_a_worker_started_later_replays_every_change(self, servers: Servers, tmp_path: Path) -> None:
        """A worker that starts after changes were made (a restart) has them before it takes a request."""
        engines = servers.emulators(2)
        w0 = start_worker(servers, tmp_path, 0, engines)
        assert admin(w0, "POST", "/backends/e0/drain")[0] == 202
        assert admin(w0, "PATCH", "/backends/e1", {"weight": 2.5})[0] == 200
        late = start_worker(servers, tmp_path, 1, engines)
        described = {b["id"]: b for b in admin(late, "GET", "/backends")[1]["backends"]}
        assert described["e0"]["draining"] is True and described["e1"]["weight"] == 2.5
        assert (
            http("POST", late.url + "/v1/chat/completions", chat_body("after the replay"))[1]["x-kvroute-backend"]
            == "e1"
        )


class TestWorkersOption:
    def test_workers_in_flags_and_toml(self, tmp_path: Path) -> None:
        """--workers and [server] workers / shutdown_timeout are read, checked and shown by --check."""
        config = tmp_path / "kvroute.toml"
        config.write_text("[server]\nworkers = 3\nshutdown_timeout = 5\n")
        result = CliRunner().invoke(serve, ["--config", str(config), "--backend", "http://127.0.0.1:9", "--check"])
        assert result.exit_code == 0, result.output
        shown = json.loads(result.stdout)
        assert shown["workers"] == 3 and shown["shutdown_timeout"] == 5.0
        result = CliRunner().invoke(
            serve, ["--config", str(config), "--workers", "2", "--backend", "http://127.0.0.1:9", "--check"]
        )
        assert json.loads(result.stdout)["workers"] == 2

    @pytest.mark.parametrize("flag, value", [("--workers", "0"), ("--shutdown-timeout", "0")])
    def test_out_of_range_values_are_refused(self, flag: str, value: str) -> None:
        """Zero workers or a zero shutdown timeout is an error naming the key."""
        result = CliRunner().invoke(serve, ["--backend", "http://127.0.0.1:9", flag, value, "--check"])
        assert result.exit_code != 0 and flag.removeprefix("--").replace("-", "_") in result.output

    def test_a_taken_port_is_reported_before_any_worker_starts(self) -> None:
        """With --workers, the supervisor binds the port itself and a taken port is a clear error."""
        with socket.socket() as taken:
            taken.bind(("127.0.0.1", 0))
            taken.listen()
            port = taken.getsockname()[1]
            result = CliRunner().invoke(
                serve,
                ["--backend", "http://127.0.0.1:9", "--workers", "2", "--port", str(port), "--log-level", "error"],
            )
        assert result.exit_code == 1 and f"cannot listen on 127.0.0.1:{port}" in result.output
