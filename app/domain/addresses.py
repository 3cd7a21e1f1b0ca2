"""Where a webhook may be sent: the address decision, pure (no DNS, no sockets).

A tenant names a webhook URL; batchgen's workers POST to it from inside the
operator's network. Without a check a tenant could make them reach the loopback
interface, the private network or a cloud metadata service (server-side request
forgery). A host is resolved by the caller (at submit and again at delivery, where
the socket connects only to an address that passed); every address it resolves to
must pass :func:`refusal`. An operator opens ranges on purpose with
``BATCHGEN_WEBHOOK_ALLOW_NETS`` (CIDRs), e.g. ``["10.20.0.0/16"]`` for an
in-house receiver.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Iterable, Sequence

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

# Cloud metadata services, refused by name of what they are (most are link-local or
# private too; these are refused even where a range around them is allowed).
METADATA_ADDRESSES = frozenset(
    ipaddress.ip_address(a)
    for a in ("169.254.169.254", "169.254.170.2", "100.100.100.200", "fd00:ec2::254")
)
# Names that mean this host whatever DNS says (RFC 6761).
LOCAL_NAMES = ("localhost", "localhost.localdomain", "ip6-localhost", "ip6-loopback")


def parse_nets(values: Iterable[str]) -> list[IPNetwork]:
    """CIDRs (``10.0.0.0/8``, ``::1/128``, a bare address) as networks; ValueError names
    the first bad one."""
    nets: list[IPNetwork] = []
    for value in values:
        try:
            nets.append(ipaddress.ip_network(str(value).strip(), strict=False))
        except ValueError as exc:
            raise ValueError(f"not a CIDR network: {value!r}") from exc
    return nets


def literal_address(host: str) -> IPAddress | None:
    """The address a host written as a number means (``127.0.0.1``, ``[::1]``, and the
    forms ``inet_aton`` accepts: ``2130706433``, ``0x7f000001``, ``127.1``), else None
    (a name, to be resolved)."""
    text = host.strip().strip("[]").rstrip(".")
    try:
        return ipaddress.ip_address(text.split("%", 1)[0])
    except ValueError:
        pass
    try:
        return ipaddress.IPv4Address(socket.inet_aton(text))  # pure parsing, no lookup
    except (OSError, ValueError):
        return None


def is_local_name(host: str) -> bool:
    """``localhost`` and any ``*.localhost`` name."""
    name = host.strip().rstrip(".").lower()
    return name in LOCAL_NAMES or name.endswith(".localhost")


def refusal(address: IPAddress, allow_nets: Sequence[IPNetwork] = ()) -> str | None:
    """Why a webhook must not be sent to ``address`` (``loopback``, ``private``,
    ``link_local``, ``multicast``, ``reserved``, ``metadata``, ``unspecified``,
    ``not_global``), or None: it may. An address inside ``allow_nets`` may, except a
    metadata service's unless that address itself is listed."""
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped  # ::ffff:127.0.0.1 is 127.0.0.1
    allowed = [net for net in allow_nets if address.version == net.version and address in net]
    if address in METADATA_ADDRESSES:
        return None if any(net.num_addresses == 1 for net in allowed) else "metadata"
    if allowed:
        return None
    checks = (
        ("unspecified", address.is_unspecified),
        ("loopback", address.is_loopback),
        ("link_local", address.is_link_local),
        ("multicast", address.is_multicast),
        ("private", address.is_private),
        ("reserved", address.is_reserved),
        ("not_global", not address.is_global),  # shared (100.64/10), documentation, ...
    )
    return next((reason for reason, hit in checks if hit), None)


def first_refusal(
    addresses: Iterable[IPAddress], allow_nets: Sequence[IPNetwork] = ()
) -> str | None:
    """The refusal of the first address that may not be reached (a host that resolves to
    one public and one private address is refused: either may be picked later)."""
    return next((r for r in (refusal(a, allow_nets) for a in addresses) if r), None)
