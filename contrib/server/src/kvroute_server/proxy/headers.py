"""Which headers pass through the proxy, in each direction (RFC 9110's hop-by-hop rules and the proxy's own).

Run once per proxied request on the way up (`filter_request_headers`) and once on the way
down (`filter_response_headers`), so both are written for speed as well as correctness.

Headers the proxy owns on the way up (`PROXY_OWNED`): ``X-data-parallel-rank`` tells a
data-parallel engine which of its ranks serves the request. The proxy sets it from the routing
decision (`kvroute.ranks.rank_for`); a client's own is always dropped (and reported to the
caller, which counts it), so that no client can steer a request onto another rank's cache.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable

from kvroute.ranks import RANK_HEADER

__all__ = ["HOP_BY_HOP", "PROXY_OWNED", "filter_request_headers", "filter_response_headers"]

#: RFC 9110 section 7.6.1 connection-specific headers, never forwarded in either direction.
HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
    }
)
#: Set by the proxy alone on the way up: a client's value is dropped and reported (see the module docstring).
PROXY_OWNED = frozenset({RANK_HEADER})
# Recomputed or owned by the proxy on the way up.
_DROP_UP = HOP_BY_HOP | PROXY_OWNED | {"host", "content-length", "accept-encoding", "expect"}
# Recomputed by the ASGI server on the way down.
_DROP_DOWN = HOP_BY_HOP | {"content-length", "date", "server"}
# The same, as the bytes names of a backend's answer are compared with.
_DROP_DOWN_BYTES = frozenset(name.encode("ascii") for name in _DROP_DOWN)


def _named_by_connection(value: bytes) -> frozenset[str]:
    """The header names a Connection header's ``value`` lists, beyond those always dropped (lower case).

    RFC 9110 section 7.6.1: a header named in Connection is hop-by-hop too. Almost every
    Connection header says ``keep-alive`` or ``close``, already in `HOP_BY_HOP`, so the
    answer is mostly empty. Short values are cached (the same few come again and again);
    long ones are not, so that a client cannot fill the cache with large values.
    """
    if len(value) > 64:
        return _parse_connection(value)
    return _parse_connection_cached(value)


def _parse_connection(value: bytes) -> frozenset[str]:
    """`_named_by_connection` without the cache: comma-separated tokens, trimmed and lower-cased as text."""
    tokens = (token.strip().lower() for token in value.decode("latin-1").split(","))
    return frozenset(token for token in tokens if token) - HOP_BY_HOP


_parse_connection_cached = functools.lru_cache(maxsize=256)(_parse_connection)


def filter_request_headers(
    raw: Iterable[tuple[bytes, bytes]],
    *,
    forward_authorization: bool,
    api_key: str | None,
    request_id: str,
    rank: int | None = None,
    forged: list[str] | None = None,
) -> dict[str, str]:
    """Headers to send upstream: hop-by-hop dropped, Authorization forwarded or replaced, request id set.

    Headers in `PROXY_OWNED` are dropped whatever their value, their names appended to ``forged``
    (when given) for the caller to count; ``rank`` (when not ``None``) is sent as ``x-data-parallel-rank``.

    Names listed in a Connection header are removed after the pass, only when there are such
    names beyond the usual ``keep-alive``/``close``: the last value of each other name is
    kept, in the order the names first came, as if they had been skipped in the pass.
    """
    drop_authorization = api_key is not None or not forward_authorization
    out: dict[str, str] = {}
    named: frozenset[str] = frozenset()
    for raw_name, raw_value in raw:
        name = raw_name.decode("latin-1").lower()
        if name in _DROP_UP:
            if name == "connection":
                named |= _named_by_connection(raw_value)
            elif forged is not None and name in PROXY_OWNED:
                forged.append(name)
            continue
        if name == "authorization" and drop_authorization:
            continue
        out[name] = raw_value.decode("latin-1")
    for name in named:
        out.pop(name, None)
    if api_key is not None:
        out["authorization"] = f"Bearer {api_key}"
    out["x-request-id"] = request_id
    if rank is not None:
        out[RANK_HEADER] = str(rank)
    return out


def filter_response_headers(headers: Iterable[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """Headers to send back to the client: hop-by-hop and length/date/server dropped, names in lower case.

    One pass in bytes: ``bytes.lower`` and ``str.lower`` agree on whether a Latin-1 name is one
    of the (ASCII) dropped names. Names listed in a Connection header are dropped in a second
    pass, only when there are such names beyond the usual ``keep-alive``/``close``.
    """
    out: list[tuple[bytes, bytes]] = []
    named: frozenset[str] = frozenset()
    for name, value in headers:
        lower = name.lower()
        if lower in _DROP_DOWN_BYTES:
            if lower == b"connection":
                named |= _named_by_connection(value)
            continue
        out.append((lower, value))
    if named:
        out = [(name, value) for name, value in out if name.decode("latin-1").lower() not in named]
    return out
