"""Start ``kvroute serve`` in front of engines for end-to-end tests (standard library only), and stop it by its group.

`start_proxy` writes a TOML configuration (the engines as ``vllm`` backends ``vllm-0``, ``vllm-1``...),
starts the proxy in its own session with JSON logs, waits until every backend is routable and the
adapters have polled their engines' load a few times, and stops the process group on exit.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import time
import urllib.error
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from tests.e2e.vllm.servers import free_ports, get_text, stop_process_group

__all__ = ["Proxy", "start_proxy"]


class Proxy:
    """A running ``kvroute serve``: its URL and its JSON log."""

    def __init__(self, url: str, log: Path) -> None:
        self.url = url
        self.log = log

    def events(self) -> list[dict[str, Any]]:
        """The proxy's JSON log lines so far."""
        out = []
        for line in self.log.read_text(errors="replace").splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
        return out


def _wait_healthy(url: str, proc: subprocess.Popen[bytes], log: Path, backends: int, limit_s: float = 60.0) -> None:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(
                f"kvroute serve exited with {proc.returncode}:\n{log.read_text(errors='replace')[-3000:]}"
            )
        try:
            body = json.loads(get_text(url + "/health", timeout_s=2))
            if body.get("routable") == body.get("backends") == backends:
                return
        except (urllib.error.URLError, OSError, ValueError):
            pass
        time.sleep(0.2)
    raise TimeoutError(f"kvroute serve was not healthy within {limit_s} s:\n{log.read_text(errors='replace')[-3000:]}")


@contextlib.contextmanager
def start_proxy(
    engine_urls: Sequence[str],
    strategy: str,
    options: Mapping[str, Any],
    workdir: Path,
    *,
    adapter_options: str = "",
    name: str | None = None,
    sections: Mapping[str, Mapping[str, Any]] | None = None,
) -> Iterator[Proxy]:
    """``kvroute serve`` routing with ``strategy`` over the engines; ``adapter_options`` is a TOML inline table.

    ``sections`` adds top-level tables of the configuration, e.g. ``{"sessions": {"enabled": False}}``.
    """
    (port,) = free_ports(1)
    lines = [
        "[server]",
        'host = "127.0.0.1"',
        f"port = {port}",
        "",
        "[routing]",
        f'strategy = "{strategy}"',
        "",
        "[routing.options]",
        *(f"{k} = {json.dumps(v)}" for k, v in options.items()),
        "",
        "[health]",
        "interval = 0.5",
        "timeout = 5.0",
        "",
    ]
    for section, values in (sections or {}).items():
        lines += [f"[{section}]", *(f"{k} = {json.dumps(v)}" for k, v in values.items()), ""]
    for i, url in enumerate(engine_urls):
        lines += ["[[backends]]", f'id = "vllm-{i}"', f'url = "{url}"', 'kind = "vllm"']
        if adapter_options:
            lines.append(f"adapter_options = {adapter_options}")
        lines.append("")
    label = name or strategy
    config = workdir / f"kvroute-{label}.toml"
    config.write_text("\n".join(lines))
    log = workdir / f"kvroute-{label}.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "kvroute",
                "serve",
                "--config",
                str(config),
                "--log-format",
                "json",
                "--log-level",
                "info",
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_healthy(url, proc, log, len(engine_urls))
        time.sleep(1.5)  # a few health rounds: every adapter has polled its engine's load (block size, KV size)
        yield Proxy(url, log)
    finally:
        stop_process_group(proc, grace_s=10)
