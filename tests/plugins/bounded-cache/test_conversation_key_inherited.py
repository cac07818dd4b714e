"""The load-aware hash strategies key conversations as consistent-hash does (they inherit ``conversation_key``)."""

from __future__ import annotations

from kvroute_consistent_hash import ConsistentHash

from kvroute import Backend, Fleet, Router
from tests.helpers import chat


class TestConversationKeyInherited:
    def test_bounded_load_and_bounded_cache_key_conversations_alike(self) -> None:
        """bounded-load and bounded-cache give a long-preamble chat the conversation key consistent-hash gives."""
        request = chat([{"role": "system", "content": "s" * 9000}, {"role": "user", "content": "q"}])
        expected = Router.create(Fleet([Backend("a")]), "consistent-hash").strategy
        assert isinstance(expected, ConsistentHash)
        key = expected.conversation_key(request)
        assert key is not None
        for name in ("bounded-load", "bounded-cache"):
            other = Router.create(Fleet([Backend("a")]), name).strategy
            assert isinstance(other, ConsistentHash) and other.conversation_key(request) == key
