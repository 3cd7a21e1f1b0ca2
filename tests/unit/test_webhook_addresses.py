"""Where a webhook may go (app/domain/addresses.py): the hosts a tenant used to reach
batchgen's own network are refused, public ones pass, an operator's allow-list opens
ranges on purpose."""

from __future__ import annotations

import ipaddress

import pytest

from batchgen.domain.addresses import (
    first_refusal,
    is_local_name,
    literal_address,
    parse_nets,
    refusal,
)
from batchgen.errors import ValidationFailed
from batchgen.worker import webhooks


def _decide(host: str, allow: list[str] | None = None) -> str | None:
    if is_local_name(host):
        return refusal(ipaddress.ip_address("127.0.0.1"), parse_nets(allow or []))
    address = literal_address(host)
    assert address is not None, host
    return refusal(address, parse_nets(allow or []))


@pytest.mark.parametrize(
    ("host", "reason"),
    [
        ("127.0.0.1", "loopback"),
        ("localhost", "loopback"),
        ("LocalHost.", "loopback"),
        ("api.localhost", "loopback"),
        ("2130706433", "loopback"),  # 127.0.0.1 as one number
        ("0x7f000001", "loopback"),
        ("127.1", "loopback"),
        ("[::1]", "loopback"),
        ("::ffff:127.0.0.1", "loopback"),
        ("169.254.169.254", "metadata"),
        ("fd00:ec2::254", "metadata"),
        ("100.100.100.200", "metadata"),
        ("169.254.1.1", "link_local"),
        ("10.0.0.5", "private"),
        ("192.168.1.1", "private"),
        ("172.16.0.1", "private"),
        ("fc00::1", "private"),
        ("0.0.0.0", "unspecified"),
        ("224.0.0.1", "multicast"),
        ("240.0.0.1", "private"),  # reserved, and is_private in Python's table
        ("100.64.0.1", "not_global"),  # carrier-grade NAT
    ],
)
def test_internal_hosts_are_refused(host, reason):
    assert _decide(host) == reason


@pytest.mark.parametrize("host", ["93.184.215.14", "8.8.8.8", "2606:4700::1111"])
def test_public_addresses_pass(host):
    assert _decide(host) is None


def test_an_operator_allow_list_opens_ranges_on_purpose():
    assert _decide("127.0.0.1", ["127.0.0.0/8"]) is None
    assert _decide("localhost", ["127.0.0.1/32"]) is None
    assert _decide("10.20.3.4", ["10.20.0.0/16"]) is None
    assert _decide("10.21.0.1", ["10.20.0.0/16"]) == "private"
    # A metadata service stays shut by a range around it, opens only by its own address.
    assert _decide("169.254.169.254", ["169.254.0.0/16"]) == "metadata"
    assert _decide("169.254.169.254", ["169.254.169.254/32"]) is None


def test_a_host_with_one_bad_address_is_refused():
    public, private = ipaddress.ip_address("8.8.8.8"), ipaddress.ip_address("10.0.0.1")
    assert first_refusal([public, private]) == "private"
    assert first_refusal([public]) is None


def test_names_are_left_to_the_resolver_and_bad_cidrs_are_named():
    assert literal_address("hooks.example.com") is None
    assert not is_local_name("localhost.example.com")
    with pytest.raises(ValueError, match="not a CIDR network: 'ten'"):
        parse_nets(["ten"])


def _teredo(client: str, server: str = "65.54.227.120") -> str:
    """A Teredo address: 2001:0::/32, the server, flags and port, the client inverted."""
    inverted = int(ipaddress.IPv4Address(client)) ^ 0xFFFFFFFF
    value = (0x20010000 << 96) | (int(ipaddress.IPv4Address(server)) << 64) | inverted
    return str(ipaddress.IPv6Address(value))


def _six_to_four(v4: str) -> str:
    return str(ipaddress.IPv6Address((0x2002 << 112) | (int(ipaddress.IPv4Address(v4)) << 80)))


# Each IPv6 form that carries an IPv4 address, as a function of that address.
EMBEDDINGS = {
    "6to4": _six_to_four,
    "nat64": lambda v4: f"64:ff9b::{v4}",
    "nat64_local_96": lambda v4: f"64:ff9b:1::{v4}",
    "nat64_local_48": lambda v4: "64:ff9b:1:{:02x}{:02x}:{:02x}:{:02x}00::".format(
        *ipaddress.IPv4Address(v4).packed
    ),
    "ipv4_mapped": lambda v4: f"::ffff:{v4}",
    "ipv4_compatible": lambda v4: f"::{v4}",
    "teredo": _teredo,
    "isatap": lambda v4: f"2606:4700::5efe:{v4}",
}
EMBEDDED_REFUSALS = {
    "127.0.0.1": "loopback",
    "10.0.0.5": "private",
    "192.168.1.1": "private",
    "169.254.1.1": "link_local",
    "169.254.169.254": "metadata",
}


@pytest.mark.parametrize("form", sorted(EMBEDDINGS))
@pytest.mark.parametrize(("v4", "reason"), sorted(EMBEDDED_REFUSALS.items()))
def test_an_ipv6_form_carrying_a_refused_ipv4_address_is_refused(form, v4, reason):
    host = EMBEDDINGS[form](v4)
    assert _decide(f"[{host}]") == reason, host


@pytest.mark.parametrize("form", sorted(EMBEDDINGS))
def test_an_ipv6_form_carrying_a_public_ipv4_address_passes(form):
    host = EMBEDDINGS[form]("8.8.8.8")
    assert _decide(f"[{host}]") is None, host


def test_a_teredo_address_is_judged_by_its_server_too():
    assert _decide(_teredo("8.8.8.8", server="10.0.0.1")) == "private"


def test_an_embedded_address_is_refused_at_submit_and_at_delivery():
    url = "https://[2002:7f00:1::]/hook"  # 6to4 around 127.0.0.1
    with pytest.raises(ValidationFailed, match="its host is loopback"):
        webhooks.check_url(url, [])
    with pytest.raises(webhooks.Refused, match="loopback"):
        webhooks.resolve(url, [])
    assert webhooks.resolve("https://[2002:808:808::]/hook", []).address is not None


def test_deliveries_share_one_tls_context_that_checks_the_receiver():
    """One context per process (a client per delivery built its own), and it still
    checks the receiver's certificate and name."""
    import ssl

    context = webhooks._tls_context()
    assert context is webhooks._tls_context()
    assert context.verify_mode == ssl.CERT_REQUIRED and context.check_hostname
