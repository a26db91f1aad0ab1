"""CIDR policy with real packets: one agent (BPF on, in-process fake operator), one pod, and
an "external" netns reached from the pod through the host (veth, a random /24 X of the
benchmarking range 198.18.0.0/15 — 198.19.X.0/24 — never a pod address) holding two addresses, X.10 and X.130.

- NetworkPolicy egress ``ipBlock {cidr: X.0/24, except: [X.128/25]}``: the pod reaches
  X.10:8080 over TCP; X.130 is dropped (flow DROPPED, its destination named by the except
  prefix's CIDR identity).
- CiliumNetworkPolicy ingress ``fromCIDR: [X.10/32]``: X.10 connects to the pod; the same
  connect from X.130 is dropped.
- Deleting both policies removes the CIDR identities and their ipcache entries.
"""

from __future__ import annotations

import secrets
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import grpc
import pytest

from cilia.agent.v1 import agent_pb2
from cilia.hubble.flow import flow_pb2
from cilia.hubble.observer import observer_pb2, observer_pb2_grpc
from cilia_agent.identity.cidr import is_local_identity
from cilia_testkit import skips

from .conftest import AgentThread, Env, sh
from .fake_operator import FakeOperator
from .test_policy_datapath import SERVER, Pod, add_pod, wait

NET = f"198.19.{secrets.randbelow(250) + 1}"
HOST_IP, ALLOWED_IP, EXCEPTED_IP = f"{NET}.1", f"{NET}.10", f"{NET}.130"

NP = {
    "apiVersion": "networking.k8s.io/v1",
    "kind": "NetworkPolicy",
    "metadata": {"name": "egress-cidr", "namespace": "default"},
    "spec": {
        "podSelector": {"matchLabels": {"app": "client"}},
        "policyTypes": ["Egress"],
        "egress": [{"to": [{"ipBlock": {"cidr": f"{NET}.0/24", "except": [f"{NET}.128/25"]}}]}],
    },
}
CLIENT = """
import socket, sys
try:
    src = (sys.argv[2], 0) if sys.argv[2] else None
    s = socket.create_connection((sys.argv[1], 8080), timeout=1.0, source_address=src)
    sys.exit(0 if s.recv(2) == b"ok" else 3)
except OSError:
    sys.exit(1)
"""
CNP = {
    "apiVersion": "cilium.io/v2",
    "kind": "CiliumNetworkPolicy",
    "metadata": {"name": "ingress-cidr", "namespace": "default"},
    "spec": {
        "endpointSelector": {"matchLabels": {"app": "client"}},
        "ingress": [{"fromCIDR": [f"{ALLOWED_IP}/32"]}],
    },
}


@dataclass
class Setup:
    env: Env
    op: FakeOperator
    agent: AgentThread
    pod: Pod
    ext: str  # netns name of the external host

    def connect(self, netns: str, dst: str, src: str = "") -> bool:
        """A real TCP connect to ``dst``:8080 from ``netns`` (optionally from address ``src``)
        that reads the server's reply; 1 s timeout."""
        cmd = ["ip", "netns", "exec", netns, sys.executable, "-c", CLIENT, dst, src]
        return subprocess.run(cmd, capture_output=True, timeout=15).returncode == 0

    def apply(self, *manifests: dict[str, Any], delete: bool = False) -> None:
        enf = self.agent.agent.enforcement
        assert enf is not None
        before = enf.engine.repository.revision
        for m in manifests:
            if delete:
                self.op.delete_policy(m["kind"], "default", m["metadata"]["name"])
            else:
                self.op.apply_policy(m)
        wait(lambda: enf.engine.repository.revision >= before + len(manifests))

    def flows(self) -> list[flow_pb2.Flow]:
        sock = self.agent.config.hubble_socket_path()
        with grpc.insecure_channel(f"unix:{sock}") as ch:
            stub = observer_pb2_grpc.ObserverStub(ch)  # type: ignore[no-untyped-call]
            request = observer_pb2.GetFlowsRequest(number=4095)
            return [r.flow for r in stub.GetFlows(request, timeout=10) if r.HasField("flow")]


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    skips.require_bpf("netns, tc, BPF")
    env = Env(tmp_path_factory.mktemp("cidr"))
    op = FakeOperator(env.cidr)
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
        veth = f"cilia_x{env.tag}"  # removed with the netns holding its peer
        sh("ip", "link", "add", veth, "type", "veth", "peer", "name", "ext0", "netns", ext)
        sh("ip", "addr", "add", f"{HOST_IP}/24", "dev", veth)
        sh("ip", "link", "set", veth, "up")
        for address in (ALLOWED_IP, EXCEPTED_IP):
            sh("ip", "-n", ext, "addr", "add", f"{address}/24", "dev", "ext0")
        sh("ip", "-n", ext, "link", "set", "ext0", "up")
        sh("ip", "-n", ext, "route", "add", "default", "via", HOST_IP)
        for netns in (ext, pod.netns):
            servers.append(
                subprocess.Popen(["ip", "netns", "exec", netns, sys.executable, "-c", SERVER])
            )
        s = Setup(env, op, agent, pod, ext)
        wait(lambda: s.connect(pod.netns, EXCEPTED_IP) and s.connect(ext, pod.ip), 10)
        yield s
    finally:
        for server in servers:
            server.kill()
            server.wait()
        env.cleanup()
        op.stop()


def test_ipblock_except_and_from_cidr_with_real_tcp(setup: Setup) -> None:
    s = setup
    s.apply(NP, CNP)

    assert s.connect(s.pod.netns, ALLOWED_IP), "inside cidr, outside except: allowed"
    assert not s.connect(s.pod.netns, EXCEPTED_IP), "inside except: default deny"
    assert s.connect(s.ext, s.pod.ip, src=ALLOWED_IP), "fromCIDR X.10/32"
    assert not s.connect(s.ext, s.pod.ip, src=EXCEPTED_IP), "not in fromCIDR"

    def dropped(src: str, dst: str) -> list[flow_pb2.Flow]:
        return [
            f
            for f in s.flows()
            if f.verdict == flow_pb2.DROPPED and (f.IP.source, f.IP.destination) == (src, dst)
        ]

    wait(lambda: bool(dropped(s.pod.ip, EXCEPTED_IP)) and bool(dropped(EXCEPTED_IP, s.pod.ip)))
    out = dropped(s.pod.ip, EXCEPTED_IP)[0]
    assert out.drop_reason_desc == flow_pb2.POLICY_DENIED
    assert out.traffic_direction == flow_pb2.EGRESS
    assert is_local_identity(out.destination.identity)
    assert f"cidr:{NET}.128/25" in out.destination.labels
    assert f"cidr:{NET}.0/24" in out.destination.labels
    assert "reserved:world" in out.destination.labels
    into = dropped(EXCEPTED_IP, s.pod.ip)[0]
    assert into.traffic_direction == flow_pb2.INGRESS
    assert into.source.identity == out.destination.identity

    enf = s.agent.agent.enforcement
    assert enf is not None
    assert sorted(enf.ipcache.cidr_prefixes()) == [f"{NET}.0/24", f"{NET}.10/32", f"{NET}.128/25"]
    s.apply(NP, CNP, delete=True)
    assert enf.ipcache.cidr_prefixes() == {}
    assert enf.engine.identities.local_identities() == frozenset()
    assert s.connect(s.pod.netns, EXCEPTED_IP), "no policy left: nothing enforced"
