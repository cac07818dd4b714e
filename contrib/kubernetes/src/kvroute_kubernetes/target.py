"""What to follow: ``NAMESPACE/SERVICE:PORT``, and how a port is found in an EndpointSlice."""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

import attrs

__all__ = ["KubernetesTarget"]

# A Service name and a namespace are DNS-1123 labels; a port name is an IANA_SVC_NAME (lowercase
# letters, digits and dashes, at most 15 characters) or, in an EndpointSlice, the Service port's name.
_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
_PORT_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")


@attrs.frozen
class KubernetesTarget:
    """A Service's EndpointSlices and the port of its endpoints to send requests to.

    ``port`` is either a number (the port the pods listen on, as EndpointSlices list it: the
    Service's ``targetPort``) or a name (the Service port's ``name``, which EndpointSlices copy).
    """

    namespace: str
    service: str
    port: int | str

    @classmethod
    def parse(cls, text: str) -> KubernetesTarget:
        """``inference/vllm:8000`` or ``inference/vllm:http``; raise ValueError saying what was expected."""
        expected = "'NAMESPACE/SERVICE:PORT' such as 'inference/vllm:8000' or 'inference/vllm:http'"
        namespace, slash, rest = text.partition("/")
        service, colon, port = rest.rpartition(":")
        if not slash or not colon or not namespace or not service or not port:
            raise ValueError(f"kubernetes target must be {expected} (got {text!r}).")
        for what, value in (("namespace", namespace), ("service", service)):
            if not _NAME.match(value):
                raise ValueError(
                    f"kubernetes target's {what} must be a DNS-1123 label (lowercase letters, digits, '-'; "
                    f"at most 63 characters) (got {value!r} in {text!r})."
                )
        if port.isdigit():
            number = int(port)
            if not 1 <= number <= 65535:
                raise ValueError(f"kubernetes target's port must be between 1 and 65535 (got {number} in {text!r}).")
            return cls(namespace, service, number)
        if not _PORT_NAME.match(port):
            raise ValueError(
                f"kubernetes target's port must be a number or a port name (lowercase letters, digits, '-') "
                f"(got {port!r} in {text!r})."
            )
        return cls(namespace, service, port)

    @property
    def label_selector(self) -> str:
        """The selector the EndpointSlice controller's label makes possible."""
        return f"kubernetes.io/service-name={self.service}"

    def __str__(self) -> str:
        return f"{self.namespace}/{self.service}:{self.port}"

    def port_in(self, ports: Iterable[Any] | None) -> int | None:
        """The endpoints' port number in a slice's ``ports`` (`V1EndpointPort`-like), or None if it has none that fits.

        A number must equal a listed port; a name must equal a listed port's name. A listed port
        without a number (``port: null``) means "all ports" in the API and gives nothing to dial.
        """
        for port in ports or ():
            if port.port is None:
                continue
            if (port.port if isinstance(self.port, int) else port.name) == self.port:
                return int(port.port)
        return None
