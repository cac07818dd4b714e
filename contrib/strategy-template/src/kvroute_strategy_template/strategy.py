"""`Rendezvous`: weighted rendezvous hashing of each request's prefix key over the candidates.

Every (key, backend) pair gets a score from a stable hash; the candidate with the highest
score wins. Because the score of a pair never depends on the other backends, adding a
backend only takes the keys it now wins, removing one only moves the keys it had, and
every router replica computes the same winner without talking to the others.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import attrs

import kvroute
from kvroute.keys import DEFAULT_PREFIX_LENGTH, MAX_PREFIX_LENGTH, MIN_PREFIX_LENGTH, prefix_key
from kvroute.options import int_option

__all__ = ["Rendezvous", "score"]

_TOP = float(1 << 64)


def score(key: int, backend: kvroute.Backend) -> float:
    """The weighted rendezvous score of ``key`` on ``backend``: ``-weight / ln(u)``, ``u`` in (0, 1).

    ``u`` is a stable 64-bit hash of the pair mapped into the open unit interval; the
    backend with the highest score wins a key with probability proportional to its weight.
    """
    u = (kvroute.hash_parts(key, backend.id) + 0.5) / _TOP
    return -backend.weight / math.log(u)


@attrs.define
class Rendezvous(kvroute.BaseStrategy):
    """Send each prefix to the candidate with the highest rendezvous score.

    Options:

    * ``prefix_length`` (1024-65536, default 4096): characters of routing text in the key
      (the request's affinity key replaces the text when the client sends one).
    """

    # An option: an attrs field built by kvroute.options. "--option prefix_length=2048" arrives as
    # the string "2048" and is converted; 12 is refused with a message naming the allowed range.
    prefix_length: int = int_option(DEFAULT_PREFIX_LENGTH, min=MIN_PREFIX_LENGTH, max=MAX_PREFIX_LENGTH)

    def pick(self, request: kvroute.RouteRequest, candidates: Sequence[kvroute.BackendState]) -> kvroute.Decision:
        # Synchronous and free of I/O: the router calls this under its lock for every request.
        key = prefix_key(request, self.prefix_length)
        best = max(candidates, key=lambda state: score(key, state.backend))
        return kvroute.Decision(best.backend, reason="rendezvous", key=key)
