"""``--operator k8s:NAMESPACE/SERVICE`` against the real kube-apiserver of the test kit.

The agent's discovery (``controlplane/discovery.py``) reaches the API server the in-cluster
way (env ``KUBERNETES_SERVICE_HOST``/``_PORT`` and a service-account token, no kubeconfig),
lists the EndpointSlices of the operator's Service and gives gRPC the ready addresses:

- a slice with a dead address first and a live operator second: Register reaches the live one;
- not-ready endpoints are never dialled;
- the operator moves (the slice now lists another address and port, the old server stops):
  the next Register reaches the new one, with no restart of the client.

Operators are :class:`FakeOperator` gRPC servers on addresses of a veth pair the test adds
to the host (:data:`LIVE`, :data:`MOVED`; an EndpointSlice refuses loopback addresses);
:data:`DEAD` is on that veth's subnet but held by nobody (a connect gets no answer).
"""

from __future__ import annotations

import asyncio
import json
import pathlib
import secrets
import subprocess
import time
from collections.abc import Iterator
from typing import Any

import grpc
import pytest

from cilia.agent.v1 import agent_pb2
from cilia.controlplane.v1 import controlplane_pb2 as cp
from cilia.controlplane.v1 import controlplane_pb2_grpc as cp_grpc
from cilia_agent.config import Config
from cilia_agent.controlplane.discovery import (
    DiscoveredChannel,
    OperatorEndpoints,
    OperatorNotFound,
    discovered_channel,
)
from cilia_agent.controlplane.kubeapi import HOST_ENV, PORT_ENV, KubeClient, resolve_access
from cilia_common.tls import ServerTLS, generate_bundle, server_credentials
from cilia_testkit.kubeapi import KubeAPI, unique_name

from .conftest import Env
from .fake_operator import FakeOperator

SERVICE = "cilia-operator"
SUBNET = "10.251.250"
DEAD, LIVE, MOVED, NOT_READY = (f"{SUBNET}.{i}" for i in (2, 3, 4, 5))
#: Seconds a Register may take to land on a live operator (a failed connect, then the next).
REGISTER_SECONDS = 10.0


def _apply(kube: KubeAPI, *docs: dict[str, Any]) -> None:
    for doc in docs:
        out = kube.kubectl("apply", "-f", "-", input=json.dumps(doc), check=False)
        assert out.returncode == 0, out.stderr


def _slice(namespace: str, port: int, endpoints: list[tuple[str, bool]]) -> dict[str, Any]:
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "name": f"{SERVICE}-a",
            "namespace": namespace,
            "labels": {"kubernetes.io/service-name": SERVICE},
        },
        "addressType": "IPv4",
        "ports": [{"name": "grpc", "port": port, "protocol": "TCP"}],
        "endpoints": [{"addresses": [a], "conditions": {"ready": r}} for a, r in endpoints],
    }


@pytest.fixture
def operator_addresses() -> Iterator[None]:
    """:data:`LIVE` and :data:`MOVED` on a veth pair of the host (removed afterwards)."""
    name = f"ctd{secrets.token_hex(3)}"
    subprocess.run(["ip", "link", "add", name, "type", "veth", "peer", "name", f"{name}p"],
                   check=True)  # fmt: skip
    try:
        for address in (LIVE, MOVED):
            subprocess.run(["ip", "addr", "add", f"{address}/24", "dev", name], check=True)
        for dev in (name, f"{name}p"):
            subprocess.run(["ip", "link", "set", dev, "up"], check=True)
        yield
    finally:
        subprocess.run(["ip", "link", "del", name], check=False)


@pytest.fixture
def namespace(kube_apiserver: KubeAPI) -> Any:
    """A namespace with the operator's Service and an agent service account that may list
    EndpointSlices (as the chart's agent Role allows); deleted afterwards."""
    ns = unique_name("disc")
    kube = kube_apiserver
    _apply(
        kube,
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}},
        {"apiVersion": "v1", "kind": "ServiceAccount",
         "metadata": {"name": "cilia-agent", "namespace": ns}},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
         "metadata": {"name": "cilia-agent", "namespace": ns},
         "rules": [{"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"],
                    "verbs": ["list"]}]},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
         "metadata": {"name": "cilia-agent", "namespace": ns},
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                     "name": "cilia-agent"},
         "subjects": [{"kind": "ServiceAccount", "name": "cilia-agent", "namespace": ns}]},
        {"apiVersion": "v1", "kind": "Service", "metadata": {"name": SERVICE, "namespace": ns},
         "spec": {"ports": [{"name": "grpc", "port": 4250, "protocol": "TCP"}]}},
    )  # fmt: skip
    yield ns
    kube.kubectl("delete", "namespace", ns, "--wait=false", check=False)


def _service_account_dir(kube: KubeAPI, namespace: str, tmp: pathlib.Path) -> pathlib.Path:
    """``token`` (a real service-account token) and ``ca.crt``, as the kubelet mounts them."""
    token = kube.kubectl("create", "token", "cilia-agent", "-n", namespace).stdout.strip()
    (tmp / "token").write_text(token)
    (tmp / "ca.crt").write_bytes(kube.ca_file.read_bytes())
    return tmp


def _in_cluster_env(kube: KubeAPI) -> dict[str, str]:
    return {HOST_ENV: "127.0.0.1", PORT_ENV: str(kube.port)}


async def _register_somewhere(channel: DiscoveredChannel, node: str) -> None:
    """Register until one succeeds (the channel may still be failing over)."""
    stub = cp_grpc.NodeServiceStub(channel)  # type: ignore[no-untyped-call]
    deadline = time.monotonic() + REGISTER_SECONDS
    while True:
        try:
            await stub.Register(cp.RegisterRequest(node_name=node), timeout=2)
            return
        except Exception:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.2)


def test_the_agent_finds_the_live_operator_through_endpoint_slices_and_follows_a_move(
    kube_apiserver: KubeAPI, namespace: str, tmp_path: pathlib.Path, operator_addresses: None
) -> None:
    kube = kube_apiserver
    first = FakeOperator("10.251.200.0/24", host=LIVE)
    second = FakeOperator("10.251.201.0/24", host=MOVED)
    try:
        # dead first, live second, a not-ready one that must never be dialled
        _apply(kube, _slice(namespace, first.port,
                            [(DEAD, True), (LIVE, True), (NOT_READY, False)]))  # fmt: skip
        access = resolve_access(
            "",
            "",
            env=_in_cluster_env(kube),
            sa_dir=_service_account_dir(kube, namespace, tmp_path),
        )
        assert access.server == f"https://127.0.0.1:{kube.port}" and access.token_file
        endpoints = OperatorEndpoints(KubeClient(access, timeout=5), namespace, SERVICE)
        assert endpoints.list() == [f"{DEAD}:{first.port}", f"{LIVE}:{first.port}"]

        async def scenario() -> float:
            channel = DiscoveredChannel(endpoints, [], None, interval=30.0, min_gap=0.2)
            task = asyncio.create_task(channel.run())
            try:
                assert await channel.refresh()
                await _register_somewhere(channel, "node-1")
                assert [r.node_name for r in first.registrations] == ["node-1"]
                # the operator moves: another address and port; the old one goes away
                _apply(kube, _slice(namespace, second.port, [(MOVED, True)]))
                first.stop()
                moved = time.monotonic()
                await _register_somewhere(channel, "node-2")
                return time.monotonic() - moved
            finally:
                task.cancel()
                await channel.close()

        followed_in = asyncio.run(scenario())
        assert [r.node_name for r in second.registrations] == ["node-2"]
        assert [r.node_name for r in first.registrations] == ["node-1"]
        print(f"operator move followed in {followed_in:.2f}s")
    finally:
        first.stop()
        second.stop()


def test_a_service_without_ready_endpoints_is_reported_and_the_known_addresses_stay(
    kube_apiserver: KubeAPI, namespace: str, tmp_path: pathlib.Path
) -> None:
    kube = kube_apiserver
    _apply(kube, _slice(namespace, 4250, [(LIVE, False)]))
    access = resolve_access(
        "", "", env=_in_cluster_env(kube), sa_dir=_service_account_dir(kube, namespace, tmp_path)
    )
    endpoints = OperatorEndpoints(KubeClient(access, timeout=5), namespace, SERVICE)
    with pytest.raises(OperatorNotFound, match="no ready endpoint"):
        endpoints.list()

    async def scenario() -> list[str]:
        channel = DiscoveredChannel(endpoints, [], None, interval=30.0, min_gap=0.2)
        channel.apply(["127.0.0.9:4250"])
        assert not await channel.refresh()
        await channel.close()
        return channel.addresses

    assert asyncio.run(scenario()) == ["127.0.0.9:4250"]


def test_a_token_without_rights_is_refused_with_the_servers_reason(
    kube_apiserver: KubeAPI, namespace: str, tmp_path: pathlib.Path
) -> None:
    kube = kube_apiserver
    kube.kubectl("create", "serviceaccount", "nobody", "-n", namespace)
    (tmp_path / "token").write_text(
        kube.kubectl("create", "token", "nobody", "-n", namespace).stdout.strip()
    )
    (tmp_path / "ca.crt").write_bytes(kube.ca_file.read_bytes())
    access = resolve_access("", "", env=_in_cluster_env(kube), sa_dir=tmp_path)
    endpoints = OperatorEndpoints(KubeClient(access, timeout=5), namespace, SERVICE)
    with pytest.raises(OSError, match="HTTP 403"):
        endpoints.list()


def test_the_config_of_k8s_operator_builds_a_channel_from_a_kubeconfig(
    kube_apiserver: KubeAPI, namespace: str, operator_addresses: None
) -> None:
    kube = kube_apiserver
    live = FakeOperator("10.251.202.0/24", host=LIVE)
    try:
        _apply(kube, _slice(namespace, live.port, [(LIVE, True)]))
        cfg = Config(operator=f"k8s:{namespace}/{SERVICE}",
                     k8s_kubeconfig_path=str(kube.kubeconfig))  # fmt: skip

        async def scenario() -> None:
            channel = discovered_channel(cfg, [])
            try:
                assert await channel.refresh()
                await _register_somewhere(channel, "node-k")
            finally:
                await channel.close()

        asyncio.run(scenario())
        assert [r.node_name for r in live.registrations] == ["node-k"]
    finally:
        live.stop()


def test_an_agent_with_operator_k8s_registers_and_becomes_ready(
    kube_apiserver: KubeAPI, namespace: str, operator_addresses: None, env: Env
) -> None:
    """The whole agent (``--operator k8s:NS/SVC --k8s-kubeconfig-path``): its session
    registers with the operator the slice names and its node gets ready (allocation)."""
    kube = kube_apiserver
    op = FakeOperator(env.cidr, host=LIVE)
    try:
        _apply(kube, _slice(namespace, op.port, [(DEAD, True), (LIVE, True)]))
        agent = env.start_agent(
            static={},
            operator=f"k8s:{namespace}/{SERVICE}",
            k8s_kubeconfig_path=str(kube.kubeconfig),
            operator_reconnect_min_backoff=0.1,
            operator_reconnect_max_backoff=0.5,
        )
        deadline = time.monotonic() + REGISTER_SECONDS
        while not agent.debug.Status(agent_pb2.StatusRequest()).ready:
            assert time.monotonic() < deadline, "the agent did not get ready"
            time.sleep(0.1)
        assert env.config().node_name in {r.node_name for r in op.registrations}
    finally:
        env.cleanup()
        op.stop()


def test_mutual_tls_checks_the_service_name_while_dialling_the_discovered_address(
    kube_apiserver: KubeAPI, namespace: str, operator_addresses: None, tmp_path: pathlib.Path
) -> None:
    """The operator's certificate names only ``SERVICE.NAMESPACE.svc`` (no IP SAN): the
    discovered address is dialled and that name checked by default; another
    ``--tls-operator-server-name`` is refused."""
    kube = kube_apiserver
    bundle = generate_bundle(tmp_path, server_hosts=[f"{SERVICE}.{namespace}.svc"],
                             nodes=["n1"], days=1)  # fmt: skip
    credentials, _ = server_credentials(
        ServerTLS(bundle.server_cert, bundle.server_key, (bundle.ca_cert,))
    )
    live = FakeOperator("10.251.203.0/24", host=LIVE, credentials=credentials)
    cert, key = bundle.clients["node-n1"]
    tls = {"tls_operator_server_ca_files": [bundle.ca_cert],
           "tls_operator_client_cert_file": cert, "tls_operator_client_key_file": key}  # fmt: skip
    try:
        _apply(kube, _slice(namespace, live.port, [(LIVE, True)]))

        async def register(**overrides: Any) -> None:
            cfg = Config(node_name="n1", operator=f"k8s:{namespace}/{SERVICE}",
                         k8s_kubeconfig_path=str(kube.kubeconfig), **tls, **overrides)  # fmt: skip
            channel = discovered_channel(cfg, [])
            try:
                assert await channel.refresh()
                stub = cp_grpc.NodeServiceStub(channel)  # type: ignore[no-untyped-call]
                await stub.Register(cp.RegisterRequest(node_name="n1"), timeout=5)
            finally:
                await channel.close()

        asyncio.run(register())
        assert [r.node_name for r in live.registrations] == ["n1"]
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            asyncio.run(register(tls_operator_server_name="other.example"))
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        assert len(live.registrations) == 1
    finally:
        live.stop()
