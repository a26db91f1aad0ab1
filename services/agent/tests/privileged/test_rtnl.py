"""The raw rtnetlink requests of the pod hot path (``datapath.rtnl``) against the kernel,
inside a network namespace of the test's own (nothing on the host)."""

from __future__ import annotations

import subprocess
import uuid
from collections.abc import Iterator

import pytest
from pyroute2.netlink.exceptions import NetlinkError

from cilia_agent.datapath import rtnl
from cilia_testkit import netns

pytestmark = pytest.mark.privileged


@pytest.fixture
def ns() -> Iterator[str]:
    name = f"cilia-t-rtnl{uuid.uuid4().hex[:6]}"
    netns.create_netns(name)
    try:
        yield name
    finally:
        netns.delete_netns(name)


def ip(name: str, *args: str) -> str:
    return subprocess.run(
        ["ip", "-n", name, *args], check=True, capture_output=True, text=True
    ).stdout


def test_a_batch_runs_every_request_and_reports_each_outcome(ns: str) -> None:
    with rtnl.Rtnl.open_in(netns.netns_path(ns)) as sock:
        missing, lo, up = sock.request(
            rtnl.del_link("nosuchlink0"), rtnl.get_link("lo"), rtnl.set_up(1)
        )
        assert missing.error == 19  # ENODEV, and the requests after it still ran
        assert lo.error == 0 and rtnl.parse_link(lo.messages[0][1]).index == 1
        assert up.error == 0 and "UP" in ip(ns, "link", "show", "lo")
        (route,) = sock.request(rtnl.new_route("10.251.77.0", 24, 999))
        with pytest.raises(NetlinkError) as err:
            route.check("route 10.251.77.0/24")
        assert err.value.code == 19 and "route 10.251.77.0/24" in str(err.value)


def test_a_strict_route_dump_returns_only_the_asked_protocol(ns: str) -> None:
    ip(ns, "link", "set", "lo", "up")
    ip(ns, "addr", "add", "10.251.78.1/24", "dev", "lo")
    ip(ns, "route", "add", "10.251.79.0/24", "via", "10.251.78.2", "proto", "0xc1")
    ip(ns, "route", "add", "10.251.80.0/24", "via", "10.251.78.3", "proto", "static")
    path = netns.netns_path(ns)
    with rtnl.Rtnl.open_in(path) as sock:
        everything = [rtnl.parse_route(p) for p in sock.dump(rtnl.RTM_GETROUTE, rtnl.main_routes())]
    with rtnl.Rtnl.open_in(path, strict=True) as sock:
        ours = [
            rtnl.parse_route(p)
            for p in sock.dump(rtnl.RTM_GETROUTE, rtnl.main_routes(protocol=0xC1))
        ]
    assert {(r.dst, r.dst_len) for r in everything} >= {("10.251.79.0", 24), ("10.251.80.0", 24)}
    assert [(r.dst, r.dst_len, r.gateway, r.protocol) for r in ours] == [
        ("10.251.79.0", 24, "10.251.78.2", 0xC1)
    ]
