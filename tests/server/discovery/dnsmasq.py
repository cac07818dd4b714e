"""A real dnsmasq on loopback, serving A/AAAA records from a hosts file the test rewrites, and SRV records.

A records change with `Dnsmasq.set_hosts` (the file is replaced, then SIGHUP makes dnsmasq re-read it);
SRV records come from ``--srv-host`` flags, which dnsmasq reads only at start, so `Dnsmasq.restart` changes
them. Names under ``kvroute.test`` are answered locally only (an unknown one is NXDOMAIN); any other name
is REFUSED, as there is no upstream server. Every query is logged (``--log-queries``) to a file the tests
count queries in. Only the process this object started is ever signalled or stopped.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

import anyio
import attrs
import pytest

__all__ = ["DOMAIN", "Dnsmasq", "Srv", "dnsmasq_binary", "free_dns_port"]

DOMAIN = "kvroute.test"
_STARTUP_SECONDS = 10.0


def dnsmasq_binary() -> str:
    """The dnsmasq executable, or a test failure that says how to install it (never a silent skip)."""
    found = shutil.which("dnsmasq") or shutil.which("dnsmasq", path="/usr/sbin:/sbin:/usr/local/sbin")
    if found is None:
        pytest.fail(
            "the DNS discovery tests need a real dnsmasq (expected it on PATH or in /usr/sbin, got none): install "
            "Debian's dnsmasq-base package; the README's test command `bash tests/run` does it when run as root, "
            "or run `apt-get update && apt-get install -y --no-install-recommends dnsmasq-base`.",
            pytrace=False,
        )
    return found


def free_dns_port() -> int:
    """A loopback port free for both UDP and TCP a moment ago (dnsmasq listens on both)."""
    for _ in range(50):
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp, socket.socket() as tcp:
            udp.bind(("127.0.0.1", 0))
            port = int(udp.getsockname()[1])
            try:
                tcp.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("expected a loopback port free for UDP and TCP; got none in 50 tries.")


@attrs.frozen
class Srv:
    """One SRV record: ``name`` (``_http._tcp.svc.kvroute.test``) points at ``target`` on ``port``."""

    name: str
    target: str
    port: int
    priority: int = 0
    weight: int = 0

    def flag(self) -> str:
        return f"--srv-host={self.name},{self.target},{self.port},{self.priority},{self.weight}"


@attrs.define
class Dnsmasq:
    """One dnsmasq process on ``127.0.0.1:port``; `start` it, `stop` it, `restart` it with other SRV records."""

    workdir: Path
    ttl: int = 0
    srv: tuple[Srv, ...] = ()
    port: int = attrs.field(factory=free_dns_port)
    process: subprocess.Popen[bytes] | None = None

    @property
    def hosts_file(self) -> Path:
        return self.workdir / "hosts"

    @property
    def log_file(self) -> Path:
        return self.workdir / "dnsmasq.log"

    @property
    def nameserver(self) -> str:
        """The provider's ``nameserver`` option for this server."""
        return f"127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_file.read_text(errors="replace") if self.log_file.exists() else ""

    def queries(self, name: str, rdtype: str = "A") -> int:
        """How many ``rdtype`` queries for ``name`` this server has received, across restarts."""
        return len(re.findall(rf"query\[{re.escape(rdtype)}\] {re.escape(name)} from ", self.log()))

    def write_hosts(self, records: Mapping[str, Iterable[str]]) -> None:
        """Replace the hosts file atomically: ``{"vllm.kvroute.test": ["127.0.0.2", "fd00::5"]}``."""
        lines = [f"{address} {name}" for name, addresses in records.items() for address in addresses]
        scratch = self.hosts_file.with_suffix(".new")
        scratch.write_text("".join(line + "\n" for line in lines))
        os.replace(scratch, self.hosts_file)

    async def set_hosts(self, records: Mapping[str, Iterable[str]]) -> None:
        """Serve these A/AAAA records from now on: rewrite the file, SIGHUP, wait until dnsmasq re-read it."""
        self.write_hosts(records)
        assert self.process is not None and self.process.poll() is None, "dnsmasq is not running"
        before = self._hosts_reads()
        self.process.send_signal(signal.SIGHUP)
        with anyio.fail_after(_STARTUP_SECONDS):
            while self._hosts_reads() <= before:  # noqa: ASYNC110 - the state lives in the dnsmasq process
                await anyio.sleep(0.02)

    def _hosts_reads(self) -> int:
        return self.log().count(f"read {self.hosts_file} - ")

    def start(self, srv: Sequence[Srv] | None = None) -> None:
        """Start dnsmasq on this object's port (the same across restarts); wait until it has read the hosts file."""
        if srv is not None:
            self.srv = tuple(srv)
        if not self.hosts_file.exists():
            self.write_hosts({})
        command = [
            dnsmasq_binary(),
            "--no-daemon",
            "--keep-in-foreground",
            "--conf-file=/dev/null",
            "--pid-file=",
            "--no-resolv",
            "--no-hosts",
            f"--addn-hosts={self.hosts_file}",
            f"--local=/{DOMAIN}/",
            f"--port={self.port}",
            "--listen-address=127.0.0.1",
            "--bind-interfaces",
            f"--local-ttl={self.ttl}",
            "--log-queries",
            "--log-facility=-",
            *(record.flag() for record in self.srv),
        ]
        reads = self._hosts_reads()
        with self.log_file.open("ab") as log:
            self.process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log, stderr=log)
        deadline = time.monotonic() + _STARTUP_SECONDS
        while self._hosts_reads() <= reads:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"expected dnsmasq to serve on 127.0.0.1:{self.port}; it exited with {self.process.returncode}:\n"
                    + self.log()[-2000:]
                )
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"expected dnsmasq to start within {_STARTUP_SECONDS} s; log:\n{self.log()[-2000:]}")
            time.sleep(0.02)

    def stop(self) -> None:
        """Stop the process this object started (SIGTERM, then SIGKILL if it lingers)."""
        process, self.process = self.process, None
        if process is None or process.poll() is not None:
            return
        process.terminate()
        try:
            process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=5)

    def restart(self, srv: Sequence[Srv] | None = None) -> None:
        """Stop and start again on the same port (how SRV records change: dnsmasq reads them only at start)."""
        self.stop()
        self.start(srv)
