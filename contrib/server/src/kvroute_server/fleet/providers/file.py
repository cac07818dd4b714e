"""Discovery kind ``file``: a TOML or JSON backend list, watched (``--discovery file:fleet.toml``).

The file holds backends in the shape of the configuration's ``[[backends]]`` tables (parsed by
`BackendConfig.from_mapping`, so the same keys and checks), plus an optional ``draining = true``
per entry. A ``.json`` file is a list of such objects or ``{"backends": [...]}``; any other name
is read as TOML with ``[[backends]]`` tables. ``api_key`` is not read from the file: set it on the
``[[discovery]]`` source, which applies it to every backend the source finds.

Watching: the file is read every ``interval`` seconds and parsed again when its bytes changed.
Polling rather than inotify (``watchfiles``): a Kubernetes ConfigMap volume updates by swapping a
symlink to a new directory, which a watch on the file misses, and editors replace files by rename;
reading a small file once a second costs nothing. Every read publishes the whole list (so the
source stays fresh); a file that is missing, unreadable or invalid is reported ``failed`` and the
proxy keeps the last good list.
"""

from __future__ import annotations

import json
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import attrs
from anyio.abc import TaskStatus

from kvroute.discovery import DiscoveredBackend, DiscoverySink, Snapshot
from kvroute.errors import ConfigError
from kvroute_server.config import BackendConfig

__all__ = ["FileDiscovery"]


@attrs.define
class FileDiscovery:
    """Publishes the backends listed in ``path`` (see the module docstring)."""

    path: Path
    #: Seconds between two reads of the file.
    interval: float = 1.0
    #: Defaults for entries that give no ``kind`` / ``models``.
    kind: str = "openai"
    models: tuple[str, ...] = ()
    source: str = ""

    def __attrs_post_init__(self) -> None:
        self.source = self.source or f"file:{self.path}"

    @classmethod
    def create(
        cls,
        *,
        target: str,
        interval: float = 1.0,
        kind: str = "openai",
        models: Any = (),
        scheme: str = "http",
    ) -> FileDiscovery:
        """The factory registered as kind ``file``; ``target`` is the file's path.

        ``scheme`` is accepted like every provider's common options and unused: entries carry whole URLs.
        """
        if not isinstance(target, str) or not target:
            raise ValueError(f"'target' must be the path of a TOML or JSON backend list (got {target!r}).")
        if isinstance(interval, bool) or not isinstance(interval, int | float) or not interval > 0:
            raise ValueError(f"'interval' must be a number of seconds > 0 (got {interval!r}).")
        if not isinstance(kind, str) or not kind:
            raise ValueError(f"'kind' must be a non-empty string (got {kind!r}).")
        if isinstance(models, str):
            models = (models,)
        if not isinstance(models, list | tuple) or not all(isinstance(m, str) and m for m in models):
            raise ValueError(f"'models' must be a list of model names (got {models!r}).")
        if scheme not in ("http", "https"):
            raise ValueError(f"'scheme' must be 'http' or 'https' (got {scheme!r}).")
        return cls(Path(target), float(interval), kind, tuple(models))

    def parse(self, raw: bytes) -> Snapshot:
        """The snapshot the file's bytes describe; raises `ValueError` saying what is wrong."""
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise ValueError(f"{self.path} is not UTF-8 text.") from None
        if self.path.suffix.lower() == ".json":
            try:
                data: Any = json.loads(text)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{self.path} is not valid JSON: {exc}.") from None
        else:
            try:
                data = tomllib.loads(text)
            except tomllib.TOMLDecodeError as exc:
                raise ValueError(f"{self.path} is not valid TOML: {exc}.") from None
        if isinstance(data, Mapping):
            unknown = sorted(set(data) - {"backends"})
            if unknown:
                raise ValueError(f"{self.path}: unknown key(s) {', '.join(map(repr, unknown))} (expected 'backends').")
            data = data.get("backends", [])
        if not isinstance(data, list):
            raise ValueError(f"{self.path}: expected a list of backends (got {type(data).__name__}).")
        found = [self._entry(entry, f"{self.path} backend #{i + 1}") for i, entry in enumerate(data)]
        return Snapshot(self.source, found)

    def _entry(self, entry: object, where: str) -> DiscoveredBackend:
        if not isinstance(entry, Mapping):
            raise ValueError(f"{where} must be a table/object with at least 'url' (got {type(entry).__name__}).")
        if "api_key" in entry:
            raise ValueError(
                f"{where}: 'api_key' is not read from a discovery file; set it on the [[discovery]] source."
            )
        table = {"kind": self.kind, "models": list(self.models), **entry}
        draining = table.pop("draining", False)
        if not isinstance(draining, bool):
            raise ValueError(f"{where}: 'draining' must be true or false (got {draining!r}).")
        try:
            config = BackendConfig.from_mapping(table, where)
        except ConfigError as exc:
            raise ValueError(str(exc)) from None
        return DiscoveredBackend(
            id=config.id,
            url=config.url,
            kind=config.kind,
            weight=config.weight,
            models=frozenset(config.models),
            labels=dict(config.labels),
            options=dict(config.adapter_options),
            draining=draining,
        )

    async def look(self, last: tuple[bytes, Snapshot] | None) -> tuple[bytes, Snapshot]:
        """Read the file; reuse ``last``'s snapshot when the bytes did not change. Raises `ValueError` or `OSError`."""
        raw = await anyio.to_thread.run_sync(self.path.read_bytes)
        if last is not None and last[0] == raw:
            return last
        return raw, self.parse(raw)

    async def run(self, sink: DiscoverySink, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Read, publish (or report the failure), wait ``interval``, repeat until cancelled."""
        last: tuple[bytes, Snapshot] | None = None
        started = False
        while True:
            try:
                last = await self.look(last)
            except OSError as exc:
                sink.failed(self.source, f"cannot read {self.path}: {exc.strerror or exc}")
            except ValueError as exc:
                sink.failed(self.source, str(exc))
            else:
                sink.publish(last[1])
            if not started:  # after the first look only: a task status may be started once
                task_status.started()
                started = True
            await anyio.sleep(self.interval)
