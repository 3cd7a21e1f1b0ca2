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
