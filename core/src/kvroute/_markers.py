"""The pluggy markers. ``hookimpl`` is public (re-exported from ``kvroute``); the spec marker is not."""

from __future__ import annotations

import pluggy

PROJECT = "kvroute"

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)
