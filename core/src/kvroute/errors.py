"""The one error hierarchy of kvroute.

Every message says what was expected and what was got, so that an operator can fix
a configuration or a client can fix a request without reading the source.
"""

from __future__ import annotations

__all__ = [
    "ConfigError",
    "InvalidRequest",
    "KvrouteError",
    "NoBackendAvailable",
    "PluginLoadError",
    "StrategyError",
    "UnknownBackend",
]


class KvrouteError(Exception):
    """Base class of every error kvroute raises on purpose."""


class ConfigError(KvrouteError, ValueError):
    """A configuration value (strategy name, option, backend definition) is invalid."""


class PluginLoadError(KvrouteError):
    """A plugin could not be imported or one of its hooks failed while registering."""


class InvalidRequest(KvrouteError, ValueError):
    """An OpenAI-compatible request body cannot be routed as it is.

    ``param`` names the offending field (OpenAI's error body has the same key).
    """

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class NoBackendAvailable(KvrouteError):
    """No backend can take the request: none registered, none healthy, or all excluded."""


class StrategyError(KvrouteError):
    """A strategy's own code (a request callback) failed; the request was not routed."""


class UnknownBackend(KvrouteError, KeyError):
    """A backend id was named that the fleet does not hold."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""
