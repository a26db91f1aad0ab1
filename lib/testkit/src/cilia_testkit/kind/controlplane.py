"""The control plane of the kind-style cluster, as processes in the first node's container
(like kind's control-plane node, without static pods): etcd, kube-apiserver,
kube-controller-manager and kube-scheduler, the upstream binaries built by
``scripts/kube-tools.sh``/``scripts/kubelet-tools.sh`` (mounted read-only from the cache at
``/opt/kube/bin``), each a supervised service of the node's entrypoint (restarted when it
exits, started again when the container starts).

- **etcd** on the node's loopback (2379/2380), data in ``/var/lib/etcd`` (the container's
  file system: it survives a stop/start of the node), ``--unsafe-no-fsync`` (test cluster).
- **kube-apiserver** on ``0.0.0.0:`` :data:`API_PORT`, advertising the node's address (the
  ``kubernetes`` Service's endpoints are that address: what ``k8sServiceHost/Port`` point
  at), ``--service-cluster-ip-range`` (the ServiceCIDR API is on by default in this
  version), ``--authorization-mode=Node,RBAC``, admission ``NodeRestriction``,
  ``--allow-privileged``, ``--shutdown-delay-duration`` :data:`SHUTDOWN_DELAY`,
  ``--permit-port-sharing`` (SO_REUSEPORT: a second API server may listen on another address
  of the node at the same port while this one listens on all of them); its kubelet client is
  the admin certificate.
- **kube-controller-manager** with ``--allocate-node-cidrs --cluster-cidr=<pod CIDR>
  --node-cidr-mask-size=<mask>`` (each Node's ``spec.podCIDR``), every default controller
  (garbage collector, node lifecycle, service accounts, endpoint slices, ...),
  ``--use-service-account-credentials`` and the CA as the CSR signer.
- **kube-scheduler**.

kube-proxy is not deployed. kube-controller-manager and kube-scheduler use the admin
kubeconfig to ``https://127.0.0.1:6443``; no leader election (one instance each).
"""

from __future__ import annotations

import ipaddress
import pathlib

from cilia_testkit.kind.node import CONF_MOUNT, KUBE_BIN_MOUNT, Node, node_dirs
from cilia_testkit.kind.pki import ClusterPKI

#: The API server's port on the control-plane node (kind's and kubeadm's default).
API_PORT = 6443
#: kube-apiserver ``--shutdown-delay-duration``: on SIGTERM it takes its address out of the
#: ``kubernetes`` Service's endpoints at once and keeps serving this long, so clients of the
#: Service (through the agents' load balancer) move to another API server before it stops
#: listening (:mod:`cilia_testkit.kind.servicerange` restarts it behind a second one).
SHUTDOWN_DELAY = "3s"


def kubernetes_service_ip(service_cidr: str) -> str:
    """The ClusterIP of Service ``default/kubernetes``: the first address of the range."""
    return str(ipaddress.ip_network(service_cidr)[1])


def write_control_plane(
    state_dir: pathlib.Path,
    node: Node,
    pki: ClusterPKI,
    *,
    pod_cidr: str,
    service_cidr: str,
    node_cidr_mask: int,
) -> dict[str, str]:
    """Put the control plane's certificates and admin kubeconfig into ``node``'s conf dir;
    return its service scripts (file name → script) for
    :func:`cilia_testkit.kind.node.write_node_config`."""
    conf, _ = node_dirs(state_dir, node.name)
    (conf / "pki").mkdir(parents=True, exist_ok=True)
    for src in (pki.ca_file, pki.ca_key_file, pki.serving_cert, pki.serving_key, pki.admin_cert,
                pki.admin_key, pki.sa_key, pki.sa_pub):  # fmt: skip
        dst = conf / "pki" / src.name
        dst.write_bytes(src.read_bytes())
        dst.chmod(src.stat().st_mode & 0o777)
    (conf / "admin.kubeconfig").write_text(pki.admin_kubeconfig(f"https://127.0.0.1:{API_PORT}"))
    b, p, admin = KUBE_BIN_MOUNT, f"{CONF_MOUNT}/pki", f"{CONF_MOUNT}/admin.kubeconfig"
    etcd = " ".join([
        f"exec {b}/etcd", f"--name={node.name}", "--data-dir=/var/lib/etcd",
        "--listen-client-urls=http://127.0.0.1:2379", "--advertise-client-urls=http://127.0.0.1:2379",
        "--listen-peer-urls=http://127.0.0.1:2380", "--initial-advertise-peer-urls=http://127.0.0.1:2380",
        f"--initial-cluster={node.name}=http://127.0.0.1:2380", "--listen-metrics-urls=",
        "--log-level=warn", "--unsafe-no-fsync",
    ])  # fmt: skip
    apiserver = " ".join([
        f"exec {b}/kube-apiserver", "--etcd-servers=http://127.0.0.1:2379",
        "--bind-address=0.0.0.0", f"--advertise-address={node.ip}", f"--secure-port={API_PORT}",
        "--cert-dir=/var/lib/kube-apiserver",
        f"--tls-cert-file={p}/apiserver.crt", f"--tls-private-key-file={p}/apiserver.key",
        f"--client-ca-file={p}/ca.crt",
        f"--service-account-key-file={p}/sa.pub", f"--service-account-signing-key-file={p}/sa.key",
        "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
        f"--service-cluster-ip-range={service_cidr}",
        "--authorization-mode=Node,RBAC", "--enable-admission-plugins=NodeRestriction",
        "--allow-privileged=true", "--profiling=false",
        f"--kubelet-client-certificate={p}/admin.crt", f"--kubelet-client-key={p}/admin.key",
        "--kubelet-preferred-address-types=InternalIP",
        f"--shutdown-delay-duration={SHUTDOWN_DELAY}", "--permit-port-sharing=true", "--v=1",
    ])  # fmt: skip
    controller_manager = " ".join([
        f"exec {b}/kube-controller-manager", f"--kubeconfig={admin}",
        f"--authentication-kubeconfig={admin}", f"--authorization-kubeconfig={admin}",
        "--leader-elect=false", "--secure-port=0",
        "--allocate-node-cidrs=true", f"--cluster-cidr={pod_cidr}",
        f"--node-cidr-mask-size={node_cidr_mask}", f"--service-cluster-ip-range={service_cidr}",
        "--configure-cloud-routes=false",
        f"--service-account-private-key-file={p}/sa.key", f"--root-ca-file={p}/ca.crt",
        "--use-service-account-credentials=true",
        f"--cluster-signing-cert-file={p}/ca.crt", f"--cluster-signing-key-file={p}/ca.key",
        "--v=1",
    ])  # fmt: skip
    scheduler = " ".join([
        f"exec {b}/kube-scheduler", f"--kubeconfig={admin}",
        f"--authentication-kubeconfig={admin}", f"--authorization-kubeconfig={admin}",
        "--leader-elect=false", "--secure-port=0", "--v=1",
    ])  # fmt: skip
    wait_api = (
        f"until {b}/kubectl --kubeconfig={admin} get --raw=/readyz >/dev/null 2>&1;"
        " do sleep 0.5; done\n"
    )
    return {
        "01-etcd": etcd + "\n",
        "02-kube-apiserver": apiserver + "\n",
        "03-kube-controller-manager": wait_api + controller_manager + "\n",
        "04-kube-scheduler": wait_api + scheduler + "\n",
    }
