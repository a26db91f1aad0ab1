"""The chart deploy/helm/cilia (rendered by the real helm into cilia-system, the post-delete
cleanup hook included) against a REAL kube-apiserver (the testkit's ``kube_apiserver``: etcd +
kube-apiserver built by scripts/kube-tools.sh): what the offline schema check cannot see —
admission, the API server's own validation (e.g. a pod's container names are unique across
init and app containers), CRD structural-schema rules — is checked by the server itself.

The CustomResourceDefinitions and the release Namespace (which `helm install -n NS
--create-namespace` makes; the chart renders none) are applied for real (a dry run of
namespaced objects needs the namespace, and of custom resources their CRD); everything else is
applied with ``kubectl apply --dry-run=server``. The session's server is shared: this module only
creates cluster objects of its own kinds and names (the cilia CRDs, namespace cilia-system,
the prometheus-operator's PodMonitor and ServiceMonitor CRDs).
"""

from __future__ import annotations

import copy
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from helmrender import CHART, NAMESPACE, documents, template

from cilia_testkit.kubeapi import KubeAPI, unique_name

CRD_DIR = CHART / "files" / "crds"
#: Seconds the CRDs may take to become Established.
ESTABLISH_TIMEOUT = "60s"


def _dump(docs: list[dict[str, Any]]) -> str:
    return yaml.safe_dump_all(docs, sort_keys=False)


def _apply(
    kube: KubeAPI, docs: list[dict[str, Any]], *flags: str
) -> subprocess.CompletedProcess[str]:
    return kube.kubectl("apply", *flags, "-f", "-", input=_dump(docs), check=False)


@pytest.fixture(scope="module")
def rendered(helm: Path) -> list[dict[str, Any]]:
    """The release's objects and its hooks (the node-cleanup DaemonSet is validated too)."""
    return documents(template(helm, values={"prometheus": {"serviceMonitor": {"enabled": True}}}),
                     hooks=True)  # fmt: skip


@pytest.fixture(scope="module")
def installed(
    kube_apiserver: KubeAPI, rendered: list[dict[str, Any]], monitoring_crds: list[Path]
) -> list[dict[str, Any]]:
    """Apply the CRDs and the Namespace for real, wait until every CRD is Established;
    the remaining objects. The prometheus-operator CRDs (PodMonitor, ServiceMonitor: the
    upstream files, see deploy/tests/conftest.py) are installed first, as a cluster's
    prometheus-operator would have them, so monitoring.yaml's monitors are validated too."""
    kube_apiserver.install_crds(*monitoring_crds)
    namespace = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE,
                 "labels": {"pod-security.kubernetes.io/enforce": "privileged"}}}  # fmt: skip
    base = [namespace, *(d for d in rendered if d["kind"] == "CustomResourceDefinition")]
    out = _apply(kube_apiserver, base, "--server-side", "--force-conflicts")
    assert out.returncode == 0, out.stderr
    crds = [f"crd/{d['metadata']['name']}" for d in base if d["kind"] == "CustomResourceDefinition"]
    wait = kube_apiserver.kubectl(
        "wait", "--for=condition=Established", f"--timeout={ESTABLISH_TIMEOUT}", *crds, check=False
    )
    assert wait.returncode == 0, wait.stderr
    return [d for d in rendered if d not in base]


def test_every_manifest_passes_a_server_side_dry_run(
    kube_apiserver: KubeAPI, installed: list[dict[str, Any]]
) -> None:
    out = _apply(kube_apiserver, installed, "--dry-run=server")
    assert out.returncode == 0, f"the API server refused:\n{out.stderr}"
    # one "(server dry run)" line per object: nothing was skipped
    lines = [line for line in out.stdout.splitlines() if line.endswith("(server dry run)")]
    assert len(lines) == len(installed), out.stdout
    for d in installed:
        kind = d["kind"].lower()
        assert any(f"{kind}" in line and f"/{d['metadata']['name']} " in line for line in lines), (
            f"{d['kind']}/{d['metadata']['name']} not in kubectl's output:\n{out.stdout}"
        )


def test_the_server_refuses_an_init_and_app_container_sharing_a_name(
    kube_apiserver: KubeAPI, installed: list[dict[str, Any]]
) -> None:
    """The check is real: the updater DaemonSet as it was (init container and container both
    named safe-agent-updater) is refused by the API server's pod validation."""
    [ds] = [
        d
        for d in installed
        if d["kind"] == "DaemonSet" and d["metadata"]["name"] == "cilia-safe-agent-updater"
    ]
    spec = ds["spec"]["template"]["spec"]
    init_names = {c["name"] for c in spec["initContainers"]}
    app_names = {c["name"] for c in spec["containers"]}
    assert not init_names & app_names, init_names & app_names
    broken = copy.deepcopy(ds)
    broken["spec"]["template"]["spec"]["containers"][0]["name"] = "safe-agent-updater"
    out = _apply(kube_apiserver, [broken], "--dry-run=server")
    assert out.returncode != 0
    assert "Duplicate value" in out.stderr and "safe-agent-updater" in out.stderr, out.stderr


def test_the_new_crds_are_served_as_upstream_names_them(
    kube_apiserver: KubeAPI, installed: list[dict[str, Any]]
) -> None:
    """CiliumEndpointSlice (cilium.io/v2alpha1, cluster, ces), CiliumClusterwideNetworkPolicy
    (cilium.io/v2, cluster, ccnp) and CiliumNodeConfig (cilium.io/v2 + deprecated v2alpha1,
    namespaced) as discovery lists them."""
    out = kube_apiserver.kubectl("api-resources", "--api-group=cilium.io", "-o", "wide").stdout
    rows = {line.split()[0]: line.split() for line in out.splitlines()[1:] if line.strip()}
    ces = rows["ciliumendpointslices"]
    assert ces[1] == "ces" and ces[2] == "cilium.io/v2alpha1" and ces[3] == "false"
    ccnp = rows["ciliumclusterwidenetworkpolicies"]
    assert ccnp[1] == "ccnp" and ccnp[2] == "cilium.io/v2" and ccnp[3] == "false"
    cnc = rows["ciliumnodeconfigs"]
    # no short name: the columns are NAME APIVERSION NAMESPACED KIND ...
    assert cnc[1] == "cilium.io/v2" and cnc[2] == "true" and cnc[3] == "CiliumNodeConfig"
    versions = kube_apiserver.kubectl("api-versions").stdout.split()
    assert "cilium.io/v2alpha1" in versions and "cilium.io/v2" in versions


def test_custom_resources_of_the_new_kinds_are_validated(
    kube_apiserver: KubeAPI, installed: list[dict[str, Any]]
) -> None:
    name = unique_name("dry")
    good = [
        {
            "apiVersion": "cilium.io/v2alpha1",
            "kind": "CiliumEndpointSlice",
            "metadata": {"name": name},
            "namespace": "default",
            "endpoints": [
                {
                    "name": "web-0",
                    "id": 12345,
                    "networking": {"addressing": [{"ipv4": "10.0.1.5"}], "node": "192.0.2.1"},
                }
            ],
        },
        {
            "apiVersion": "cilium.io/v2",
            "kind": "CiliumClusterwideNetworkPolicy",
            "metadata": {"name": name},
            "spec": {
                "endpointSelector": {"matchLabels": {"app": "web"}},
                "ingress": [{"fromEndpoints": [{"matchLabels": {"app": "client"}}]}],
            },
        },
        {
            "apiVersion": "cilium.io/v2",
            "kind": "CiliumNodeConfig",
            "metadata": {"name": name, "namespace": "cilia-system"},
            "spec": {"nodeSelector": {}, "defaults": {"debug": "true"}},
        },
    ]
    out = _apply(kube_apiserver, good, "--dry-run=server")
    assert out.returncode == 0, out.stderr

    bad_ccnp = copy.deepcopy(good[1])
    good_ccnp = copy.deepcopy(good[1])
    good_ccnp["spec"]["ingress"][0]["fromCIDRSet"] = [
        {"cidr": "192.0.2.0/24", "except": ["192.0.2.128/25"]}
    ]
    out = _apply(kube_apiserver, [good_ccnp], "--dry-run=server")
    assert out.returncode == 0, out.stderr
    bad_ccnp["spec"]["ingress"][0]["fromCIDR"] = ["fd00::/8"]  # IPv4 only: refused
    bad_cnc = copy.deepcopy(good[2])
    del bad_cnc["spec"]["nodeSelector"]  # required
    bad_ces = copy.deepcopy(good[0])
    del bad_ces["endpoints"]  # required
    for bad, needle in ((bad_ccnp, "fromCIDR"), (bad_cnc, "nodeSelector"), (bad_ces, "endpoints")):
        out = _apply(kube_apiserver, [bad], "--dry-run=server")
        assert out.returncode != 0 and needle in out.stderr, (bad["kind"], out.stderr)


def test_the_policy_schemas_hold_on_the_server(
    kube_apiserver: KubeAPI, installed: list[dict[str, Any]]
) -> None:
    """What the CNP/CCNP schema promises, enforced by the API server: ports as numbers,
    numeric strings 0..65535 or IANA service names (named ports, as upstream's CRD), and
    spec or specs required (a CEL rule at the root)."""

    def cnp(name: str, **body: Any) -> dict[str, Any]:
        return {
            "apiVersion": "cilium.io/v2",
            "kind": "CiliumNetworkPolicy",
            "metadata": {"name": name, "namespace": "default"},
            **body,
        }

    def ports(*values: Any) -> dict[str, Any]:
        rules = [{"toPorts": [{"ports": [{"port": v, "protocol": "TCP"}]}]} for v in values]
        return {"spec": {"endpointSelector": {}, "ingress": rules}}

    ok = _apply(kube_apiserver, [cnp(unique_name("ports"), **ports(8080, "443", 0, 65535, "http"))],
                "--dry-run=server")  # fmt: skip
    assert ok.returncode == 0, ok.stderr
    for bad, needle in (
        (cnp(unique_name("big"), **ports(70000)), "65535"),
        (cnp(unique_name("named"), **ports("not a name!")), "should match"),
        (cnp(unique_name("empty")), "one of spec, specs is required"),
    ):
        out = _apply(kube_apiserver, [bad], "--dry-run=server")
        assert out.returncode != 0 and needle in out.stderr, (bad, out.stderr)


def _can(kube: KubeAPI, sa: str, verb: str, resource: str, ns: str = "cilia-system") -> bool:
    out = kube.kubectl(
        "auth", "can-i", verb, resource, "-n", ns, f"--as=system:serviceaccount:cilia-system:{sa}",
        check=False,
    )  # fmt: skip
    assert out.stdout.strip() in ("yes", "no"), (out.stdout, out.stderr)
    return out.stdout.strip() == "yes"


def test_service_accounts_get_only_the_rights_they_use(
    kube_apiserver: KubeAPI, installed: list[dict[str, Any]]
) -> None:
    """The RBAC objects applied for real, then asked through the API server's authorizer:
    the agent (which talks only to the operator) can do nothing but what its kube-rbac-proxy
    sidecar needs; the updater deletes pods only in cilia-system; the operator holds its
    Lease."""
    rbac_kinds = ("ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding")
    out = _apply(kube_apiserver, [d for d in installed if d["kind"] in rbac_kinds])
    assert out.returncode == 0, out.stderr
    for verb, resource in (
        ("get", "pods"),
        ("list", "nodes"),
        ("watch", "ciliumnetworkpolicies.cilium.io"),
        ("update", "ciliumnodes.cilium.io"),
        ("create", "ciliumendpoints.cilium.io"),
        ("get", "secrets"),
    ):
        assert not _can(kube_apiserver, "cilia-agent", verb, resource), (verb, resource)
    assert _can(kube_apiserver, "cilia-agent", "create", "tokenreviews.authentication.k8s.io")
    assert _can(kube_apiserver, "cilia-safe-agent-updater", "delete", "pods")
    assert not _can(kube_apiserver, "cilia-safe-agent-updater", "delete", "pods", ns="default")
    assert _can(kube_apiserver, "cilia-operator", "update", "leases.coordination.k8s.io")
    # the kinds its Kubernetes store serves: slices it writes, clusterwide policies it streams
    for verb, resource in (
        ("create", "ciliumendpointslices.cilium.io"),
        ("watch", "ciliumclusterwidenetworkpolicies.cilium.io"),
        ("watch", "pods"),
        ("watch", "nodes"),
    ):
        assert _can(kube_apiserver, "cilia-operator", verb, resource), (verb, resource)
    assert not _can(kube_apiserver, "cilia-relay", "list", "pods")


def _strip_descriptions(node: Any) -> Any:
    if isinstance(node, dict):
        return {k: _strip_descriptions(v) for k, v in node.items() if k != "description"}
    if isinstance(node, list):
        return [_strip_descriptions(v) for v in node]
    return node


def test_clusterwide_policy_schema_is_the_namespaced_one() -> None:
    """One rule language: the CCNP CRD's schema equals the CNP CRD's (descriptions aside)."""

    def schema(name: str) -> Any:
        crd = yaml.safe_load((CRD_DIR / name).read_text())
        [version] = crd["spec"]["versions"]
        return _strip_descriptions(version["schema"])

    assert schema("ciliumclusterwidenetworkpolicies.yaml") == schema("ciliumnetworkpolicies.yaml")
