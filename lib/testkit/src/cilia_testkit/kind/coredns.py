"""CoreDNS as the cluster DNS of the kind-style cluster (what kubeadm/kind deploy), built
from the Go module proxy (``scripts/coredns.sh``) into the image ``cilia-coredns:<version>``.

Objects (kube-system): ServiceAccount ``coredns``; ClusterRole/ClusterRoleBinding
``system:coredns`` (list/watch endpoints, EndpointSlices, Services, Pods, Namespaces);
ConfigMap ``coredns`` (the Corefile); Deployment ``coredns`` (:data:`REPLICAS` replicas,
``k8s-app: kube-dns``, readiness on the ``ready`` plugin's :8181, liveness on ``health``'s
:8080); Service ``kube-dns`` at the ClusterIP the kubelets' ``clusterDNS`` names (ports
``dns`` 53/UDP, ``dns-tcp`` 53/TCP, ``metrics`` 9153/TCP as upstream names them).

The Corefile serves ``cluster.local`` and the reverse zones from the API; every other name
is **refused** (no ``forward``: there is no real internet here). CoreDNS reaches the API server
at the control-plane node's address (env ``KUBERNETES_SERVICE_HOST``/``PORT`` set on the
container, overriding the ClusterIP the kubelet injects: no kube-proxy translates it until a
CNI with a service load balancer runs). Pods stay Pending until a CNI is installed.
"""

from __future__ import annotations

import json
from typing import Any

#: CoreDNS replicas (kubeadm's default is 2).
REPLICAS = 2

COREFILE = """.:53 {
    errors
    health {
        lameduck 5s
    }
    ready
    kubernetes cluster.local in-addr.arpa ip6.arpa {
        pods insecure
        fallthrough in-addr.arpa ip6.arpa
        ttl 30
    }
    cache 30
    reload
    loadbalance
}
"""


def manifests(image: str, dns_ip: str, api_host: str, api_port: int) -> str:
    """The CoreDNS objects as one ``v1/List`` JSON document (``kubectl apply -f -``)."""
    labels = {"k8s-app": "kube-dns"}
    items: list[dict[str, Any]] = [
        {"apiVersion": "v1", "kind": "ServiceAccount",
         "metadata": {"name": "coredns", "namespace": "kube-system"}},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
         "metadata": {"name": "system:coredns"},
         "rules": [
             {"apiGroups": [""], "resources": ["endpoints", "services", "pods", "namespaces"],
              "verbs": ["list", "watch"]},
             {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"],
              "verbs": ["list", "watch"]},
         ]},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
         "metadata": {"name": "system:coredns"},
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                     "name": "system:coredns"},
         "subjects": [{"kind": "ServiceAccount", "name": "coredns", "namespace": "kube-system"}]},
        {"apiVersion": "v1", "kind": "ConfigMap",
         "metadata": {"name": "coredns", "namespace": "kube-system"},
         "data": {"Corefile": COREFILE}},
        {"apiVersion": "apps/v1", "kind": "Deployment",
         "metadata": {"name": "coredns", "namespace": "kube-system", "labels": labels},
         "spec": {
             "replicas": REPLICAS,
             "selector": {"matchLabels": labels},
             "template": {
                 "metadata": {"labels": labels},
                 "spec": {
                     "serviceAccountName": "coredns",
                     "priorityClassName": "system-cluster-critical",
                     "dnsPolicy": "Default",
                     # non-root (the image's user 65532) binding :53: a namespaced sysctl of
                     # Kubernetes' "safe" set instead of a capability (lost at exec for non-root)
                     "securityContext": {"sysctls": [
                         {"name": "net.ipv4.ip_unprivileged_port_start", "value": "53"}]},
                     "tolerations": [{"key": "CriticalAddonsOnly", "operator": "Exists"},
                                     {"key": "node-role.kubernetes.io/control-plane",
                                      "effect": "NoSchedule"}],
                     "affinity": {"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [
                         {"weight": 100, "podAffinityTerm": {
                             "labelSelector": {"matchLabels": labels},
                             "topologyKey": "kubernetes.io/hostname"}}]}},
                     "containers": [{
                         "name": "coredns",
                         "image": image,
                         "imagePullPolicy": "IfNotPresent",
                         "args": ["-conf", "/etc/coredns/Corefile"],
                         "env": [{"name": "KUBERNETES_SERVICE_HOST", "value": api_host},
                                 {"name": "KUBERNETES_SERVICE_PORT", "value": str(api_port)}],
                         "ports": [{"name": "dns", "containerPort": 53, "protocol": "UDP"},
                                   {"name": "dns-tcp", "containerPort": 53, "protocol": "TCP"},
                                   {"name": "metrics", "containerPort": 9153, "protocol": "TCP"}],
                         "resources": {"requests": {"cpu": "50m", "memory": "32Mi"},
                                       "limits": {"memory": "170Mi"}},
                         "securityContext": {
                             "allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                             "capabilities": {"drop": ["ALL"]}},
                         "volumeMounts": [{"name": "config", "mountPath": "/etc/coredns",
                                           "readOnly": True}],
                         "livenessProbe": {"httpGet": {"path": "/health", "port": 8080},
                                           "initialDelaySeconds": 30, "periodSeconds": 10,
                                           "failureThreshold": 5},
                         "readinessProbe": {"httpGet": {"path": "/ready", "port": 8181},
                                            "periodSeconds": 2},
                     }],
                     "volumes": [{"name": "config", "configMap": {
                         "name": "coredns", "items": [{"key": "Corefile", "path": "Corefile"}]}}],
                 },
             },
         }},
        {"apiVersion": "v1", "kind": "Service",
         "metadata": {"name": "kube-dns", "namespace": "kube-system",
                      "labels": {**labels, "kubernetes.io/name": "CoreDNS"}},
         "spec": {"selector": labels, "clusterIP": dns_ip,
                  "ports": [{"name": "dns", "port": 53, "protocol": "UDP"},
                            {"name": "dns-tcp", "port": 53, "protocol": "TCP"},
                            {"name": "metrics", "port": 9153, "protocol": "TCP"}]}},
    ]  # fmt: skip
    return json.dumps({"apiVersion": "v1", "kind": "List", "items": items})
