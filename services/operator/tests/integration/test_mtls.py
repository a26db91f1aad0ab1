"""Mutual TLS and authorisation of the operator's gRPC listener, over real TLS on loopback.

The operator runs in this process (``Operator``, real Redis) or as a ``cilia-operator serve``
process (CLI, rotation); every certificate comes from :func:`cilia_common.tls.generate_bundle`
(what ``cilia-operator certs generate`` writes). An agent identity is
``CN=system:node:<node>, O=system:nodes``, an admin one ``O=system:masters``.
"""

from __future__ import annotations

import base64
import contextlib
import datetime
import json
import pathlib
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Iterator
from typing import Any

import grpc
import pytest
from cluster import operator_settings
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from grpc_health.v1 import health_pb2, health_pb2_grpc
from stores import kube_cilia

from cilia.controlplane.v1 import controlplane_pb2 as pb
from cilia.controlplane.v1 import controlplane_pb2_grpc as pb_grpc
from cilia_common import grpcerrors
from cilia_common.tls import ClientTLS, GeneratedBundle, channel_credentials, generate_bundle
from cilia_operator.app import Operator
from cilia_operator.config import Config
from cilia_testkit import procs
from cilia_testkit.kubeapi import KubeAPI

__all__ = ["kube_cilia"]  # the fixture, imported from stores

#: Seconds kube-controller-manager gets to sign an approved CSR.
CSR_SIGNED_SECONDS = 30
POOL = "default=ipv4-cidrs:10.231.0.0/16;ipv4-mask-size:24"
POLICY = """\
apiVersion: cilium.io/v2
kind: CiliumNetworkPolicy
metadata: {name: allow-web, namespace: default}
spec:
  endpointSelector: {matchLabels: {app: web}}
  ingress: [{fromEndpoints: [{matchLabels: {app: client}}]}]
"""


@pytest.fixture(scope="module")
def bundle(tmp_path_factory: pytest.TempPathFactory) -> GeneratedBundle:
    """CA, server pair (127.0.0.1, localhost), clients node-n1, node-n2, admin, viewer."""
    return generate_bundle(
        tmp_path_factory.mktemp("tls"),
        server_hosts=["127.0.0.1", "localhost"],
        nodes=["n1", "n2"],
        admins=["admin"],
        days=1,
    )


def _client(bundle: GeneratedBundle, name: str, ca: str = "") -> ClientTLS:
    cert, key = bundle.clients[name]
    return ClientTLS((ca or bundle.ca_cert,), cert, key)


def _config(redis_url: str, bundle: GeneratedBundle, **overrides: Any) -> Config:
    tls = {
        "auto_create_cilium_pod_ip_pools": [POOL],
        "tls_cert_file": bundle.server_cert,
        "tls_key_file": bundle.server_key,
        "tls_client_ca_files": [bundle.ca_cert],
    }
    return Config(**operator_settings(redis_url, **{**tls, **overrides}))


class Clients:
    """aio channels to one operator, one per client identity (closed together)."""

    def __init__(self, op: Operator, bundle: GeneratedBundle) -> None:
        self.op, self.bundle = op, bundle
        self._channels: list[grpc.aio.Channel] = []

    def channel(self, tls: ClientTLS | None) -> grpc.aio.Channel:
        if tls is None:
            ch = grpc.aio.insecure_channel(self.op.address)
        else:
            ch = grpc.aio.secure_channel(self.op.address, channel_credentials(tls))
        self._channels.append(ch)
        return ch

    def of(self, name: str) -> grpc.aio.Channel:
        return self.channel(_client(self.bundle, name))

    async def close(self) -> None:
        for ch in self._channels:
            await ch.close()


@contextlib.asynccontextmanager
async def tls_operator(
    redis_url: str, bundle: GeneratedBundle, **overrides: Any
) -> AsyncIterator[Clients]:
    op = Operator(_config(redis_url, bundle, **overrides))
    await op.start()
    clients = Clients(op, bundle)
    try:
        yield clients
    finally:
        await clients.close()
        await op.stop()


async def _denied(call: Awaitable[Any]) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call
    exc = caught.value
    assert exc.code() == grpc.StatusCode.PERMISSION_DENIED, exc.details()
    info = grpcerrors.error_info(exc)
    assert info is not None and info.reason == "PERMISSION_DENIED"
    assert info.domain == grpcerrors.OPERATOR_DOMAIN
    return exc


async def _refused_at_handshake(channel: grpc.aio.Channel) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await pb_grpc.ResourceServiceStub(channel).List(
            pb.ListRequest(kind="ciliumnodes"), timeout=5
        )
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE, caught.value.details()


async def test_agent_identity_registers_its_node_and_receives_its_allocation(
    redis_url: str, bundle: GeneratedBundle
) -> None:
    async with tls_operator(redis_url, bundle) as clients:
        n1 = clients.of("node-n1")
        resp = await pb_grpc.NodeServiceStub(n1).Register(
            pb.RegisterRequest(node_name="n1", addresses=["192.0.2.1"]), timeout=10
        )
        assert resp.default_pool == "default"
        ipam = pb_grpc.IPAMServiceStub(n1)
        await ipam.UpdateDemand(
            pb.UpdateDemandRequest(
                node_name="n1", demands=[pb.PoolDemand(pool="default", needed_ipv4=1)]
            ),
            timeout=10,
        )
        stream = ipam.WatchAllocations(pb.WatchAllocationsRequest(node_name="n1"), timeout=20)
        async for message in stream:
            if message.allocation.pools:
                break
        assert message.allocation.node_name == "n1"
        assert message.allocation.pools[0].cidrs[0].startswith("10.231.")
        ident = await pb_grpc.IdentityServiceStub(n1).Allocate(
            pb.AllocateRequest(node_name="n1", labels=["k8s:app=web"]), timeout=10
        )
        assert ident.identity.id >= 256
        # reads and watches: any authenticated client
        listed = await pb_grpc.ResourceServiceStub(n1).List(pb.ListRequest(kind="ciliumnodes"))
        assert len(listed.items) == 1


async def test_agent_identity_cannot_write_another_nodes_records(
    redis_url: str, bundle: GeneratedBundle
) -> None:
    async with tls_operator(redis_url, bundle) as clients:
        n1 = clients.of("node-n1")
        node, ipam, ident = (pb_grpc.NodeServiceStub(n1), pb_grpc.IPAMServiceStub(n1),
                             pb_grpc.IdentityServiceStub(n1))  # fmt: skip
        exc = await _denied(
            node.Register(pb.RegisterRequest(node_name="n2", addresses=["192.0.2.2"]))
        )
        assert "'n1' may not act for node 'n2'" in (exc.details() or "")
        await _denied(ipam.UpdateDemand(pb.UpdateDemandRequest(
            node_name="n2", demands=[pb.PoolDemand(pool="default", needed_ipv4=1)])))  # fmt: skip
        await _denied(ident.Allocate(pb.AllocateRequest(node_name="n2", labels=["k8s:app=x"])))
        await _denied(ident.Release(pb.ReleaseRequest(node_name="n2", id=256)))
        await _denied(ident.Allocate(pb.AllocateRequest(node_name="", labels=["k8s:app=x"])))
        stream = ipam.WatchAllocations(pb.WatchAllocationsRequest(node_name="n2"))
        await _denied(stream.read())
        # nothing changed: no CiliumNode n2, no identity
        assert (await clients.op.store.list("CiliumNode")).items == []
        assert (await clients.op.store.list("CiliumIdentity")).items == []


async def test_agent_identity_cannot_write_another_nodes_endpoints(
    redis_url: str, bundle: GeneratedBundle
) -> None:
    async with tls_operator(redis_url, bundle) as clients:
        n1, n2 = clients.of("node-n1"), clients.of("node-n2")
        await pb_grpc.NodeServiceStub(n2).Register(
            pb.RegisterRequest(node_name="n2", addresses=["192.0.2.2"])
        )
        b = pb.EndpointRecord(namespace="default", name="pod-b", node_name="n2",
                              ipv4="10.231.1.5", identity=300, container_id="cid-b")  # fmt: skip
        await pb_grpc.EndpointServiceStub(n2).UpsertEndpoint(pb.UpsertEndpointRequest(endpoint=b))
        before = await clients.op.store.list("CiliumEndpoint")
        assert len(before.items) == 1
        endpoints = pb_grpc.EndpointServiceStub(n1)
        hijack = pb.EndpointRecord()
        hijack.CopyFrom(b)
        hijack.ipv4 = "10.231.1.6"
        await _denied(endpoints.UpsertEndpoint(pb.UpsertEndpointRequest(endpoint=hijack)))
        await _denied(endpoints.DeleteEndpoint(
            pb.DeleteEndpointRequest(namespace="default", name="pod-b", node_name="n2")))  # fmt: skip
        # no node name means "any owner": only the owner's node (or an admin) may say that
        await _denied(
            endpoints.DeleteEndpoint(pb.DeleteEndpointRequest(namespace="default", name="pod-b"))
        )
        # n1's own node name with n2's pod name (the name was reused on n1): the record
        # stays n2's, whatever n1 sends
        takeover = pb.EndpointRecord()
        takeover.CopyFrom(hijack)
        takeover.node_name = "n1"
        exc = await _denied(endpoints.UpsertEndpoint(pb.UpsertEndpointRequest(endpoint=takeover)))
        assert "endpoint default/pod-b: the record belongs to node 'n2'" in (exc.details() or "")
        info = grpcerrors.error_info(exc)
        assert info is not None and dict(info.metadata)["owner"] == "n2"
        # and n1 may not delete it (FAILED_PRECONDITION: not its record, the agent moves on)
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await endpoints.DeleteEndpoint(
                pb.DeleteEndpointRequest(namespace="default", name="pod-b", node_name="n1")
            )
        assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        after = await clients.op.store.list("CiliumEndpoint")
        assert after.items == before.items
        assert after.resource_version == before.resource_version
        # once n2 has left the cluster (its CiliumNode deleted) its stale record is n1's to take
        await clients.op.store.delete("CiliumNode", "n2")
        await endpoints.UpsertEndpoint(pb.UpsertEndpointRequest(endpoint=takeover))
        (record,) = (await clients.op.store.list("CiliumEndpoint")).items
        assert record["status"]["networking"]["node-name"] == "n1"


async def test_resource_writes_need_an_admin_identity(
    redis_url: str, bundle: GeneratedBundle
) -> None:
    async with tls_operator(redis_url, bundle) as clients:
        agent = pb_grpc.ResourceServiceStub(clients.of("node-n1"))
        exc = await _denied(agent.Apply(pb.ApplyRequest(manifest=POLICY)))
        assert "not an administrator" in (exc.details() or "")
        await _denied(agent.Delete(pb.DeleteRequest(kind="ciliumpodippools", name="default")))
        assert (await clients.op.store.list("CiliumNetworkPolicy")).items == []
        assert len((await clients.op.store.list("CiliumPodIPPool")).items) == 1
        admin = pb_grpc.ResourceServiceStub(clients.of("admin"))
        applied = await admin.Apply(pb.ApplyRequest(manifest=POLICY))
        assert [r.action for r in applied.resources] == ["created"]
        assert len((await clients.op.store.list("CiliumNetworkPolicy")).items) == 1


async def test_kubelet_client_certificates_identify_agents_in_kubernetes_mode(
    redis_url: str, bundle: GeneratedBundle, tmp_path: pathlib.Path
) -> None:
    """Kubernetes mode's per-node credentials: each agent presents its node's kubelet client
    certificate (one PEM holding certificate and key, reached through the kubelet's
    ``kubelet-client-current.pem`` symlink), issued by the cluster CA, which the operator
    trusts beside its own. Node n1's kubelet pair registers n1 and cannot act for n2; the
    admin pair of the operator's own CA still works."""
    cluster = generate_bundle(tmp_path / "cluster-ca", server_hosts=["kube-apiserver"],
                              nodes=["n1", "n2"], admins=[], ca_name="kubernetes")  # fmt: skip
    pki = tmp_path / "var-lib-kubelet-pki"
    pki.mkdir()
    cert, key = cluster.clients["node-n1"]
    dated = pki / "kubelet-client-2026-12-02-04-00-00.pem"
    dated.write_bytes(pathlib.Path(cert).read_bytes() + pathlib.Path(key).read_bytes())
    (pki / "kubelet-client-current.pem").symlink_to(dated)
    current = str(pki / "kubelet-client-current.pem")
    async with tls_operator(
        redis_url, bundle, tls_client_ca_files=[bundle.ca_cert, cluster.ca_cert]
    ) as clients:
        kubelet_n1 = clients.channel(ClientTLS((bundle.ca_cert,), current, current))
        node = pb_grpc.NodeServiceStub(kubelet_n1)
        await node.Register(pb.RegisterRequest(node_name="n1", addresses=["192.0.2.1"]))
        exc = await _denied(
            node.Register(pb.RegisterRequest(node_name="n2", addresses=["192.0.2.2"]))
        )
        assert "'n1' may not act for node 'n2'" in (exc.details() or "")
        names = [o["metadata"]["name"] for o in (await clients.op.store.list("CiliumNode")).items]
        assert names == ["n1"]
        admin = pb_grpc.ResourceServiceStub(clients.of("admin"))
        applied = await admin.Apply(pb.ApplyRequest(manifest=POLICY))
        assert [r.action for r in applied.resources] == ["created"]


def _kubelet_csr(kube: KubeAPI, node: str, tmp_path: pathlib.Path) -> str:
    """Do what a kubelet's TLS bootstrap does, on the real API server: a key made here, a
    CertificateSigningRequest for ``CN=system:node:<node>, O=system:nodes`` to signer
    ``kubernetes.io/kube-apiserver-client-kubelet``, approved, signed by
    kube-controller-manager with the cluster CA. Returns the kubelet-style PEM (certificate
    then key, one file)."""
    key = ec.generate_private_key(ec.SECP256R1())
    csr = (
        x509.CertificateSigningRequestBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "system:nodes"),
                                 x509.NameAttribute(NameOID.COMMON_NAME, f"system:node:{node}")]))
        .sign(key, hashes.SHA256())
    )  # fmt: skip
    name = f"cilia-test-kubelet-{node}-{uuid.uuid4().hex[:8]}"
    manifest = {
        "apiVersion": "certificates.k8s.io/v1",
        "kind": "CertificateSigningRequest",
        "metadata": {"name": name},
        "spec": {
            "request": base64.b64encode(csr.public_bytes(serialization.Encoding.PEM)).decode(),
            "signerName": "kubernetes.io/kube-apiserver-client-kubelet",
            "usages": ["digital signature", "client auth"],
            "expirationSeconds": 3600,
        },
    }
    kube.kubectl("create", "-f", "-", input=json.dumps(manifest))
    try:
        kube.kubectl("certificate", "approve", name)
        deadline = time.monotonic() + CSR_SIGNED_SECONDS
        while time.monotonic() < deadline:
            got = kube.kubectl("get", "csr", name, "-o", "jsonpath={.status.certificate}")
            if got.stdout.strip():
                break
            time.sleep(0.2)
        else:
            raise AssertionError(f"CSR {name} not signed in {CSR_SIGNED_SECONDS} s")
    finally:
        cert = kube.kubectl("get", "csr", name, "-o", "jsonpath={.status.certificate}").stdout
        kube.kubectl("delete", "csr", name, check=False)
    pem = base64.b64decode(cert) + key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    path = tmp_path / f"kubelet-client-{node}.pem"
    path.write_bytes(pem)
    path.chmod(0o600)
    return str(path)


async def test_kubelet_certificate_issued_through_a_kubernetes_csr_is_its_nodes_identity(
    redis_url: str, bundle: GeneratedBundle, kube_apiserver: KubeAPI, tmp_path: pathlib.Path
) -> None:
    """The real issuance path of Kubernetes mode's agent credentials: a certificate the
    cluster's kube-controller-manager signed for node n1 through a CSR registers n1 at an
    operator trusting the cluster CA, and may not act for n2."""
    kube = kube_apiserver
    kube.stop_controller_manager()  # one started by another test lacks the signing flags
    kube.controller_manager(extra=("--controllers=csrsigning",
                                   f"--cluster-signing-cert-file={kube.ca_file}",
                                   f"--cluster-signing-key-file={kube.ca_key_file}"))  # fmt: skip
    try:
        pair = _kubelet_csr(kube, "n1", tmp_path)
    finally:
        kube.stop_controller_manager()
    async with tls_operator(
        redis_url, bundle, tls_client_ca_files=[bundle.ca_cert, str(kube.ca_file)]
    ) as clients:
        node = pb_grpc.NodeServiceStub(clients.channel(ClientTLS((bundle.ca_cert,), pair, pair)))
        await node.Register(pb.RegisterRequest(node_name="n1", addresses=["192.0.2.1"]))
        await _denied(node.Register(pb.RegisterRequest(node_name="n2", addresses=["192.0.2.2"])))
        names = [o["metadata"]["name"] for o in (await clients.op.store.list("CiliumNode")).items]
        assert names == ["n1"]


async def _refused_in_kubernetes_mode(call: Awaitable[Any]) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call
    exc = caught.value
    assert exc.code() == grpc.StatusCode.FAILED_PRECONDITION, exc.details()
    assert "kubectl apply -f / kubectl delete" in (exc.details() or "")
    info = grpcerrors.error_info(exc)
    assert info is not None and info.reason == "RESOURCES_VIA_API_SERVER"


async def test_kubernetes_mode_refuses_resource_writes_over_grpc_even_to_admins(
    kube_cilia: KubeAPI, bundle: GeneratedBundle
) -> None:
    """--store kubernetes: Apply, Delete and ApplyOutcome are the API server's business,
    refused to the admin and to an agent, with TLS and on a plaintext loopback listener;
    reads still answer; nothing is written."""
    kube = {"store": "kubernetes", "kubeconfig": str(kube_cilia.kubeconfig),
            "store_watch_timeout": 5}  # fmt: skip
    async with tls_operator("redis://unused", bundle, **kube) as clients:
        admin = pb_grpc.ResourceServiceStub(clients.of("admin"))
        agent = pb_grpc.ResourceServiceStub(clients.of("node-n1"))
        for stub in (admin, agent):
            await _refused_in_kubernetes_mode(stub.Apply(pb.ApplyRequest(manifest=POLICY)))
            await _refused_in_kubernetes_mode(
                stub.Delete(pb.DeleteRequest(kind="ciliumpodippools", name="default"))
            )
        await _refused_in_kubernetes_mode(
            admin.ApplyOutcome(pb.ApplyOutcomeRequest(request_id="r1"))
        )
        listed = await admin.List(pb.ListRequest(kind="ciliumpodippools"))
        assert [json.loads(i.json)["metadata"]["name"] for i in listed.items] == ["default"]
        assert (await clients.op.store.list("CiliumNetworkPolicy")).items == []
    plain = Config(**operator_settings("redis://unused", **kube,
                   auto_create_cilium_pod_ip_pools=[POOL]))  # fmt: skip
    op = Operator(plain)
    await op.start()
    channel = grpc.aio.insecure_channel(op.address)
    try:
        stub = pb_grpc.ResourceServiceStub(channel)
        await _refused_in_kubernetes_mode(stub.Apply(pb.ApplyRequest(manifest=POLICY)))
        await _refused_in_kubernetes_mode(
            stub.Delete(pb.DeleteRequest(kind="ciliumpodippools", name="default"))
        )
        assert len((await op.store.list("CiliumPodIPPool")).items) == 1
        assert (await op.store.list("CiliumNetworkPolicy")).items == []
    finally:
        await channel.close()
        await op.stop()


def _pod_on(ns: str, name: str, node: str) -> str:
    return json.dumps({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": ns},
        "spec": {"nodeName": node, "serviceAccountName": "default",
                 "containers": [{"name": "c", "image": "registry.invalid/app:1"}]},
    })  # fmt: skip


async def test_kubernetes_mode_lets_the_pods_node_take_its_endpoint_record_over(
    kube_cilia: KubeAPI, bundle: GeneratedBundle
) -> None:
    """--store kubernetes: the API server's Pod decides who owns an endpoint record. Node n1
    may not overwrite n2's record of pod ``ns/web-0`` while no Pod, or a Pod on n2, says so;
    once the Pod is on n1 (a StatefulSet pod rescheduled off a node that is down but still
    registered), n1 takes the record over without waiting for n2's CiliumNode to go."""
    ns = f"takeover-{uuid.uuid4().hex[:6]}"
    kube_cilia.kubectl("create", "namespace", ns)
    kube_cilia.kubectl("create", "serviceaccount", "default", "-n", ns, check=False)
    kube = {"store": "kubernetes", "kubeconfig": str(kube_cilia.kubeconfig),
            "store_watch_timeout": 5}  # fmt: skip
    try:
        async with tls_operator("redis://unused", bundle, **kube) as clients:
            n1, n2 = clients.of("node-n1"), clients.of("node-n2")
            await pb_grpc.NodeServiceStub(n2).Register(
                pb.RegisterRequest(node_name="n2", addresses=["192.0.2.2"])
            )
            record = pb.EndpointRecord(namespace=ns, name="web-0", node_name="n2",
                                       ipv4="10.231.1.5", identity=300)  # fmt: skip
            await pb_grpc.EndpointServiceStub(n2).UpsertEndpoint(
                pb.UpsertEndpointRequest(endpoint=record)
            )
            moved = pb.EndpointRecord()
            moved.CopyFrom(record)
            moved.node_name, moved.ipv4 = "n1", "10.231.0.9"
            endpoints = pb_grpc.EndpointServiceStub(n1)
            await _denied(endpoints.UpsertEndpoint(pb.UpsertEndpointRequest(endpoint=moved)))
            kube_cilia.kubectl("create", "-f", "-", input=_pod_on(ns, "web-0", "n2"))
            await _denied(endpoints.UpsertEndpoint(pb.UpsertEndpointRequest(endpoint=moved)))
            kept = await clients.op.store.get("CiliumEndpoint", "web-0", ns)
            assert kept["status"]["networking"]["node-name"] == "n2"
            kube_cilia.kubectl("delete", "pod", "web-0", "-n", ns, "--grace-period=0", "--force")
            kube_cilia.kubectl("create", "-f", "-", input=_pod_on(ns, "web-0", "n1"))
            await endpoints.UpsertEndpoint(pb.UpsertEndpointRequest(endpoint=moved))
            taken = await clients.op.store.get("CiliumEndpoint", "web-0", ns)
            assert taken["status"]["networking"]["node-name"] == "n1"
            assert taken["status"]["networking"]["addressing"][0]["ipv4"] == "10.231.0.9"
    finally:
        kube_cilia.kubectl("delete", "namespace", ns, "--wait=false", check=False)


async def test_client_without_certificate_is_refused_at_the_handshake(
    redis_url: str, bundle: GeneratedBundle
) -> None:
    async with tls_operator(redis_url, bundle) as clients:
        no_cert = grpc.ssl_channel_credentials(pathlib.Path(bundle.ca_cert).read_bytes())
        await _refused_at_handshake(clients.channel(None))  # plaintext
        ch = grpc.aio.secure_channel(clients.op.address, no_cert)
        try:
            await _refused_at_handshake(ch)
        finally:
            await ch.close()


async def test_health_listener_answers_probes_in_plaintext_and_serves_nothing_else(
    redis_url: str, bundle: GeneratedBundle
) -> None:
    async with tls_operator(redis_url, bundle, grpc_health_listen="127.0.0.1:0") as clients:
        assert clients.op.health_address.startswith("127.0.0.1:")
        async with grpc.aio.insecure_channel(clients.op.health_address) as ch:
            reply = await health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(), timeout=5
            )
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await pb_grpc.ResourceServiceStub(ch).List(pb.ListRequest(kind="cn"), timeout=5)
            assert caught.value.code() == grpc.StatusCode.UNIMPLEMENTED


async def test_certificates_of_another_ca_and_expired_ones_are_refused(
    redis_url: str, bundle: GeneratedBundle, tmp_path: pathlib.Path
) -> None:
    other = generate_bundle(tmp_path / "other", server_hosts=["127.0.0.1"], nodes=["n1"])
    expired_dir = tmp_path / "expired"
    expired_dir.mkdir()
    for name in ("ca.crt", "ca.key"):  # the right CA, a certificate past its notAfter
        shutil.copy(pathlib.Path(bundle.ca_cert).with_name(name), expired_dir / name)
    expired = generate_bundle(
        expired_dir, server_hosts=["127.0.0.1"], nodes=["n1"], days=1,
        not_before=datetime.datetime.now(datetime.UTC) - datetime.timedelta(days=3),
    )  # fmt: skip
    async with tls_operator(redis_url, bundle) as clients:
        # another CA's client certificate, the server still trusted
        await _refused_at_handshake(clients.channel(_client(other, "node-n1", bundle.ca_cert)))
        await _refused_at_handshake(clients.channel(_client(expired, "node-n1")))
        # the control: the same call with a valid certificate passes
        ok = pb_grpc.ResourceServiceStub(clients.of("node-n1"))
        assert (await ok.List(pb.ListRequest(kind="ciliumnodes"), timeout=5)).items == []


# -- a real cilia-operator process: the CLI and certificate rotation ------------------------


def _served_serial(address: str, bundle: GeneratedBundle) -> int:
    """Serial of the certificate the server presents on a new TLS connection."""
    ctx = ssl.create_default_context(cafile=bundle.ca_cert)
    cert, key = bundle.clients["admin"]
    ctx.load_cert_chain(cert, key)
    ctx.set_alpn_protocols(["h2"])
    host, port = address.rsplit(":", 1)
    with (
        socket.create_connection((host, int(port)), timeout=5) as raw,
        ctx.wrap_socket(raw, server_hostname="localhost") as tls,
    ):
        der = tls.getpeercert(binary_form=True)
    assert der is not None
    return x509.load_der_x509_certificate(der).serial_number


@pytest.fixture
def operator_process(redis_url: str, bundle: GeneratedBundle) -> Iterator[tuple[str, Any]]:
    """``cilia-operator serve`` with mutual TLS on 127.0.0.1:0: (address, process)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "cilia_operator", "serve", "--store", redis_url,
         "--store-key-prefix", f"mtls-{uuid.uuid4().hex[:8]}/",
         "--listen", "127.0.0.1:0", "--prometheus-serve-addr", "",
         "--auto-create-cilium-pod-ip-pools", POOL,
         "--tls-cert-file", bundle.server_cert, "--tls-key-file", bundle.server_key,
         "--tls-client-ca-files", bundle.ca_cert],
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert proc.stderr is not None
    address = ""
    for line in proc.stderr:
        found = procs.listening(line)
        if found is not None and found[0] == "grpc":
            address = found[1]
            break
    assert address, "operator exited before it listened"
    try:
        yield address, proc
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=20)


def _cli(address: str, *argv: str, tls: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "cilia_operator", *argv, "--server", address, "--timeout", "10",
         *tls],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip


def _tls_flags(bundle: GeneratedBundle, name: str) -> list[str]:
    cert, key = bundle.clients[name]
    return ["--tls-operator-server-ca-files", bundle.ca_cert,
            "--tls-operator-client-cert-file", cert, "--tls-operator-client-key-file", key,
            "--tls-operator-server-name", "localhost"]  # fmt: skip


def test_cli_apply_is_refused_without_admin_credentials(
    operator_process: tuple[str, Any], bundle: GeneratedBundle, tmp_path: pathlib.Path
) -> None:
    address, _ = operator_process
    manifest = tmp_path / "policy.yaml"
    manifest.write_text(POLICY)
    as_node = _cli(address, "apply", "-f", str(manifest), tls=_tls_flags(bundle, "node-n1"))
    assert as_node.returncode == 2
    assert (
        as_node.stderr.startswith("error: PERMISSION_DENIED: ")
        and "Traceback" not in as_node.stderr
    )
    plain = _cli(address, "apply", "-f", str(manifest), tls=[])
    assert plain.returncode == 2 and "cannot reach operator" in plain.stderr
    got = _cli(address, "get", "cnp", "-A", tls=_tls_flags(bundle, "node-n1"))
    assert got.returncode == 0 and '"items": []' in got.stdout
    as_admin = _cli(address, "apply", "-f", str(manifest), tls=_tls_flags(bundle, "admin"))
    assert as_admin.returncode == 0, as_admin.stderr
    assert "ciliumnetworkpolicy.cilium.io/allow-web created" in as_admin.stdout


def test_renewed_server_certificate_is_served_without_restart(
    operator_process: tuple[str, Any], bundle: GeneratedBundle
) -> None:
    address, proc = operator_process
    first = _served_serial(address, bundle)
    assert (
        first
        == x509.load_pem_x509_certificate(
            pathlib.Path(bundle.server_cert).read_bytes()
        ).serial_number
    )
    # renew: same CA (reused from the directory), new server and client pairs
    renewed = generate_bundle(
        pathlib.Path(bundle.ca_cert).parent, server_hosts=["127.0.0.1", "localhost"],
        nodes=["n1", "n2"], admins=["admin"], days=1,
    )  # fmt: skip
    new = x509.load_pem_x509_certificate(pathlib.Path(renewed.server_cert).read_bytes())
    assert new.serial_number != first
    assert _served_serial(address, renewed) == new.serial_number
    assert proc.poll() is None  # the same process
    got = _cli(address, "get", "cn", tls=_tls_flags(renewed, "admin"))
    assert got.returncode == 0, got.stderr
