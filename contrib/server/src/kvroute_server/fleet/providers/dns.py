"""DNS discovery: the backends behind a name's A/AAAA records (with a configured port) or its SRV records.

Two target forms, told apart by the leading underscore:

- ``NAME:PORT`` (``vllm.default.svc.cluster.local:8000``): every A and AAAA address of ``NAME`` is a
  backend on ``PORT``, weight 1. A Kubernetes headless Service answers this way, one address per ready pod.
  The two families are asked independently: addresses of one are a good answer even when the other
  query failed (logged as ``dns_family_failed``); only when neither has an address is the lookup a
  failure, whose reason gives each family's own.
- ``_service._proto.NAME`` (``_http._tcp.vllm.default.svc.cluster.local``): every SRV record of the lowest
  priority in the answer is a backend; the port and weight come from the record, the record's target name is
  resolved to its A and AAAA addresses. SRV weight 0 becomes 1, the smallest positive SRV weight, so such a
  record gets a small share next to weighted ones and an equal share when every weight is 0. Records of higher
  (backup) priorities are ignored: kvroute's own health checks take unreachable backends out of rotation.

A backend's id is ``ADDRESS:PORT`` (``[ADDRESS]:PORT`` for IPv6), so a returning address gets its keys back,
and the set is published sorted, so replicas that see the same answer build the same membership. The name
is re-resolved after the answer's TTL clamped to ``[min_interval, max_interval]``. A failed lookup (timeout,
SERVFAIL, REFUSED, NXDOMAIN, no records) is reported to the sink, which keeps the last good set, and retried
after ``min_interval``; the provider never stops on its own.
"""

from __future__ import annotations

import ipaddress
import math
from collections.abc import Iterable, Mapping
from typing import Any

import anyio
import attrs
import dns.asyncresolver
import dns.exception
import dns.name
import dns.nameserver
import dns.rdatatype
import dns.resolver
import structlog

from kvroute.discovery import DiscoveredBackend, DiscoverySink, Snapshot
from kvroute.errors import ConfigError

__all__ = ["DnsDiscovery", "DnsLookupError"]

log = structlog.get_logger(__name__)

#: The smallest weight an SRV record can carry that is still positive; weight 0 maps to it.
SMALLEST_SRV_WEIGHT = 1
_Address = ipaddress.IPv4Address | ipaddress.IPv6Address


class DnsLookupError(Exception):
    """One lookup found no usable answer; ``reason`` says why (what the sink's ``failed`` receives)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@attrs.frozen
class _Endpoint:
    address: _Address
    port: int
    weight: float

    @property
    def id(self) -> str:
        host = f"[{self.address.compressed}]" if self.address.version == 6 else self.address.compressed
        return f"{host}:{self.port}"


@attrs.define
class DnsDiscovery:
    """Follows a DNS name; build it with `DnsDiscovery.create` (the ``dns`` discovery kind's factory)."""

    target: str
    #: The name to resolve: the host name of ``NAME:PORT``, or the SRV owner name.
    name: str
    #: The configured port of an A/AAAA target; ``None`` for SRV targets.
    port: int | None
    resolver: dns.asyncresolver.Resolver
    min_interval: float
    max_interval: float
    timeout: float
    kind: str = "openai"
    models: frozenset[str] = frozenset()
    scheme: str = "http"
    search: bool = False
    source: str = attrs.field(init=False)
    #: ``(name, "A" | "AAAA")`` -> why that family failed in the last lookup while the other answered.
    family_errors: dict[tuple[str, str], str] = attrs.field(init=False, factory=dict)

    def __attrs_post_init__(self) -> None:
        self.source = f"dns:{self.target}"

    @property
    def is_srv(self) -> bool:
        """Whether the target names SRV records (``_service._proto.NAME``) rather than ``NAME:PORT``."""
        return self.port is None

    @classmethod
    def create(
        cls,
        *,
        target: str,
        nameserver: str | None = None,
        min_interval: float | None = None,
        max_interval: float = 60.0,
        interval: float | None = None,
        timeout: float = 2.0,
        kind: str = "openai",
        models: Iterable[str] = (),
        scheme: str = "http",
        **unknown: Any,
    ) -> DnsDiscovery:
        """The ``dns`` kind's factory: validate the options of ``--discovery dns:TARGET`` or a ``[[discovery]]`` table.

        ``interval`` (the option every kind takes) is the lower bound ``min_interval`` when that is not given.
        ``nameserver`` is ``"IP"`` or ``"IP:PORT"`` (``"[IPv6]:PORT"``); without it the system resolver
        (``/etc/resolv.conf``, with its search list) is used.
        """
        if unknown:
            raise ConfigError(
                f"dns discovery options are target, nameserver, min_interval, max_interval, interval, timeout, "
                f"kind, models, scheme (got unknown {', '.join(sorted(unknown))})."
            )
        name, port = _parse_target(target)
        low = _positive("min_interval", min_interval if min_interval is not None else (interval or 5.0))
        high = _positive("max_interval", max_interval)
        if high < low:
            raise ConfigError(f"dns discovery: 'max_interval' must be >= 'min_interval' {low} (got {high}).")
        lifetime = _positive("timeout", timeout)
        if scheme not in ("http", "https"):
            raise ConfigError(f"dns discovery: 'scheme' must be 'http' or 'https' (got {scheme!r}).")
        if not isinstance(kind, str) or not kind:
            raise ConfigError(f"dns discovery: 'kind' must be a backend kind name (got {kind!r}).")
        if isinstance(models, str) or not all(isinstance(m, str) and m for m in models):
            raise ConfigError(f"dns discovery: 'models' must be a list of model names (got {models!r}).")
        if nameserver is None:
            try:
                resolver = dns.asyncresolver.Resolver(configure=True)
            except dns.exception.DNSException as exc:
                raise ConfigError(
                    f"dns discovery: no system resolver configuration ({exc}); set 'nameserver' (e.g. '10.96.0.10')."
                ) from exc
        else:
            resolver = dns.asyncresolver.Resolver(configure=False)
            resolver.nameservers = [dns.nameserver.Do53Nameserver(*_parse_nameserver(nameserver))]
        resolver.lifetime = lifetime
        resolver.timeout = lifetime
        return cls(
            target=target,
            name=name,
            port=port,
            resolver=resolver,
            min_interval=low,
            max_interval=high,
            timeout=lifetime,
            kind=kind,
            models=frozenset(models),
            scheme=scheme,
            search=nameserver is None,
        )

    async def run(self, sink: DiscoverySink, *, task_status: Any = anyio.TASK_STATUS_IGNORED) -> None:
        """Look up, publish (or report the failure), wait for the TTL within bounds, repeat until cancelled."""
        started = False
        while True:
            try:
                backends, ttl = await self.lookup()
            except DnsLookupError as failure:
                log.debug("dns_lookup_failed", source=self.source, reason=failure.reason)
                sink.failed(self.source, failure.reason)
                delay = self.min_interval
            except Exception as exc:  # never stop following the name: a surprise counts as a failed lookup
                reason = f"unexpected {type(exc).__name__}: {exc}"
                log.warning("dns_lookup_failed", source=self.source, reason=reason)
                sink.failed(self.source, reason)
                delay = self.min_interval
            else:
                # mypy cannot infer through attrs' bare `tuple`/`frozenset` converters in kvroute.discovery.
                sink.publish(Snapshot(self.source, backends))
                delay = min(max(ttl, self.min_interval), self.max_interval)
                log.debug("dns_lookup", source=self.source, backends=len(backends), ttl=ttl, next_in=delay)
            if not started:
                started = True
                task_status.started()
            await anyio.sleep(delay)

    async def lookup(self) -> tuple[tuple[DiscoveredBackend, ...], float]:
        """One resolution: the backends, sorted by address then port, and the answer's TTL in seconds.

        Raises `DnsLookupError` when there is no usable answer.
        """
        if self.port is None:
            endpoints, ttl = await self._srv_endpoints()
        else:
            addresses, ttl = await self._addresses(self.name)
            endpoints = [_Endpoint(a, self.port, 1.0) for a in addresses]
        merged: dict[tuple[_Address, int], _Endpoint] = {}
        for e in endpoints:  # two SRV records naming the same address and port: one backend, their weights added
            key = (e.address, e.port)
            seen = merged.get(key)
            merged[key] = e if seen is None else attrs.evolve(seen, weight=seen.weight + e.weight)
        ordered = sorted(merged.values(), key=lambda e: (e.address.version, int(e.address), e.port))
        return tuple(self._backend(e) for e in ordered), ttl

    def _backend(self, endpoint: _Endpoint) -> DiscoveredBackend:
        return DiscoveredBackend(
            id=endpoint.id,
            url=f"{self.scheme}://{endpoint.id}",
            kind=self.kind,
            weight=endpoint.weight,
            models=self.models,
        )

    async def _srv_endpoints(self) -> tuple[list[_Endpoint], float]:
        answer = (await self._resolve_all([(self.name, "SRV")]))[(self.name, "SRV")]
        if answer.rrset is None or not len(answer.rrset):
            raise DnsLookupError(f"no SRV records for {self.name}")
        records = [r for r in answer.rrset if r.target != dns.name.root]
        if not records:
            raise DnsLookupError(f"{self.name}: the service is not available here (SRV target '.')")
        first = min(r.priority for r in records)
        records = [r for r in records if r.priority == first]
        ttl = float(answer.chaining_result.minimum_ttl)
        targets = sorted({r.target.to_text() for r in records})
        resolved: dict[str, tuple[list[_Address], float] | DnsLookupError] = {}
        async with anyio.create_task_group() as tg:
            for target in targets:

                async def one(target: str = target) -> None:
                    try:
                        resolved[target] = await self._addresses(target)
                    except DnsLookupError as exc:
                        resolved[target] = exc

                tg.start_soon(one)
        endpoints: list[_Endpoint] = []
        for record in records:
            result = resolved[record.target.to_text()]
            if isinstance(result, DnsLookupError):
                raise DnsLookupError(f"SRV target of {self.name}: {result.reason}")
            addresses, target_ttl = result
            ttl = min(ttl, target_ttl)
            weight = float(record.weight or SMALLEST_SRV_WEIGHT)
            endpoints.extend(_Endpoint(a, int(record.port), weight) for a in addresses)
        return endpoints, ttl

    async def _addresses(self, name: str) -> tuple[list[_Address], float]:
        """The A and AAAA addresses of ``name`` and the smaller TTL of the answers that had some.

        The two families are independent: one that answers is a good answer even when the other
        failed (REFUSED for AAAA is what dnsmasq without an upstream and some resolvers say for a name
        with only A records). A family's failure beside a good answer is logged (``dns_family_failed``,
        once per new reason) and kept in ``family_errors``; when neither family has an address the
        lookup fails with each family's own reason.
        """
        results = await self._ask_all([(name, "A"), (name, "AAAA")])
        addresses: list[_Address] = []
        ttls: list[float] = []
        reasons: dict[str, str] = {}
        for (_, rdtype), result in results.items():
            if isinstance(result, BaseException):
                reasons[rdtype] = self._reason((name, rdtype), result)
            elif result.rrset is not None and len(result.rrset):
                addresses.extend(ipaddress.ip_address(r.address) for r in result.rrset)
                ttls.append(float(result.chaining_result.minimum_ttl))
        if not addresses:
            if not reasons:
                raise DnsLookupError(f"no A or AAAA records for {name}")
            nxdomain = [r for r in results.values() if isinstance(r, dns.resolver.NXDOMAIN)]
            if nxdomain:  # the name itself is missing: one reason says it for both families
                raise DnsLookupError(self._reason((name, "A"), nxdomain[0])) from nxdomain[0]
            words = "; ".join(f"{rdtype}: {reasons.get(rdtype, 'no records')}" for rdtype in ("A", "AAAA"))
            raise DnsLookupError(f"no A or AAAA address for {name} ({words})")
        self._note_families(name, reasons)
        return addresses, min(ttls)

    def _note_families(self, name: str, reasons: Mapping[str, str]) -> None:
        """Log each family that failed beside a good answer (once per new reason), and each that recovered."""
        for rdtype in ("A", "AAAA"):
            key = (name, rdtype)
            reason = reasons.get(rdtype)
            before = self.family_errors.get(key)
            if reason is None:
                if before is not None:
                    del self.family_errors[key]
                    log.info("dns_family_recovered", source=self.source, name=name, family=rdtype)
                continue
            if reason != before:
                self.family_errors[key] = reason
                log.warning("dns_family_failed", source=self.source, name=name, family=rdtype, reason=reason)

    async def _ask_all(
        self, questions: list[tuple[str, str]]
    ) -> dict[tuple[str, str], dns.resolver.Answer | BaseException]:
        """Ask every question at once; each gets its answer or the error it ended with."""
        results: dict[tuple[str, str], dns.resolver.Answer | BaseException] = {}

        async def ask(question: tuple[str, str]) -> None:
            name, rdtype = question
            try:
                results[question] = await self.resolver.resolve(
                    name, rdtype, raise_on_no_answer=False, search=self.search
                )
            except (dns.exception.DNSException, OSError) as exc:
                results[question] = exc

        async with anyio.create_task_group() as tg:
            for question in questions:
                tg.start_soon(ask, question)
        return {question: results[question] for question in questions}

    async def _resolve_all(self, questions: list[tuple[str, str]]) -> Mapping[tuple[str, str], dns.resolver.Answer]:
        """Ask every question at once; any answer that is an error (not an empty one) fails the whole lookup."""
        answers: dict[tuple[str, str], dns.resolver.Answer] = {}
        for question, result in (await self._ask_all(questions)).items():
            if isinstance(result, BaseException):
                raise DnsLookupError(self._reason(question, result)) from result
            answers[question] = result
        return answers

    def _reason(self, question: tuple[str, str], exc: BaseException) -> str:
        name, rdtype = question
        if isinstance(exc, dns.resolver.NXDOMAIN):
            return f"NXDOMAIN: {name} does not exist"
        if isinstance(exc, dns.exception.Timeout):
            return f"timeout: no answer to {name} {rdtype} within {self.timeout:g} s"
        if isinstance(exc, dns.resolver.NoNameservers):  # SERVFAIL, REFUSED, connection refused...
            return f"no server answered {name} {rdtype}: {exc}"
        return f"{type(exc).__name__} for {name} {rdtype}: {exc}"


def _parse_target(target: str) -> tuple[str, int | None]:
    expected = "expected NAME:PORT (A/AAAA records) or _service._proto.NAME (SRV records)"
    if not isinstance(target, str) or not target:
        raise ConfigError(f"dns discovery target: {expected} (got {target!r}).")
    if target.startswith("_"):
        if ":" in target:
            raise ConfigError(
                f"dns discovery target: an SRV target takes its ports from the records; {expected} (got {target!r})."
            )
        labels = target.rstrip(".").split(".")
        if len(labels) < 3 or not labels[1].startswith("_"):
            raise ConfigError(f"dns discovery target: {expected} (got {target!r}).")
        return _checked_name(target, expected), None
    name, colon, port = target.rpartition(":")
    if not colon or not name or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ConfigError(f"dns discovery target: {expected}, PORT in 1..65535 (got {target!r}).")
    return _checked_name(name, expected), int(port)


def _checked_name(name: str, expected: str) -> str:
    try:
        dns.name.from_text(name)
    except dns.exception.DNSException as exc:
        raise ConfigError(f"dns discovery target: {expected} (got {name!r}: {exc}).") from exc
    return name


def _parse_nameserver(value: str) -> tuple[str, int]:
    expected = "expected 'IP' or 'IP:PORT' ('[IPv6]:PORT')"
    host, port = value, "53"
    if value.startswith("["):
        host, bracket, rest = value[1:].partition("]")
        if not bracket or (rest and not rest.startswith(":")):
            raise ConfigError(f"dns discovery 'nameserver': {expected} (got {value!r}).")
        port = rest[1:] or "53"
    elif value.count(":") == 1:
        host, _, port = value.partition(":")
    try:
        address = ipaddress.ip_address(host)
    except ValueError as exc:
        raise ConfigError(f"dns discovery 'nameserver': {expected} (got {value!r}).") from exc
    if not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ConfigError(f"dns discovery 'nameserver': {expected}, PORT in 1..65535 (got {value!r}).")
    return address.compressed, int(port)


def _positive(option: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
        raise ConfigError(f"dns discovery: {option!r} must be a positive number of seconds (got {value!r}).")
    return float(value)
