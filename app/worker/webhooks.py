"""Webhook targets and deliveries: resolve a URL's host and refuse what a tenant must not
reach (:mod:`batchgen.domain.addresses`), and POST to the address that was checked,
within one deadline.

The check runs at submit (a precise 400) and again at every delivery, where the
connection goes to the checked address itself (the URL's host stays in the ``Host``
header and the TLS server name), so a DNS answer that changes in between (DNS
rebinding) reaches nothing new. Redirects are not followed and no proxy from the
environment is used.
"""

from __future__ import annotations

import asyncio
import functools
import ipaddress
import socket
import ssl
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from urllib.parse import urlsplit, urlunsplit

import httpx

from batchgen.domain.addresses import (
    IPAddress,
    first_refusal,
    is_local_name,
    literal_address,
    parse_nets,
)
from batchgen.domain.notifications import check_webhook_url
from batchgen.errors import ValidationFailed


@dataclass(frozen=True)
class Target:
    """A webhook URL whose host resolved to ``address``, which may be reached."""

    url: str
    address: IPAddress


# Resolving blocks; it runs here so a deadline can leave a slow resolver behind
# (asyncio.run would wait for its own default executor's threads).
_RESOLVER = ThreadPoolExecutor(max_workers=4, thread_name_prefix="batchgen-webhook-dns")


class Refused(Exception):
    """The URL's host may not be reached (``reason``: loopback, private, ...) or does not
    resolve (``unresolved``)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def _addresses(host: str, port: int) -> list[IPAddress]:
    if is_local_name(host):  # this host, whatever a resolver says
        return [ipaddress.IPv4Address("127.0.0.1")]
    literal = literal_address(host)
    if literal is not None:
        return [literal]
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as exc:
        raise Refused("unresolved") from exc
    found: list[IPAddress] = []
    for info in infos:
        address = literal_address(str(info[4][0]))
        if address is not None and address not in found:
            found.append(address)
    if not found:
        raise Refused("unresolved")
    return found


def resolve(url: str, allow_nets: list[str]) -> Target:
    """The address to connect to for ``url``: every address its host resolves to must
    pass :func:`batchgen.domain.addresses.refusal`, else :class:`Refused`."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    addresses = _addresses(host, parts.port or (443 if parts.scheme == "https" else 80))
    reason = first_refusal(addresses, parse_nets(allow_nets))
    if reason is not None:
        raise Refused(reason)
    return Target(url=url, address=addresses[0])


def check_url(url: str | None, allow_nets: list[str], field: str = "webhook_url") -> str | None:
    """A submit's check of a webhook URL: its form, and where it leads (a precise
    :class:`ValidationFailed` for a host that is private, loopback, link-local, a
    metadata service, or does not resolve)."""
    checked = check_webhook_url(url, field)
    if checked is None:
        return None
    try:
        resolve(checked, allow_nets)
    except Refused as exc:
        if exc.reason == "unresolved":
            message = f"{field}'s host does not resolve"
        else:
            message = (
                f"{field} must lead to a public address; its host is {exc.reason.replace('_', '-')}"
                " (an operator can allow private networks with BATCHGEN_WEBHOOK_ALLOW_NETS)"
            )
        raise ValidationFailed(message, field=field) from exc
    return checked


def _pinned(target: Target) -> tuple[str, str, dict[str, str]]:
    """The URL with the checked address as its host, the ``Host`` header, the
    extensions that keep TLS checking the URL's own name."""
    parts = urlsplit(target.url)
    host = parts.hostname or ""
    ip = str(target.address)
    netloc_ip = f"[{ip}]" if target.address.version == 6 else ip
    if parts.port is not None:
        netloc_ip += f":{parts.port}"
    host_header = parts.netloc.rpartition("@")[2]
    extensions = {"sni_hostname": host} if parts.scheme == "https" else {}
    url = urlunsplit((parts.scheme, netloc_ip, parts.path or "/", parts.query, ""))
    return url, host_header, extensions


@functools.cache
def _tls_context() -> ssl.SSLContext:
    """The process's one TLS context for deliveries: making one reads the CA bundle
    (about 36 ms of CPU), which a client per delivery did every time."""
    return httpx.create_ssl_context(trust_env=False)


async def _post(target: Target, body: bytes, headers: dict[str, str], timeout_s: float) -> int:
    url, host_header, extensions = _pinned(target)
    async with httpx.AsyncClient(
        timeout=timeout_s, follow_redirects=False, trust_env=False, verify=_tls_context()
    ) as client:
        request = client.build_request(
            "POST",
            url,
            content=body,
            headers={**headers, "Host": host_header},
            extensions=extensions,
        )
        response = await client.send(request)
        await response.aread()  # the whole answer within the deadline
        return response.status_code


async def _deliver(
    url: str, body: bytes, headers: dict[str, str], allow_nets: list[str], timeout_s: float
) -> str | None:
    loop = asyncio.get_running_loop()
    target = await loop.run_in_executor(_RESOLVER, resolve, url, allow_nets)
    status_code = await _post(target, body, headers, timeout_s)
    return None if 200 <= status_code < 300 else f"http_{status_code}"


def post(
    url: str, body: bytes, headers: dict[str, str], allow_nets: list[str], timeout_s: float
) -> str | None:
    """POST ``body`` to ``url``; None when the receiver took it (2xx), else a code
    (``timeout``, ``refused_address``, ``unresolved``, ``unreachable``, ``http_<n>``).
    ``timeout_s`` bounds all of it: resolving, connecting, sending, reading the answer."""

    async def bounded() -> str | None:
        return await asyncio.wait_for(
            _deliver(url, body, headers, allow_nets, timeout_s), timeout_s
        )

    try:
        return asyncio.run(bounded())
    except TimeoutError:
        return "timeout"
    except Refused as exc:
        return "unresolved" if exc.reason == "unresolved" else "refused_address"
    except httpx.TimeoutException:
        return "timeout"
    except httpx.HTTPError:
        return "unreachable"
