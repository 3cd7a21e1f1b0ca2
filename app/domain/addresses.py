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
# IPv6 forms whose traffic ends at an IPv4 address written inside them: a translator or
# relay (NAT64, 6to4, Teredo) or the host's own stack (IPv4-compatible) carries it
# there, so the IPv4 address is what must pass.
NAT64 = ipaddress.IPv6Network("64:ff9b::/96")
NAT64_LOCAL = ipaddress.IPv6Network("64:ff9b:1::/48")  # RFC 8215, any prefix length
IPV4_COMPATIBLE = ipaddress.IPv6Network("::/96")
# RFC 6052 2.2: where the IPv4 address sits, per translator prefix length in bits, once
# bits 64-71 (the zero "u" octet) are left out of the address's 16 bytes.
NAT64_OFFSETS = {48: 6, 56: 7, 64: 8, 96: 11}
ISATAP_IDS = (b"\x00\x00\x5e\xfe", b"\x02\x00\x5e\xfe")  # interface id ::0:5efe:a.b.c.d
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


def _nat64_local(packed: bytes) -> list[ipaddress.IPv4Address]:
    """Every IPv4 address a 64:ff9b:1::/48 address may carry: the translator's prefix
    length is the operator's choice, so each layout whose suffix is zero counts (0.0.0.0,
    which no translator is asked for, is the zero bits of a layout that does not apply)."""
    octets = packed[:8] + packed[9:]  # without the u octet
    return [
        ipaddress.IPv4Address(octets[at : at + 4])
        for length, at in NAT64_OFFSETS.items()
        if any(octets[at : at + 4])
        and (length == 96 or (packed[8] == 0 and not any(octets[at + 4 :])))
    ]


def embedded_ipv4(address: ipaddress.IPv6Address) -> list[ipaddress.IPv4Address]:
    """The IPv4 addresses an IPv6 address leads to (IPv4-mapped, 6to4, Teredo's client
    and server, NAT64, IPv4-compatible, ISATAP), [] for a plain IPv6 address."""
    last32 = ipaddress.IPv4Address(address.packed[12:])
    if address.ipv4_mapped is not None:
        return [address.ipv4_mapped]
    if address.sixtofour is not None:
        return [address.sixtofour]
    if address.teredo is not None:
        server, client = address.teredo  # client already un-inverted
        return [client, server]
    if address in NAT64 or (address in IPV4_COMPATIBLE and int(address) > 1):  # not ::, ::1
        return [last32]
    if address in NAT64_LOCAL:
        return _nat64_local(address.packed)
    if address.packed[8:12] in ISATAP_IDS:
        return [last32]
    return []


def refusal(address: IPAddress, allow_nets: Sequence[IPNetwork] = ()) -> str | None:
    """Why a webhook must not be sent to ``address`` (``loopback``, ``private``,
    ``link_local``, ``multicast``, ``reserved``, ``metadata``, ``unspecified``,
    ``not_global``), or None: it may. An address inside ``allow_nets`` may, except a
    metadata service's unless that address itself is listed. An IPv6 address that
    carries IPv4 addresses (:func:`embedded_ipv4`) is judged by them."""
    if isinstance(address, ipaddress.IPv6Address):
        carried = embedded_ipv4(address)
        reason = first_refusal(carried, allow_nets)
        # An ISATAP address is routed by its own IPv6 prefix first, so that is judged too.
        if carried and (reason or address.packed[8:12] not in ISATAP_IDS):
            return reason
    return _own_refusal(address, allow_nets)


def _own_refusal(address: IPAddress, allow_nets: Sequence[IPNetwork]) -> str | None:
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
