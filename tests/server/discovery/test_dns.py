"""The DNS discovery provider against a real dnsmasq on loopback (A/AAAA and SRV records, TTLs, failures)."""

from __future__ import annotations

import socket
from collections.abc import Callable

import anyio
import pytest

from kvroute.discovery import DiscoveredBackend, DiscoveryProvider
from kvroute.errors import ConfigError
from kvroute_server.fleet.providers.dns import DnsDiscovery
from tests.server.discovery import dnsmasq as dnsmasq_module
from tests.server.discovery.conftest import RecordingSink
from tests.server.discovery.dnsmasq import DOMAIN, Dnsmasq, Srv

NAME = f"vllm.{DOMAIN}"
SERVICE = f"_http._tcp.vllm.{DOMAIN}"
#: Every wait on the provider is bounded by this many seconds.
WAIT = 5.0

Factory = Callable[..., Dnsmasq]


def provider(server: Dnsmasq, target: str = f"{NAME}:8000", **options: object) -> DnsDiscovery:
    """A provider asking ``server``, re-resolving quickly unless the test says otherwise."""
    options = {"min_interval": 0.05, "max_interval": 0.2, "timeout": 1.0, **options}
    return DnsDiscovery.create(target=target, nameserver=server.nameserver, **options)


def ids(*addresses: str, port: int = 8000) -> list[str]:
    return [f"[{a}]:{port}" if ":" in a else f"{a}:{port}" for a in addresses]


class TestDnsDiscoveryCreate:
    """`DnsDiscovery.create`, the ``dns`` kind's factory: targets and options."""

    def test_name_and_port_target(self) -> None:
        """``NAME:PORT`` asks for addresses on that port and names the source ``dns:NAME:PORT``."""
        p = DnsDiscovery.create(target="vllm.default.svc.cluster.local:8000", nameserver="127.0.0.1:5353")
        assert (p.name, p.port, p.is_srv, p.source) == (
            "vllm.default.svc.cluster.local",
            8000,
            False,
            "dns:vllm.default.svc.cluster.local:8000",
        )
        assert isinstance(p, DiscoveryProvider)

    def test_srv_target(self) -> None:
        """``_service._proto.NAME`` asks for SRV records and takes no port."""
        p = DnsDiscovery.create(target="_http._tcp.vllm.default.svc", nameserver="127.0.0.1")
        assert (p.name, p.port, p.is_srv, p.source) == (
            "_http._tcp.vllm.default.svc",
            None,
            True,
            "dns:_http._tcp.vllm.default.svc",
        )

    def test_defaults(self) -> None:
        """Without options: re-resolve between 5 and 60 s, 2 s timeout, openai backends over http."""
        p = DnsDiscovery.create(target="vllm:8000", nameserver="10.96.0.10")
        assert (p.min_interval, p.max_interval, p.timeout, p.kind, p.models, p.scheme) == (
            5.0,
            60.0,
            2.0,
            "openai",
            frozenset(),
            "http",
        )

    def test_interval_is_the_lower_bound(self) -> None:
        """The common ``interval`` option sets ``min_interval`` when that is not given."""
        assert DnsDiscovery.create(target="vllm:8000", nameserver="127.0.0.1", interval=1.5).min_interval == 1.5

    @pytest.mark.parametrize(
        ("nameserver", "address", "port"),
        [("127.0.0.1", "127.0.0.1", 53), ("127.0.0.1:5353", "127.0.0.1", 5353), ("[::1]:5353", "::1", 5353)],
    )
    def test_nameserver_forms(self, nameserver: str, address: str, port: int) -> None:
        """``nameserver`` is ``IP``, ``IP:PORT`` or ``[IPv6]:PORT``."""
        (server,) = DnsDiscovery.create(target="vllm:8000", nameserver=nameserver).resolver.nameservers
        assert (getattr(server, "address", None), getattr(server, "port", None)) == (address, port)

    @pytest.mark.parametrize(
        ("options", "message"),
        [
            ({"target": "vllm"}, "expected NAME:PORT (A/AAAA records) or _service._proto.NAME"),
            ({"target": "vllm:0"}, "PORT in 1..65535 (got 'vllm:0')"),
            ({"target": ":8000"}, "got ':8000'"),
            ({"target": "_http._tcp.vllm:8000"}, "an SRV target takes its ports from the records"),
            ({"target": "_http.vllm"}, "got '_http.vllm'"),
            ({"target": "vllm:8000", "nameserver": "dns.local"}, "'nameserver': expected 'IP' or 'IP:PORT'"),
            ({"target": "vllm:8000", "nameserver": "127.0.0.1:99999"}, "PORT in 1..65535"),
            ({"target": "vllm:8000", "min_interval": 0}, "'min_interval' must be a positive number of seconds"),
            ({"target": "vllm:8000", "min_interval": 10, "max_interval": 5}, "'max_interval' must be >="),
            ({"target": "vllm:8000", "timeout": "2"}, "'timeout' must be a positive number"),
            ({"target": "vllm:8000", "scheme": "ftp"}, "'scheme' must be 'http' or 'https'"),
            ({"target": "vllm:8000", "models": "m"}, "'models' must be a list of model names"),
            ({"target": "vllm:8000", "ttl": 3}, "got unknown ttl"),
        ],
    )
    def test_bad_options(self, options: dict[str, object], message: str) -> None:
        """A bad target or option is a ConfigError saying what was expected and what was got."""
        options = {"nameserver": "127.0.0.1", **options}
        with pytest.raises(ConfigError) as caught:
            DnsDiscovery.create(**options)  # type: ignore[arg-type]
        assert message in str(caught.value)


@pytest.mark.anyio
class TestDnsDiscoveryRun:
    """`DnsDiscovery.run` following a real dnsmasq: A/AAAA and SRV answers, changes, TTLs and failures."""

    async def test_first_lookup_before_started(self, dnsmasq_factory: Factory, sink: RecordingSink) -> None:
        """``task_status.started()`` comes after the first lookup, whose snapshot carries every A and AAAA address."""
        server = dnsmasq_factory(hosts={NAME: ["127.0.0.3", "fd00::5", "127.0.0.2"]})
        p = provider(server, kind="vllm", models=["m1"], scheme="https", min_interval=30, max_interval=60)
        async with anyio.create_task_group() as tg:
            with anyio.fail_after(WAIT):
                await tg.start(p.run, sink)
            assert len(sink.events) == 1
            (snapshot,) = sink.published
            assert snapshot.source == f"dns:{NAME}:8000"
            assert snapshot.backends == (
                DiscoveredBackend("127.0.0.2:8000", "https://127.0.0.2:8000", "vllm", 1.0, frozenset({"m1"})),
                DiscoveredBackend("127.0.0.3:8000", "https://127.0.0.3:8000", "vllm", 1.0, frozenset({"m1"})),
                DiscoveredBackend("[fd00::5]:8000", "https://[fd00::5]:8000", "vllm", 1.0, frozenset({"m1"})),
            )
            tg.cancel_scope.cancel()

    async def test_sorted_by_address_whatever_the_answer_order(self, dnsmasq_factory: Factory) -> None:
        """Two providers publish the same sorted set, addresses in numeric order, whatever order dnsmasq answers in."""
        server = dnsmasq_factory(hosts={NAME: ["127.0.0.10", "127.0.0.9", "127.0.0.2"]})
        sinks = [RecordingSink(), RecordingSink()]
        async with anyio.create_task_group() as tg:
            for s in sinks:
                with anyio.fail_after(WAIT):
                    await tg.start(provider(server).run, s)
            tg.cancel_scope.cancel()
        assert sinks[0].published[0] == sinks[1].published[0]
        assert sinks[0].ids() == ids("127.0.0.2", "127.0.0.9", "127.0.0.10")

    async def test_scale_up_down_and_return(self, dnsmasq_factory: Factory, sink: RecordingSink) -> None:
        """2 -> 3 addresses grows the set, 3 -> 2 shrinks it, and a returning address comes back with the same id."""
        server = dnsmasq_factory(hosts={NAME: ["127.0.0.2", "127.0.0.3"]})
        async with anyio.create_task_group() as tg:
            with anyio.fail_after(WAIT):
                await tg.start(provider(server).run, sink)
            assert sink.ids() == ids("127.0.0.2", "127.0.0.3")
            await server.set_hosts({NAME: ["127.0.0.2", "127.0.0.3", "127.0.0.4"]})
            three = ids("127.0.0.2", "127.0.0.3", "127.0.0.4")
            await sink.until(lambda s: s.ids() == three, WAIT, "the third address published")
            await server.set_hosts({NAME: ["127.0.0.2", "127.0.0.4"]})
            await sink.until(lambda s: s.ids() == ids("127.0.0.2", "127.0.0.4"), WAIT, "127.0.0.3 gone")
            await server.set_hosts({NAME: ["127.0.0.4", "127.0.0.3", "127.0.0.2"]})
            await sink.until(lambda s: s.ids() == three, WAIT, "127.0.0.3 back as 127.0.0.3:8000")
            tg.cancel_scope.cancel()
        assert sink.failures == []

    async def test_server_stopped_then_back(self, dnsmasq_factory: Factory, sink: RecordingSink) -> None:
        """With the server down the provider reports failures and keeps running; once it is back it publishes again."""
        server = dnsmasq_factory(hosts={NAME: ["127.0.0.2", "127.0.0.3"]})
        async with anyio.create_task_group() as tg:
            with anyio.fail_after(WAIT):
                await tg.start(provider(server, timeout=0.3).run, sink)
            server.stop()
            await sink.until(lambda s: len(s.failures) >= 2, WAIT, "two failed lookups while dnsmasq is stopped")
            assert all(f.startswith(f"dns:{NAME}:8000: ") for f in sink.failures)
            published = len(sink.published)
            server.write_hosts({NAME: ["127.0.0.2", "127.0.0.3", "127.0.0.4"]})
            server.start()
            await sink.until(lambda s: len(s.published) > published, WAIT, "a snapshot once dnsmasq is back")
            assert sink.ids() == ids("127.0.0.2", "127.0.0.3", "127.0.0.4")
            tg.cancel_scope.cancel()

    @pytest.mark.parametrize(
        ("target", "reason"),
        [
            (f"nope.{DOMAIN}:8000", f"NXDOMAIN: nope.{DOMAIN} does not exist"),
            (f"only-srv.{DOMAIN}:8000", f"no A or AAAA records for only-srv.{DOMAIN}"),
            ("vllm.example:8000", "answered REFUSED"),
        ],
    )
    async def test_no_usable_answer_is_a_failure(
        self, dnsmasq_factory: Factory, sink: RecordingSink, target: str, reason: str
    ) -> None:
        """NXDOMAIN, an empty answer and REFUSED are failures (no snapshot), and the provider keeps asking."""
        server = dnsmasq_factory(hosts={NAME: ["127.0.0.2"]}, srv=[Srv(f"only-srv.{DOMAIN}", NAME, 8000)])
        async with anyio.create_task_group() as tg:
            with anyio.fail_after(WAIT):
                await tg.start(provider(server, target=target).run, sink)
            await sink.until(lambda s: len(s.failures) >= 2, WAIT, "a second failed lookup")
            tg.cancel_scope.cancel()
        assert sink.published == []
        assert reason in sink.failures[0], sink.failures[0]

    @pytest.mark.parametrize(
        ("name", "addresses", "refused"),
        [("only-a.example", ["127.0.0.2", "127.0.0.3"], "AAAA"), ("only-v6.example", ["fd00::5"], "A")],
    )
    async def test_one_family_answering_is_a_good_answer(
        self,
        dnsmasq_factory: Factory,
        sink: RecordingSink,
        name: str,
        addresses: list[str],
        refused: str,
    ) -> None:
        """A name outside dnsmasq's local domain has its hosts records answered and the other family REFUSED:
        the answering family's addresses are published, and the refused family is kept as its own failure."""
        server = dnsmasq_factory(hosts={name: addresses})
        p = provider(server, target=f"{name}:8000", min_interval=30, max_interval=60)
        async with anyio.create_task_group() as tg:
            with anyio.fail_after(WAIT):
                await tg.start(p.run, sink)
            tg.cancel_scope.cancel()
        assert server.queries(name, refused) >= 1
        assert sink.failures == []
        assert sink.ids() == ids(*addresses)
        assert list(p.family_errors) == [(name, refused)]
        assert "REFUSED" in p.family_errors[(name, refused)], p.family_errors

    async def test_both_families_failing_report_each(self, dnsmasq_factory: Factory, sink: RecordingSink) -> None:
        """When neither family has an address, the failure gives each family's own reason."""
        server = dnsmasq_factory(hosts={})
        p = provider(server, target="vllm.example:8000", min_interval=30, max_interval=60)
        async with anyio.create_task_group() as tg:
            with anyio.fail_after(WAIT):
                await tg.start(p.run, sink)
            tg.cancel_scope.cancel()
        (failure,) = sink.failures
        assert failure.startswith("dns:vllm.example:8000: no A or AAAA address for vllm.example (A: "), failure
        assert "; AAAA: " in failure and failure.count("REFUSED") == 2, failure

    async def test_nxdomain_then_name_appears(self, dnsmasq_factory: Factory, sink: RecordingSink) -> None:
        """A name that does not exist yet is published as soon as it does."""
        server = dnsmasq_factory(hosts={})
        async with anyio.create_task_group() as tg:
            with anyio.fail_after(WAIT):
                await tg.start(provider(server).run, sink)
            assert "NXDOMAIN" in sink.failures[0]
            await server.set_hosts({NAME: ["127.0.0.7"]})
            await sink.until(lambda s: s.ids() == ids("127.0.0.7"), WAIT, "the new name published")
            tg.cancel_scope.cancel()

    async def test_timeout(self, sink: RecordingSink) -> None:
        """A server that never answers is a timeout failure after ``timeout`` seconds, not a hang."""
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as silent:
            silent.bind(("127.0.0.1", 0))
            nameserver = f"127.0.0.1:{silent.getsockname()[1]}"
            p = DnsDiscovery.create(target=f"{NAME}:8000", nameserver=nameserver, timeout=0.3, min_interval=30)
            async with anyio.create_task_group() as tg:
                with anyio.fail_after(WAIT):
                    await tg.start(p.run, sink)
                tg.cancel_scope.cancel()
        assert sink.published == []
        assert sink.failures == [
            f"dns:{NAME}:8000: no A or AAAA address for {NAME} (A: timeout: no answer to {NAME} A within 0.3 s; "
            f"AAAA: timeout: no answer to {NAME} AAAA within 0.3 s)"
        ]

    async def test_short_ttl_change_seen_within_ttl(self, dnsmasq_factory: Factory, sink: RecordingSink) -> None:
        """With a 1 s TTL (and max_interval 60 s) a change is published within about the TTL."""
        server = dnsmasq_factory(ttl=1, hosts={NAME: ["127.0.0.2"]})
        async with anyio.create_task_group() as tg:
            with anyio.fail_after(WAIT):
                await tg.start(provider(server, min_interval=0.1, max_interval=60).run, sink)
            await server.set_hosts({NAME: ["127.0.0.2", "127.0.0.3"]})
            await sink.until(lambda s: s.ids() == ids("127.0.0.2", "127.0.0.3"), 2.5, "the change within ~1 s TTL")
            tg.cancel_scope.cancel()

    async def test_long_ttl_not_queried_before_it_expires(self, dnsmasq_factory: Factory, sink: RecordingSink) -> None:
        """With a 30 s TTL and min_interval 0.1 s, the name is asked once, not again within the next 2 s."""
        server = dnsmasq_factory(ttl=30, hosts={NAME: ["127.0.0.2"]})
        async with anyio.create_task_group() as tg:
            with anyio.fail_after(WAIT):
                await tg.start(provider(server, min_interval=0.1, max_interval=60).run, sink)
            await anyio.sleep(2.0)
            tg.cancel_scope.cancel()
        assert (server.queries(NAME, "A"), server.queries(NAME, "AAAA"), len(sink.published)) == (1, 1, 1)

    async def test_max_interval_caps_a_long_ttl(self, dnsmasq_factory: Factory, sink: RecordingSink) -> None:
        """With a 30 s TTL and max_interval 0.3 s, the name is asked again every 0.3 s."""
        server = dnsmasq_factory(ttl=30, hosts={NAME: ["127.0.0.2"]})
        async with anyio.create_task_group() as tg:
            with anyio.fail_after(WAIT):
                await tg.start(provider(server, min_interval=0.1, max_interval=0.3).run, sink)
            await sink.until(lambda s: len(s.published) >= 4, 3.0, "four lookups within 3 s")
            tg.cancel_scope.cancel()
        assert server.queries(NAME, "A") >= 4

    async def test_srv_ports_weights_and_priority(self, dnsmasq_factory: Factory, sink: RecordingSink) -> None:
        """SRV records give ports and weights (0 becomes 1), targets resolve to addresses, backup priorities are out."""
        hosts = {f"a.{DOMAIN}": ["127.0.0.2"], f"b.{DOMAIN}": ["127.0.0.3", "fd00::3"], f"c.{DOMAIN}": ["127.0.0.4"]}
        records = [
            Srv(SERVICE, f"a.{DOMAIN}", 8001, priority=0, weight=10),
            Srv(SERVICE, f"b.{DOMAIN}", 8002, priority=0, weight=0),
            Srv(SERVICE, f"c.{DOMAIN}", 8003, priority=1, weight=50),
        ]
        server = dnsmasq_factory(ttl=0, hosts=hosts, srv=records)
        async with anyio.create_task_group() as tg:
            with anyio.fail_after(WAIT):
                await tg.start(provider(server, target=SERVICE).run, sink)
            got = {(b.id, b.url, b.weight) for b in sink.published[-1].backends}
            assert got == {
                ("127.0.0.2:8001", "http://127.0.0.2:8001", 10.0),
                ("127.0.0.3:8002", "http://127.0.0.3:8002", 1.0),
                ("[fd00::3]:8002", "http://[fd00::3]:8002", 1.0),
            }
            assert sink.ids() == ["127.0.0.2:8001", "127.0.0.3:8002", "[fd00::3]:8002"]
            assert sink.published[-1].source == f"dns:{SERVICE}"
            # dnsmasq reads --srv-host only at start: a restart changes the records.
            server.restart([Srv(SERVICE, f"a.{DOMAIN}", 9001, weight=5), Srv(SERVICE, f"c.{DOMAIN}", 9003, weight=5)])
            want = ["127.0.0.2:9001", "127.0.0.4:9003"]
            await sink.until(lambda s: s.ids() == want, WAIT, "the restarted server's SRV records")
            tg.cancel_scope.cancel()

    async def test_srv_target_without_address_is_a_failure(self, dnsmasq_factory: Factory, sink: RecordingSink) -> None:
        """An SRV record whose target name does not resolve fails the lookup rather than publishing a partial set."""
        records = [Srv(SERVICE, f"a.{DOMAIN}", 8001), Srv(SERVICE, f"gone.{DOMAIN}", 8002)]
        server = dnsmasq_factory(hosts={f"a.{DOMAIN}": ["127.0.0.2"]}, srv=records)
        async with anyio.create_task_group() as tg:
            with anyio.fail_after(WAIT):
                await tg.start(provider(server, target=SERVICE).run, sink)
            tg.cancel_scope.cancel()
        assert sink.published == []
        assert sink.failures == [f"dns:{SERVICE}: SRV target of {SERVICE}: NXDOMAIN: gone.{DOMAIN}. does not exist"]

    async def test_unexpected_error_is_reported_not_raised(
        self, sink: RecordingSink, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """An unexpected error in a lookup is reported as a failure and the provider keeps looking."""
        p = DnsDiscovery.create(target=f"{NAME}:8000", nameserver="127.0.0.1", min_interval=0.05, max_interval=0.05)
        calls = 0

        async def broken(self: DnsDiscovery) -> tuple[tuple[DiscoveredBackend, ...], float]:
            nonlocal calls
            calls += 1
            raise RuntimeError(f"bug {calls}")

        monkeypatch.setattr(DnsDiscovery, "lookup", broken)
        async with anyio.create_task_group() as tg:
            with anyio.fail_after(WAIT):
                await tg.start(p.run, sink)
            await sink.until(lambda s: len(s.failures) >= 3, WAIT, "three reported failures")
            tg.cancel_scope.cancel()
        assert sink.failures[:2] == [
            f"dns:{NAME}:8000: unexpected RuntimeError: bug 1",
            f"dns:{NAME}:8000: unexpected RuntimeError: bug 2",
        ]


class TestDnsmasqFixture:
    """The dnsmasq fixture itself: a missing binary is a failure that says how to install it."""

    def test_missing_binary_fails_with_install_hint(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """Without dnsmasq on PATH or in /usr/sbin the tests fail (not skip), naming its package and tests/run."""
        monkeypatch.setattr(dnsmasq_module.shutil, "which", lambda *args, **kwargs: None)
        with pytest.raises(pytest.fail.Exception) as failure:
            dnsmasq_module.dnsmasq_binary()
        assert "`bash tests/run`" in str(failure.value)
        assert "apt-get install -y --no-install-recommends dnsmasq-base" in str(failure.value)
