"""``--mtu 0`` (the default): the agents detect the MTU of the device carrying the node address
(issue 27) on a 2-node cluster whose LAN (bridge, veths) has MTU 1400.

Native routing: pods get 1400; VXLAN: 1350 (the 50-byte overhead), and the tunnel device as
well. The largest unfragmented echo crosses from a pod on one node to a pod on the other;
one byte more is refused at the sending pod ("message too long"), so nothing relies on
fragmentation or on a black-holed oversize packet.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable

import pytest

from cilia_testkit import cni
from cilia_testkit.cluster import ROUTING_MODES, Cluster
from cilia_testkit.host import sh

pytestmark = [pytest.mark.e2e, pytest.mark.privileged]

LAN_MTU = 1400
POD_MTU = {"native": 1400, "tunnel": 1350}


def _pod_mtu(pod: cni.Pod) -> int:
    out = sh("ip", "-n", pod.name, "-j", "link", "show", "dev", pod.ifname)
    return int(json.loads(out.stdout)[0]["mtu"])


def _df_ping(src: cni.Pod, dst: str, size: int) -> subprocess.CompletedProcess[str]:
    return sh(
        "ip", "netns", "exec", src.name,
        "ping", "-n", "-c", "1", "-W", "2", "-M", "do", "-s", str(size), dst,
        check=False,
    )  # fmt: skip


@pytest.mark.parametrize("mode", ROUTING_MODES)
def test_mtu_0_takes_the_lan_devices_mtu_and_a_full_size_echo_crosses_nodes(
    cluster: Callable[..., Cluster], mode: str
) -> None:
    c = cluster(nodes=2, routing=mode, mtu=LAN_MTU, relay=False, agent_args=("--mtu", "0"),
                name=f"e2e-mtu-{mode}")  # fmt: skip
    try:
        a = c.add_pod("node-a", f"mtu-{mode}-a")
        b = c.add_pod("node-b", f"mtu-{mode}-b")
        want = POD_MTU[mode]
        assert (_pod_mtu(a), _pod_mtu(b)) == (want, want), c.logs()
        if mode == "tunnel":
            assert {n.name: n.link_mtu("cilium_vxlan") for n in c.nodes.values()} == (
                dict.fromkeys(c.nodes, want)
            )
        assert c.wait_for(lambda: _df_ping(a, b.ip, want - 28).returncode == 0, 10), c.logs()
        too_big = _df_ping(a, b.ip, want - 27)
        assert too_big.returncode != 0 and "message too long" in too_big.stderr, too_big
    finally:
        c.stop()
