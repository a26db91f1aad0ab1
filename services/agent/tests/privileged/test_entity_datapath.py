"""Entity rules with real packets: one agent (BPF on, in-process fake operator), one pod,
and an "external" netns reached from the pod through the host (veth, a random /24 X of the
benchmarking range 198.18.0.0/15 -- 198.18.X.0/24, apart from the CIDR test's 198.19.X.0/24)
holding three addresses, each a different kind of peer as the operator's ipcache stream
names it:

- X.10: an API server (identity 7, ``kube-apiserver``, as the operator publishes the ready
  addresses of ``default/kubernetes``'s EndpointSlices; no host IP: off the cluster);
- X.20: another node's address (identity 6, ``remote-node``);
- X.130: in no entry at all: ``world`` (2);

and this node's router IP (the pods' gateway, identity 1, ``host``: the agent's own address,
a server bound to it in the host's netns).

For each entity a CiliumNetworkPolicy egress ``toEntities: [<entity>]`` on the pod lets real
TCP connects reach exactly the addresses of that entity (upstream: ``pkg/policy/api/
entity.go``; identity 7 carries the ``remote-node`` label too, so ``remote-node`` and
``cluster`` include the API server):

=============== ======= ======= ======= =========
entity          X.10    X.20    X.130   router IP
=============== ======= ======= ======= =========
kube-apiserver  allowed dropped dropped dropped
world           dropped dropped allowed dropped
remote-node     allowed allowed dropped dropped
host            dropped dropped dropped allowed
cluster         allowed allowed dropped allowed
=============== ======= ======= ======= =========
"""

from __future__ import annotations

import secrets
import subprocess
import sys
from collections.abc import Iterator

import pytest

from cilia.agent.v1 import agent_pb2
from cilia.controlplane.v1 import controlplane_pb2 as cp
from cilia.hubble.flow import flow_pb2
from cilia_testkit import skips

from .conftest import Env, sh
from .fake_operator import FakeOperator
from .test_cidr_datapath import Setup
from .test_policy_datapath import SERVER, add_pod, wait

NET = f"198.18.{secrets.randbelow(250) + 1}"
HOST_IP, APISERVER_IP, NODE_IP, WORLD_IP = f"{NET}.1", f"{NET}.10", f"{NET}.20", f"{NET}.130"
KUBE_APISERVER, REMOTE_NODE, WORLD = 7, 6, 2

ROUTER = "router"  # stands for the router IP, known once the agent runs
EXPECTED = {
    "kube-apiserver": {APISERVER_IP},
    "world": {WORLD_IP},
    "remote-node": {APISERVER_IP, NODE_IP},
    "host": {ROUTER},
    "cluster": {APISERVER_IP, NODE_IP, ROUTER},
}
HOST_SERVER = """
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], 8080)); s.listen(64)
while True:
    c, _ = s.accept(); c.sendall(b"ok"); c.close()
"""


def router_ip(s: Setup) -> str:
    router = s.agent.agent.router_ip
    assert router is not None
    return str(router)


def egress_to(entity: str) -> dict[str, object]:
    return {
        "apiVersion": "cilium.io/v2",
        "kind": "CiliumNetworkPolicy",
        "metadata": {"name": f"to-{entity}", "namespace": "default"},
        "spec": {
            "endpointSelector": {"matchLabels": {"app": "client"}},
            "egress": [{"toEntities": [entity]}],
        },
    }


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    skips.require_bpf("netns, tc, BPF")
    env = Env(tmp_path_factory.mktemp("entity"))
    op = FakeOperator(env.cidr)
    op.set_ipcache_entry(cp.IPCacheEntry(cidr=f"{APISERVER_IP}/32", identity=KUBE_APISERVER))
    op.set_ipcache_entry(
        cp.IPCacheEntry(cidr=f"{NODE_IP}/32", identity=REMOTE_NODE, node_name="other-node")
    )
    servers: list[subprocess.Popen[bytes]] = []
    try:
        agent = env.start_agent(
            static={},
            enable_bpf=True,
            hubble_listen_address="127.0.0.1:0",
            operator=op.address,
            operator_reconnect_min_backoff=0.1,
            operator_reconnect_max_backoff=0.5,
        )
        wait(lambda: agent.debug.Status(agent_pb2.StatusRequest()).ready, 20)
        pod = add_pod(env, agent, "client", {"app": "client"})
        ext = env.add_netns().rsplit("/", 1)[1]
        veth = f"cilia_e{env.tag}"  # removed with the netns holding its peer
        sh("ip", "link", "add", veth, "type", "veth", "peer", "name", "ext0", "netns", ext)
        sh("ip", "addr", "add", f"{HOST_IP}/24", "dev", veth)
        sh("ip", "link", "set", veth, "up")
        for address in (APISERVER_IP, NODE_IP, WORLD_IP):
            sh("ip", "-n", ext, "addr", "add", f"{address}/24", "dev", "ext0")
        sh("ip", "-n", ext, "link", "set", "ext0", "up")
        sh("ip", "-n", ext, "route", "add", "default", "via", HOST_IP)
        servers.append(subprocess.Popen(["ip", "netns", "exec", ext, sys.executable, "-c", SERVER]))
        s = Setup(env, op, agent, pod, ext)
        # the host's netns is shared: bound to this agent's router IP only
        servers.append(subprocess.Popen([sys.executable, "-c", HOST_SERVER, router_ip(s)]))
        enf = agent.agent.enforcement
        assert enf is not None

        # the stream's entries are in the agent's ipcache before any policy counts on them
        def published(ip: str, identity: int) -> bool:
            entry = enf.ipcache.lookup(ip)
            return entry is not None and entry.identity == identity

        wait(lambda: published(APISERVER_IP, KUBE_APISERVER) and published(NODE_IP, REMOTE_NODE))
        peers = (APISERVER_IP, NODE_IP, WORLD_IP, router_ip(s))
        wait(lambda: all(s.connect(pod.netns, ip) for ip in peers))
        yield s
    finally:
        for server in servers:
            server.kill()
            server.wait()
        env.cleanup()
        op.stop()


@pytest.mark.parametrize("entity", list(EXPECTED))
def test_to_entities_allows_exactly_that_entitys_addresses(setup: Setup, entity: str) -> None:
    s = setup
    policy = egress_to(entity)
    s.apply(policy)
    try:
        peers = {APISERVER_IP: APISERVER_IP, NODE_IP: NODE_IP, WORLD_IP: WORLD_IP,
                 ROUTER: router_ip(s)}  # fmt: skip
        reached = {name for name, ip in peers.items() if s.connect(s.pod.netns, ip)}
        assert reached == EXPECTED[entity]
    finally:
        s.apply(policy, delete=True)
    assert s.connect(s.pod.netns, WORLD_IP), "no policy left: nothing enforced"


def test_flows_name_the_kube_apiserver_identity_and_world_for_the_dropped_address(
    setup: Setup,
) -> None:
    s = setup
    policy = egress_to("kube-apiserver")
    s.apply(policy)
    try:
        assert s.connect(s.pod.netns, APISERVER_IP)
        assert not s.connect(s.pod.netns, WORLD_IP)

        def flow(dst: str, verdict: int) -> flow_pb2.Flow | None:
            found = [
                f for f in s.flows()
                if f.verdict == verdict and (f.IP.source, f.IP.destination) == (s.pod.ip, dst)
            ]  # fmt: skip
            return found[-1] if found else None

        wait(lambda: flow(WORLD_IP, flow_pb2.DROPPED) is not None)
        dropped = flow(WORLD_IP, flow_pb2.DROPPED)
        assert dropped is not None and dropped.drop_reason_desc == flow_pb2.POLICY_DENIED
        assert dropped.destination.identity == WORLD
        wait(lambda: flow(APISERVER_IP, flow_pb2.FORWARDED) is not None)
        forwarded = flow(APISERVER_IP, flow_pb2.FORWARDED)
        assert forwarded is not None and forwarded.destination.identity == KUBE_APISERVER
        assert "reserved:kube-apiserver" in forwarded.destination.labels
    finally:
        s.apply(policy, delete=True)
