"""What a Service range change needs of the kind-style cluster's control plane and kubelets,
which no Kubernetes API can do (the runbook steps of ``docs/servicecidr-runbook.md``,
scripted for this cluster):

- :func:`set_service_cluster_ip_range`: every kube-apiserver (and kube-controller-manager)
  runs with the new ``--service-cluster-ip-range``, the API server certificate holds the
  new ``kubernetes`` Service address. The one API server is restarted behind a temporary
  second one (the "surge", same node, a second address on its interface, listening on every
  address at the same port through SO_REUSEPORT: ``--permit-port-sharing``) so the API stays
  served, at the ``kubernetes`` Service and at the node address the agents, the operator and
  the kubelets use, as in a cluster of several API servers restarted one at a time: the surge joins
  the ``kubernetes`` Service's endpoints; the first is stopped with SIGTERM (its
  ``--shutdown-delay-duration`` takes it out of the endpoints while it still serves),
  restarted with the new flags by its supervisor and back in the endpoints; then the surge
  leaves the same way and its address is removed.
- :func:`set_cluster_dns`: a node's kubelet ``clusterDNS`` set to the new cluster DNS address
  and the kubelet restarted (running pods keep theirs: the old address stays an alias).

Processes are ended by PID only (the surge's recorded one; the supervised daemons found by
their executable in the node container the harness owns); the surge also dies with its
node container at teardown.
"""

from __future__ import annotations

import datetime
import ipaddress
import json
import re
import time
from typing import Any

from cilia_testkit.kind.api import KindError
from cilia_testkit.kind.cluster import KindCluster
from cilia_testkit.kind.controlplane import API_PORT, kubernetes_service_ip
from cilia_testkit.kind.node import KUBE_BIN_MOUNT, LOG_MOUNT, node_dirs

#: Seconds each API server may take to become ready / to leave the endpoints.
API_SWAP_SECONDS = 90.0
#: The surge API server's address: this host number in the nodes' /24 (the outside host is .250).
SURGE_HOST = 249
SURGE_PID_FILE = "/run/cilia-surge-apiserver.pid"
_RANGE_FLAG = re.compile(r"--service-cluster-ip-range=\S+")


def _reissue_serving_cert(cluster: KindCluster, extra_ips: list[str]) -> None:
    """The API server certificate again, same key and names plus ``extra_ips``, written to
    the cluster's PKI and the control-plane node's conf."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization

    pki = cluster.pki
    cert = x509.load_pem_x509_certificate(pki.serving_cert.read_bytes())
    key: Any = serialization.load_pem_private_key(pki.serving_key.read_bytes(), None)
    ca_cert = x509.load_pem_x509_certificate(pki.ca_file.read_bytes())
    ca_key: Any = serialization.load_pem_private_key(pki.ca_key_file.read_bytes(), None)
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    names: list[x509.GeneralName] = list(san)
    have = {str(n) for n in san.get_values_for_type(x509.IPAddress)}
    names += [x509.IPAddress(ipaddress.ip_address(ip)) for ip in extra_ips if ip not in have]
    now = datetime.datetime.now(datetime.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(cert.subject)
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(cert.not_valid_after_utc)
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
    )
    for ext in cert.extensions:
        if not isinstance(ext.value, x509.SubjectAlternativeName):
            builder = builder.add_extension(ext.value, ext.critical)
    pem = builder.sign(ca_key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM)
    pki.serving_cert.write_bytes(pem)
    conf, _ = node_dirs(cluster.state_dir, cluster.control_plane.name)
    (conf / "pki" / pki.serving_cert.name).write_bytes(pem)


def _daemon_pids(cluster: KindCluster, binary: str) -> list[int]:
    """PIDs (in the control-plane node) of processes running ``KUBE_BIN_MOUNT/binary``."""
    out = cluster.exec(cluster.control_plane.name, "bash", "-c",
                       f"for p in /proc/[0-9]*; do [ \"$(readlink $p/exe)\" = "
                       f"'{KUBE_BIN_MOUNT}/{binary}' ] && echo ${{p#/proc/}}; done; true")  # fmt: skip
    return [int(x) for x in out.split()]


def _endpoint_ips(cluster: KindCluster) -> set[str]:
    items = cluster.get("endpointslices", "-n", "default", "-l",
                        "kubernetes.io/service-name=kubernetes")["items"]  # fmt: skip
    return {a for s in items for e in s.get("endpoints") or []
            if (e.get("conditions") or {}).get("ready", True) is not False
            for a in e.get("addresses") or []}  # fmt: skip


def _wait(what: str, check: Any, timeout: float = API_SWAP_SECONDS) -> float:
    started = time.monotonic()
    while True:
        try:
            if check():
                return time.monotonic() - started
        except Exception:
            pass
        if time.monotonic() - started > timeout:
            raise KindError(f"{what}: not within {timeout:g} s")
        time.sleep(0.3)


def _ready(cluster: KindCluster, ip: str) -> bool:
    got = cluster.exec(cluster.control_plane.name, "curl", "-sk", "--max-time", "2",
                       f"https://{ip}:{API_PORT}/readyz", check=False)  # fmt: skip
    return got.strip() == "ok"


def set_service_cluster_ip_range(cluster: KindCluster, cidr: str) -> dict[str, float]:
    """Run the control plane with ``--service-cluster-ip-range=cidr`` without a moment
    when the ``kubernetes`` Service has no serving endpoint (module docstring).

    Returns:
        seconds of each phase: ``surge_ready``, ``main_restarted``, ``surge_gone``.

    Raises:
        KindError: an API server did not come up or leave the endpoints in time.
    """
    cp = cluster.control_plane
    conf, _ = node_dirs(cluster.state_dir, cp.name)
    net = ipaddress.ip_network(f"{cp.ip}/24", strict=False)
    surge_ip = str(net[SURGE_HOST])
    taken = {n.ip for n in cluster.nodes} | ({cluster.outside.ip} if cluster.outside else set())
    if surge_ip in taken:
        raise KindError(f"surge address {surge_ip} is a node's")
    _reissue_serving_cert(cluster, [kubernetes_service_ip(cidr), surge_ip])
    scripts = conf / "services"
    for name in ("02-kube-apiserver", "03-kube-controller-manager"):
        path = scripts / name
        path.write_text(_RANGE_FLAG.sub(f"--service-cluster-ip-range={cidr}", path.read_text()))
    main_line = next(ln for ln in (scripts / "02-kube-apiserver").read_text().splitlines()
                     if ln.startswith("exec "))  # fmt: skip
    surge_line = (main_line.replace(f"--advertise-address={cp.ip}", f"--advertise-address={surge_ip}")
                  .replace("--cert-dir=/var/lib/kube-apiserver", "--cert-dir=/var/lib/kube-apiserver-surge"))  # fmt: skip
    times: dict[str, float] = {}
    cluster.exec(cp.name, "ip", "addr", "replace", f"{surge_ip}/{net.prefixlen}", "dev", "eth0")
    cluster.exec(cp.name, "bash", "-c",
                 f"nohup bash -c 'echo $$ > {SURGE_PID_FILE}; {surge_line}' "
                 f">>{LOG_MOUNT}/surge-apiserver.log 2>&1 &")  # fmt: skip
    times["surge_ready"] = _wait("surge API server ready and in the kubernetes endpoints",
                                 lambda: _ready(cluster, surge_ip)
                                 and surge_ip in _endpoint_ips(cluster))  # fmt: skip
    surge_pid = int(cluster.exec(cp.name, "cat", SURGE_PID_FILE).strip())
    started = time.monotonic()
    for pid in _daemon_pids(cluster, "kube-apiserver"):
        if pid != surge_pid:
            cluster.exec(cp.name, "kill", "-TERM", str(pid))
    _wait("the first API server out of the endpoints",
          lambda: cp.ip not in _endpoint_ips(cluster))  # fmt: skip
    _wait("the first API server back with the new range",
          lambda: _ready(cluster, cp.ip) and cp.ip in _endpoint_ips(cluster))  # fmt: skip
    times["main_restarted"] = time.monotonic() - started
    for pid in _daemon_pids(cluster, "kube-controller-manager"):
        cluster.exec(cp.name, "kill", "-TERM", str(pid))
    started = time.monotonic()
    cluster.exec(cp.name, "kill", "-TERM", str(surge_pid))
    _wait("the surge API server gone",
          lambda: surge_ip not in _endpoint_ips(cluster)
          and not cluster.exec(cp.name, "bash", "-c", f"kill -0 {surge_pid} 2>/dev/null && echo up",
                               check=False).strip())  # fmt: skip
    cluster.exec(cp.name, "ip", "addr", "del", f"{surge_ip}/{net.prefixlen}", "dev", "eth0",
                 check=False)  # fmt: skip
    times["surge_gone"] = time.monotonic() - started
    cluster._wait_api()
    return times


def stop_surge(cluster: KindCluster) -> None:
    """End a surge API server left by a failed :func:`set_service_cluster_ip_range` (by its
    recorded PID); nothing when there is none."""
    cluster.exec(cluster.control_plane.name, "bash", "-c",
                 f"[ -f {SURGE_PID_FILE} ] && kill -TERM $(cat {SURGE_PID_FILE}) 2>/dev/null; "
                 f"rm -f {SURGE_PID_FILE}; true", check=False)  # fmt: skip


def set_cluster_dns(cluster: KindCluster, node: str, dns_ip: str) -> None:
    """Node ``node``'s kubelet ``clusterDNS`` = ``[dns_ip]`` (pods created after it get that
    nameserver), the kubelet restarted (SIGTERM by PID; its supervisor starts it again) and
    the Node Ready again.

    Raises:
        KindError: the kubelet did not come back.
    """
    conf, _ = node_dirs(cluster.state_dir, node)
    path = conf / "kubelet-config.json"
    config = json.loads(path.read_text())
    config["clusterDNS"] = [dns_ip]
    path.write_text(json.dumps(config, indent=2))
    pids = cluster.exec(node, "bash", "-c",
                        "for p in /proc/[0-9]*; do [ \"$(readlink $p/exe)\" = "
                        "\"$(command -v kubelet)\" ] && echo ${p#/proc/}; done; true").split()  # fmt: skip
    since = datetime.datetime.now(datetime.UTC).replace(microsecond=0)
    for pid in pids:
        cluster.exec(node, "kill", "-TERM", pid)
    cluster._wait_heartbeat(node, since)
    cluster.wait_ready([node])
