"""`Shares` (the recent requests' window, the share cap, the keys' holders), the share option and `Rendezvous.head`."""

from __future__ import annotations

import pytest
from kvroute_consistent_hash import ConsistentHash, Rendezvous, Shares
from kvroute_consistent_hash.placement import HEAD
from kvroute_consistent_hash.shares import auto_window

from kvroute import Backend, ConfigError, Fleet, Router
from tests.helpers import chat


class TestShares:
    def test_cap_is_the_mtz_cap_on_the_window(self) -> None:
        """With 9 requests in the window (6 on a, 3 on b) and factor 1.1 over equal weights, each cap is
        ceil(1.1 x 10 / 2) = 6: a (6 + 1 > 6) has no room, b has."""
        shares = Shares(factor=1.1, window=100)
        for backend in "aaaaaabbb":
            shares.record(backend, ())
        assert (shares.count("a"), shares.count("b"), len(shares)) == (6, 3, 9)
        assert not shares.has_room("a", 1.0, 2.0) and shares.has_room("b", 1.0, 2.0)
        assert shares.has_room("a", 1.0, 2.0, slack=1.25)  # ceil(1.375 x 10 / 2) = 7

    def test_weights_scale_the_cap(self) -> None:
        """Weights 3 and 1, 7 requests (5 and 2): caps ceil(3 x 8 / 4) = 6 and ceil(8 / 4) = 2."""
        shares = Shares(factor=1.0, window=100)
        for backend in "hhhhhll":
            shares.record(backend, ())
        assert shares.has_room("h", 3.0, 4.0) and not shares.has_room("l", 1.0, 4.0)

    def test_an_empty_window_has_room_everywhere(self) -> None:
        """Before any request every backend has room (the cap is at least 1): placement is plain hashing."""
        assert Shares().has_room("x", 1.0, 64.0)

    def test_window_slides(self) -> None:
        """Past ``window`` requests the oldest leave the counts."""
        shares = Shares(window=4)
        for backend in "aaaab":
            shares.record(backend, ())
        assert (shares.count("a"), shares.count("b"), len(shares)) == (3, 1, 4)

    def test_automatic_window_follows_the_fleet(self) -> None:
        """With window 0 the size is 64 requests per member, at least 256, and shrinking drops the oldest."""
        shares = Shares()
        shares.resize(16)
        assert shares.size == auto_window(16) == 1024
        for _ in range(1000):
            shares.record("a", ())
        shares.resize(2)
        assert (shares.size, len(shares)) == (256, 256)

    def test_holders_are_the_last_backend_and_bounded(self) -> None:
        """A key's holder is where its last request went; beyond max_keys the least recently used is forgotten."""
        shares = Shares(max_keys=2)
        shares.record("a", (1, None))
        shares.record("b", (2,))
        shares.record("c", (1,))
        shares.record("d", (3,))
        assert (shares.holder(1), shares.holder(2), shares.holder(3)) == ("c", None, "d")

    def test_a_key_counts_once_per_backend(self) -> None:
        """Five requests placing key 7 on a and one each placing keys 8 and 9 on b: a holds 1 live key, b 2."""
        shares = Shares(window=100, key_factor=1.1)
        for backend, key in (("a", 7),) * 5 + (("b", 8), ("b", 9)):
            shares.record(backend, (), key)
        assert (shares.keys_on("a"), shares.keys_on("b"), shares.live_keys) == (1, 2, 3)
        assert (shares.count("a"), shares.count("b")) == (5, 2)

    def test_key_cap_is_the_mtz_cap_on_live_keys(self) -> None:
        """With 5 live keys (4 on a, 1 on b) and key_factor 1.0 over equal weights the cap is ceil(6 / 2) = 3: a has no
        room for a new key, b has, and a key already live on a adds nothing there."""
        shares = Shares(window=100, key_factor=1.0)
        for backend, key in (("a", 1), ("a", 2), ("a", 3), ("a", 4), ("b", 5)):
            shares.record(backend, (), key)
        assert not shares.has_key_room("a", 1.0, 2.0, 6) and shares.has_key_room("b", 1.0, 2.0, 6)
        assert shares.has_key_room("a", 1.0, 2.0, 4)
        assert Shares(window=100).has_key_room("a", 1.0, 2.0, 6)  # no key_factor: no cap

    def test_live_keys_expire_after_a_window_of_requests(self) -> None:
        """A key is live until ``window`` requests have started without placing it again on that backend."""
        shares = Shares(window=4, key_factor=1.1)
        shares.record("a", (), 1)
        shares.record("b", (), 2)
        shares.record("a", (), 1)  # key 1 renewed on a
        shares.record("b", ())
        shares.record("b", ())
        assert (shares.keys_on("a"), shares.keys_on("b")) == (1, 1)
        shares.record("b", ())  # 4 requests after key 2's only one
        assert (shares.keys_on("a"), shares.keys_on("b"), shares.live_keys) == (1, 0, 1)
        for _ in range(3):
            shares.record("b", ())
        assert shares.live_keys == 0

    def test_a_conversation_is_active_for_three_mean_gaps(self) -> None:
        """Conversations 1 and 2 with a request every 2 requests (mean gap 2, horizon 6): both active, on a and b;
        after 6 requests of neither they are not, and the horizon is the window before any gap is seen."""
        shares = Shares(window=100)
        assert shares.horizon == 100
        for backend, conversation in (("a", 1), ("b", 2)) * 3:
            shares.record(backend, ())
            shares.converse(backend, conversation)
        assert shares.horizon == 6
        assert (shares.active_on("a"), shares.active_on("b"), shares.active) == (1, 1, 2)
        for _ in range(5):
            shares.record("c", ())
        assert (shares.active_on("a"), shares.active_on("b")) == (0, 1)  # a's last request was 6 requests ago
        shares.record("c", ())
        assert (shares.active_on("b"), shares.active) == (0, 0)

    def test_a_moved_conversation_counts_on_its_new_backend_only(self) -> None:
        """A conversation whose next request goes to b is active on b and no longer on a."""
        shares = Shares(window=100)
        shares.record("a", ())
        shares.converse("a", 7)
        shares.record("b", ())
        shares.converse("b", 7)
        assert (shares.active_on("a"), shares.active_on("b"), shares.active) == (0, 1, 1)

    def test_conversation_room_is_the_share_of_the_active_conversations(self) -> None:
        """No room test before a conversation had a second request; then one more active conversation on a
        backend must stay within factor x its weight share: with a holding 3 of 4 active conversations (factor
        1.1, two backends of weight 1), a has no room (4 > ceil(1.1 x 5 / 2) = 3) and b has."""
        shares = Shares(factor=1.1, window=100)
        for backend, conversation in (("b", 4), ("a", 1), ("a", 2), ("a", 3)):
            shares.record(backend, ())
            shares.converse(backend, conversation)
        assert shares.has_conversation_room("a", 1.0, 2.0)  # single requests so far: nothing to go by
        shares.record("b", ())
        shares.converse("b", 4)  # conversation 4's second request, 4 requests on: mean gap 4, active for 12
        assert (shares.active_on("a"), shares.active_on("b")) == (3, 1)
        assert not shares.has_conversation_room("a", 1.0, 2.0)
        assert shares.has_conversation_room("b", 1.0, 2.0)

    def test_starved_is_under_the_share_over_factor_of_a_full_window(self) -> None:
        """Nobody is starved before the window is full; then a backend is when its count is under 1 / factor of its
        weight share: window 10, factor 1.25, two backends of weight 1, fair 5, floor 4 (3 is under it, 4 is not)."""
        shares = Shares(factor=1.25, window=10)
        for backend in "aaaaaaabb":
            shares.record(backend, ())
        assert not shares.is_starved("b", 1.0, 2.0)  # 9 of 10: not full yet
        shares.record("b", ())
        assert shares.is_starved("b", 1.0, 2.0) and not shares.is_starved("a", 1.0, 2.0)
        shares.record("b", ())  # the window drops an 'a': a 6, b 4
        assert not shares.is_starved("b", 1.0, 2.0)

    @pytest.mark.parametrize(("factor", "window", "keys"), [(0.9, 0, 1), (1.1, -1, 1), (1.1, 0, 0)])
    def test_bad_settings_are_refused(self, factor: float, window: int, keys: int) -> None:
        """A factor under 1, a negative window or no keys is a ValueError that names the setting."""
        with pytest.raises(ValueError, match="got"):
            Shares(factor=factor, window=window, max_keys=keys)

    def test_a_key_factor_under_one_is_refused(self) -> None:
        """key_factor under 1 is a ValueError that names it."""
        with pytest.raises(ValueError, match="key_factor"):
            Shares(key_factor=0.5)


class TestConsistentHashOption:
    def test_off_by_default_and_on_with_the_option(self) -> None:
        """consistent-hash keeps pure hashing by default; share_factor turns the bound on (prefix=messages only)."""
        assert ConsistentHash().shares is None
        assert ConsistentHash(share_factor=1.1).shares is not None
        assert ConsistentHash(share_factor=1.1, prefix="fixed").shares is None

    def test_bad_option_is_a_config_error(self) -> None:
        """share_factor under 1.0 is refused with what was expected and what was got."""
        with pytest.raises(ConfigError, match="share_factor"):
            Router.create(Fleet([Backend("a")]), "consistent-hash", {"share_factor": "0.5"})

    def test_a_new_conversation_skips_a_home_over_its_share(self) -> None:
        """With the bound on, 12 one-turn conversations under a new system prompt (too few to judge its group hot)
        spread over 4 backends, at most 5 on one; without it all 12 go to the system prompt's home."""
        for options, least, most in (({"share_factor": "1.1"}, 3, 5), ({}, 12, 12)):
            fleet = Fleet([Backend(f"b{i}") for i in range(4)])
            r = Router.create(fleet, "consistent-hash", options)
            counts: dict[str, int] = {}
            for n in range(12):
                lease = r.acquire(
                    chat([{"role": "system", "content": "be brief"}, {"role": "user", "content": f"q{n}"}])
                )
                counts[lease.backend.id] = counts.get(lease.backend.id, 0) + 1
                r.release(lease)
            assert least <= max(counts.values()) <= most, (options, counts)


class TestHead:
    @pytest.mark.parametrize("weights", [(1.0,) * 9, (1.0, 2.0, 0.5, 3.0, 1.0, 1.0, 2.0), (1.0, 1.0)])
    def test_head_is_the_start_of_the_ranking(self, weights: tuple[float, ...]) -> None:
        """`Rendezvous.head` (no full sort) is the first HEAD members of `ranking`, with or without its cache."""
        states = list(Fleet([Backend(f"b{i}", weight=w) for i, w in enumerate(weights)]))
        for cache_size in (0, 64):
            placement = Rendezvous(states, cache_size=cache_size)
            for key in range(0, 2**64, 2**57 + 12345):
                assert placement.head(key) == placement.ranking(key)[:HEAD]
