"""The chart deploy/helm/cilia rendered with the real helm (default values): valid against the
Kubernetes schemas, flags the binaries accept, the generation hash the updater expects, the
Secrets every volume mounts, and the issue's layout rules.

helm is the upstream CLI (scripts/helm-cli.sh); without it the tests skip with the build's
reason, and fail in CI. The value matrix and the refused values are in test_chart_values.py.
"""

from __future__ import annotations

import argparse
import copy
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml
from helmrender import HOOK, NAMESPACE, documents, find, template

#: Kubernetes version the manifests are validated against (kubernetes-validate's schemas).
KUBERNETES_VERSION = "1.32.0"
ANNOTATION = "safe-agent-updater-daemonset-generation"
#: Flags of the cross-helper contract (agent: masquerading, native routing) that other
#: branches are adding to the agent right now. The chart emits them; while the agent's parser
#: does not know one yet, the flag check leaves it out (and says so in the test's output).
#: Once the agent has them, they are parsed like every other flag: nothing to change here.
PENDING_AGENT_FLAGS = {
    "--enable-ipv4-masquerade",
    "--enable-bpf-masquerade",
    "--ipv4-native-routing-cidr",
    "--auto-direct-node-routes",
    "--tunnel-protocol",
}


@pytest.fixture(scope="module")
def docs(rendered: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return rendered


def _find(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    return find(docs, kind, name)


def _crd_schemas(paths: list[Path]) -> dict[tuple[str, str], dict[str, Any]]:
    """(apiVersion, kind) → the openAPIV3Schema of each served version of these CRD files."""
    out = {}
    for path in paths:
        crd = yaml.safe_load(path.read_text())
        group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
        for v in crd["spec"]["versions"]:
            out[(f"{group}/{v['name']}", kind)] = v["schema"]["openAPIV3Schema"]
    return out


def test_every_object_is_valid_for_the_pinned_kubernetes(
    docs: list[dict[str, Any]], monitoring_crds: list[Path]
) -> None:
    """Built-in kinds against kubernetes-validate's schemas (strict: no unknown field); the
    prometheus-operator kinds (PodMonitor, ServiceMonitor), which it does not know, against
    their upstream CRDs' schemas (unknown fields there are refused by the server dry run)."""
    custom = _crd_schemas(monitoring_crds)
    errors = []
    checked_custom = 0
    for d in docs:
        schema = custom.get((d["apiVersion"], d["kind"]))
        if schema is not None:
            checked_custom += 1
            for err in jsonschema.Draft7Validator(schema).iter_errors(d):
                errors.append(
                    f"{d['kind']}/{d['metadata']['name']}: {err.message} at {list(err.path)}"
                )
            continue
        try:
            kubernetes_validate.validate(d, KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            errors.append(f"{d['kind']}/{d['metadata']['name']}: {exc.message} at {list(exc.path)}")
    assert not errors, "\n".join(errors)
    assert checked_custom == 2, "the PodMonitor and the ServiceMonitor were not both checked"


def test_a_broken_monitor_is_refused_by_its_crd_schema(
    docs: list[dict[str, Any]], monitoring_crds: list[Path]
) -> None:
    monitor = copy.deepcopy(_find(docs, "PodMonitor", "cilia-agent"))
    monitor["spec"]["podMetricsEndpoints"][0]["scheme"] = "gopher"
    schema = _crd_schemas(monitoring_crds)[(monitor["apiVersion"], "PodMonitor")]
    assert list(jsonschema.Draft7Validator(schema).iter_errors(monitor))


def test_a_broken_object_is_refused_by_the_validator(docs: list[dict[str, Any]]) -> None:
    """The validator really checks: an unknown field in the agent DaemonSet fails (strict)."""
    ds = _find(docs, "DaemonSet", "cilia-agent")
    broken = yaml.safe_load(yaml.safe_dump(ds))
    broken["spec"]["updateStrategi"] = {"type": "OnDelete"}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBERNETES_VERSION, strict=True)


def test_all_namespaced_objects_land_in_the_release_namespace(helm: Path) -> None:
    """Every namespaced object (and every ServiceAccount subject, and the kube-rbac-proxy
    resource attributes) follows `helm install -n`; nothing names a fixed namespace."""
    cluster_kinds = {"Namespace", "CustomResourceDefinition", "ClusterRole", "ClusterRoleBinding"}
    out = template(helm, namespace="kube-system")
    assert "cilia-system" not in out.stdout
    docs = documents(out, hooks=True)
    for d in docs:
        if d["kind"] not in cluster_kinds:
            assert d["metadata"].get("namespace") == "kube-system", d["metadata"]["name"]
        for subject in d.get("subjects", []):
            assert subject["namespace"] == "kube-system", d["metadata"]["name"]
    args = _find(docs, "DaemonSet", "cilia-agent")["spec"]["template"]["spec"]["containers"][0][
        "args"
    ]
    assert "--operator=k8s:kube-system/cilia-operator" in args


def test_crds_include_the_operator_ipam_ones(docs: list[dict[str, Any]]) -> None:
    crds = {d["metadata"]["name"] for d in docs if d["kind"] == "CustomResourceDefinition"}
    assert {
        "ciliumnetworkpolicies.cilium.io",
        "ciliumpodippools.cilium.io",
        "ciliumnodes.cilium.io",
    } <= crds


def test_generation_hash_is_stamped_and_current(docs: list[dict[str, Any]]) -> None:
    """The committed annotation equals `cilia-safe-agent-updater hash` of the rendering, on
    the agent template, the updater DaemonSet and its template (else: re-stamp, README)."""
    from cilia_safe_agent_updater.generation import template_hash

    agent = _find(docs, "DaemonSet", "cilia-agent")
    updater = _find(docs, "DaemonSet", "cilia-safe-agent-updater")
    want = template_hash(agent["spec"]["template"])
    assert agent["spec"]["template"]["metadata"]["annotations"][ANNOTATION] == want, (
        f"stale generation hash: set {ANNOTATION}: {want!r} in agent/daemonset.yaml and "
        "safe-agent-updater/daemonset.yaml"
    )
    assert updater["metadata"]["annotations"][ANNOTATION] == want
    assert updater["spec"]["template"]["metadata"]["annotations"][ANNOTATION] == want


def test_agent_daemonset_layout(docs: list[dict[str, Any]]) -> None:
    ds = _find(docs, "DaemonSet", "cilia-agent")
    spec = ds["spec"]["template"]["spec"]
    assert ds["spec"]["updateStrategy"] == {"type": "OnDelete"}
    assert spec["hostNetwork"] is True
    # the module's init containers in its order, each one `cilia-agent init <step>`
    assert [c["name"] for c in spec["initContainers"]] == [
        "check-linux-kernel",
        "clearing-unnecessary-iptables",
        "mount-cgroup",
        "apply-sysctl-overwrites",
        "mount-bpf-fs",
        "clean-cilia-state",
        "install-cni-binaries",
    ]
    steps = [c["args"][:2] for c in spec["initContainers"][:-1]]
    assert steps == [
        ["init", "check-kernel"],
        ["init", "iptables-backend"],
        ["init", "mount-cgroup2"],
        ["init", "sysctl"],
        ["init", "mount-bpffs"],
        ["init", "clean-state"],
    ]
    agent = spec["containers"][0]
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert probe in agent, probe
    assert {c["name"] for c in spec["containers"]} == {"agent", "cni-server", "kube-rbac-proxy"}
    # the static cilia-cni looks for cilia-cni.sock in the directory of the agent's socket
    server = next(c for c in spec["containers"] if c["name"] == "cni-server")
    assert "--socket=/var/run/cilia/cilia.sock" in agent["args"]
    assert server["command"][-3:] == ["serve", "--socket", "/var/run/cilia/cilia-cni.sock"]
    assert {"name": "cilia-run", "mountPath": "/var/run/cilia"} in server["volumeMounts"]


def test_each_agent_presents_its_own_nodes_kubelet_credentials(
    docs: list[dict[str, Any]],
) -> None:
    """No Secret carries a node's key: the agent's client pair is its node's kubelet client
    certificate (hostPath, read-only, at the host's path so the kubelet's absolute symlink
    resolves); the operator trusts the cluster CA that issued it beside its own."""
    spec = _find(docs, "DaemonSet", "cilia-agent")["spec"]["template"]["spec"]
    agent = next(c for c in spec["containers"] if c["name"] == "agent")
    pair = "/var/lib/kubelet/pki/kubelet-client-current.pem"
    assert f"--tls-operator-client-cert-file={pair}" in agent["args"]
    assert f"--tls-operator-client-key-file={pair}" in agent["args"]
    assert not [a for a in agent["args"] if "$(NODE_NAME).key" in a]
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert volumes["kubelet-pki"]["hostPath"]["path"] == "/var/lib/kubelet/pki"
    mount = next(m for m in agent["volumeMounts"] if m["name"] == "kubelet-pki")
    assert (mount["mountPath"], mount["readOnly"]) == ("/var/lib/kubelet/pki", True)
    operator = _find(docs, "Deployment", "cilia-operator")["spec"]["template"]["spec"]
    args = next(c for c in operator["containers"] if c["name"] == "operator")["args"]
    (cas,) = [a.split("=", 1)[1] for a in args if a.startswith("--tls-client-ca-files=")]
    assert "/var/run/secrets/kubernetes.io/serviceaccount/ca.crt" in cas.split(",")


def test_updater_daemonset_layout(docs: list[dict[str, Any]]) -> None:
    ds = _find(docs, "DaemonSet", "cilia-safe-agent-updater")
    assert ds["spec"]["updateStrategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxUnavailable": 1},
    }
    spec = ds["spec"]["template"]["spec"]
    init = [c["name"] for c in spec["initContainers"]]
    assert init[-1] == "safe-agent-updater" and all(
        n.startswith(("prepull-", "check-")) for n in init[:-1]
    )
    assert "--mode=kubernetes" in spec["initContainers"][-1]["args"]
    agent_images = {
        c["image"]
        for c in [
            *_find(docs, "DaemonSet", "cilia-agent")["spec"]["template"]["spec"]["containers"],
            *_find(docs, "DaemonSet", "cilia-agent")["spec"]["template"]["spec"]["initContainers"],
        ]
    }
    prepulled = {c["image"] for c in spec["initContainers"] if c["name"].startswith("prepull-")}
    assert agent_images <= prepulled, agent_images - prepulled
    paused = {c["image"] for c in spec["containers"] if c["name"].startswith("pause-")}
    assert {i for i in agent_images if "cilia-" in i} <= paused


def test_operator_two_replicas_with_leader_election(docs: list[dict[str, Any]]) -> None:
    dep = _find(docs, "Deployment", "cilia-operator")
    assert dep["spec"]["replicas"] == 2
    args = dep["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--enable-leader-election" in args
    anti = dep["spec"]["template"]["spec"]["affinity"]["podAntiAffinity"]
    assert anti["requiredDuringSchedulingIgnoredDuringExecution"]


def test_metrics_only_behind_kube_rbac_proxy(docs: list[dict[str, Any]]) -> None:
    for kind, name, port in (
        ("Deployment", "cilia-operator", 9963),
        ("DaemonSet", "cilia-agent", 9962),
    ):
        containers = _find(docs, kind, name)["spec"]["template"]["spec"]["containers"]
        main_args = containers[0]["args"]
        assert f"--prometheus-serve-addr=127.0.0.1:{port}" in main_args
        proxy = next(c for c in containers if c["name"] == "kube-rbac-proxy")
        assert f"--upstream=http://127.0.0.1:{port}/" in proxy["args"]
        assert "--allow-paths=/metrics" in proxy["args"]


def test_the_scraper_may_get_exactly_the_metrics_subresources(docs: list[dict[str, Any]]) -> None:
    """Role cilia:prometheus-metrics: `get` on each sidecar's virtual subresource and name
    (the attributes in ConfigMap cilia-kube-rbac-proxy), bound to the account whose token
    the PodMonitor and ServiceMonitor use; both monitors scrape https-metrics over https."""
    config = _find(docs, "ConfigMap", "cilia-kube-rbac-proxy")["data"]
    wanted = set()
    for key in ("agent.yaml", "operator.yaml"):
        attrs = yaml.safe_load(config[key])["authorization"]["resourceAttributes"]
        assert attrs["namespace"] == NAMESPACE and attrs["subresource"] == "prometheus-metrics"
        wanted.add(
            (attrs["apiGroup"], f"{attrs['resource']}/{attrs['subresource']}", attrs["name"])
        )
    role = _find(docs, "Role", "cilia:prometheus-metrics")
    granted = {(g, res, name) for r in role["rules"] for g in r["apiGroups"]
               for res in r["resources"] for name in r["resourceNames"]}  # fmt: skip
    assert granted == wanted
    assert all(r["verbs"] == ["get"] for r in role["rules"])
    assert set(_rules(docs, "cilia-metrics-scraper")) == {
        ("namespace", "apps", res, "get") for _, res, _ in wanted
    }
    secret = _find(docs, "Secret", "cilia-metrics-scraper-token")
    assert secret["metadata"]["annotations"]["kubernetes.io/service-account.name"] == (
        "cilia-metrics-scraper"
    )
    pod_monitor = _find(docs, "PodMonitor", "cilia-agent")
    service_monitor = _find(docs, "ServiceMonitor", "cilia-operator")
    service = _find(docs, "Service", "cilia-operator-metrics")
    assert [p["port"] for p in service["spec"]["ports"]] == [4242]
    assert service_monitor["spec"]["selector"]["matchLabels"].items() <= (
        service["metadata"]["labels"].items()
    )
    for endpoint in (*pod_monitor["spec"]["podMetricsEndpoints"],
                     *service_monitor["spec"]["endpoints"]):  # fmt: skip
        assert endpoint["port"] == "https-metrics" and endpoint["scheme"] == "https"
        assert endpoint["authorization"]["credentials"]["name"] == "cilia-metrics-scraper-token"


def test_relay_deployment_and_service(docs: list[dict[str, Any]]) -> None:
    _find(docs, "Deployment", "cilia-relay")
    svc = _find(docs, "Service", "cilia-relay")
    assert [p["port"] for p in svc["spec"]["ports"]] == [4245]


def _rules(docs: list[dict[str, Any]], sa: str) -> list[tuple[str, str, str, str]]:
    """(scope, apiGroup, resource, verb) granted to a service account."""
    out = []
    for b in docs:
        if b["kind"] not in ("RoleBinding", "ClusterRoleBinding"):
            continue
        if not any(s.get("name") == sa for s in b.get("subjects", [])):
            continue
        role = _find(docs, b["roleRef"]["kind"], b["roleRef"]["name"])
        scope = "namespace" if role["kind"] == "Role" else "cluster"
        for r in role["rules"]:
            for g in r.get("apiGroups", []):
                for res in r.get("resources", []):
                    for v in r["verbs"]:
                        out.append((scope, g, res, v))
    return out


def test_rbac_is_least_privilege(docs: list[dict[str, Any]]) -> None:
    for sa in ("cilia-operator", "cilia-agent", "cilia-safe-agent-updater", "cilia-relay"):
        rules = _rules(docs, sa)
        assert not [r for r in rules if "*" in r], f"{sa} has a wildcard: {rules}"
        assert not [r for r in rules if r[2] == "secrets"], f"{sa} can read secrets"
    assert _rules(docs, "cilia-relay") == []
    upd = set(_rules(docs, "cilia-safe-agent-updater"))
    assert ("namespace", "", "pods", "delete") in upd
    assert ("namespace", "apps", "daemonsets", "get") in upd
    assert not [r for r in upd if r[0] == "cluster" and r[3] != "get"], "cluster-wide writes"
    agent = set(_rules(docs, "cilia-agent"))
    assert not [
        r
        for r in agent
        if r[3] in ("create", "update", "patch", "delete")
        and r[2]
        not in (
            "ciliumnodes",
            "ciliumnodes/status",
            "ciliumendpoints",
            "tokenreviews",
            "subjectaccessreviews",
        )
    ], agent
    op = set(_rules(docs, "cilia-operator"))
    assert ("namespace", "coordination.k8s.io", "leases", "update") in op


def _parsers() -> dict[str, Callable[[], argparse.ArgumentParser]]:
    from cilia_agent.__main__ import _build_parser as agent_parser
    from cilia_hubble_ui.__main__ import build_parser as hubble_ui_parser
    from cilia_operator.__main__ import build_parser as operator_parser
    from cilia_relay.__main__ import build_parser as relay_parser
    from cilia_safe_agent_updater.__main__ import build_parser as updater_parser

    return {
        "cilia-operator": operator_parser,
        "cilia-agent": agent_parser,
        "cilia-relay": relay_parser,
        "cilia-safe-agent-updater": updater_parser,
        "cilia-hubble-ui": hubble_ui_parser,
    }


def _known(parser: argparse.ArgumentParser, args: list[str]) -> tuple[list[str], list[str]]:
    """``args`` split into (what to parse, pending contract flags the parser lacks)."""
    options = set()
    for action in parser._actions:
        options.update(action.option_strings)
    for sub in parser._subparsers._group_actions if parser._subparsers else []:
        for p in sub.choices.values():
            for action in p._actions:
                options.update(action.option_strings)
    keep, pending = [], []
    for a in args:
        flag = a.split("=", 1)[0]
        if flag in PENDING_AGENT_FLAGS and flag not in options:
            pending.append(flag)
        else:
            keep.append(a)
    return keep, pending


def check_flags(docs: list[dict[str, Any]]) -> tuple[set[str], list[str]]:
    """Parse each cilia-* container's args with the service's own argparse parser ($(VAR)
    references replaced by a sample value, as the kubelet expands them); the images checked
    and the pending contract flags left out. Fails the test on a refused flag."""
    parsers = _parsers()
    images: set[str] = set()
    pending: list[str] = []
    for d in docs:
        pod = d.get("spec", {}).get("template", {}).get("spec")
        if not pod:
            continue
        for c in [*pod.get("initContainers", []), *pod.get("containers", [])]:
            image = c["image"].split(":")[0]
            if image not in parsers or "command" in c:
                continue
            args = [
                re.sub(
                    r"\$\(([A-Z_]+)\)",
                    lambda m: (
                        "10.0.0.1"
                        if m.group(1).endswith("HOST")
                        else ("4250" if m.group(1).endswith("PORT") else "x")
                    ),
                    a,
                )
                for a in c.get("args", [])
            ]
            parser = parsers[image]()
            args, left_out = _known(parser, args)
            pending += left_out
            try:
                parser.parse_args(args)
            except SystemExit as exc:
                pytest.fail(f"{d['metadata']['name']}/{c['name']}: {image} refuses {args} ({exc})")
            images.add(image)
    return images, pending


def test_every_flag_is_accepted_by_its_binary(docs: list[dict[str, Any]]) -> None:
    images, pending = check_flags(docs)
    assert images == set(_parsers()), f"no container of {set(_parsers()) - images} was checked"
    if pending:
        print(f"contract flags the agent does not parse yet (left out): {sorted(set(pending))}")


def test_unknown_flag_is_refused_by_the_same_check() -> None:
    with pytest.raises(SystemExit):
        _parsers()["cilia-agent"]().parse_args(["serve", "--no-such-flag=1"])
    with pytest.raises(SystemExit):
        _parsers()["cilia-hubble-ui"]().parse_args(["serve", "--no-such-flag=1"])


def test_hubble_metrics_on_upstream_port_behind_a_headless_service(
    docs: list[dict[str, Any]],
) -> None:
    from cilia_agent.hubble.metrics import parse_metrics

    ds = _find(docs, "DaemonSet", "cilia-agent")
    agent = ds["spec"]["template"]["spec"]["containers"][0]
    assert {"name": "hubble-metrics", "containerPort": 9965} in agent["ports"]
    assert "--hubble-metrics-server=:9965" in agent["args"]
    (handlers,) = [a.split("=", 1)[1] for a in agent["args"] if a.startswith("--hubble-metrics=")]
    assert parse_metrics(handlers), "the handlers named in the manifest parse"
    svc = _find(docs, "Service", "hubble-metrics")
    assert svc["spec"]["clusterIP"] == "None"
    assert svc["spec"]["ports"] == [
        {"name": "hubble-metrics", "port": 9965, "protocol": "TCP", "targetPort": "hubble-metrics"}
    ]
    labels = ds["spec"]["template"]["metadata"]["labels"]
    assert svc["spec"]["selector"].items() <= labels.items()


def test_operator_is_host_network_behind_a_grpc_service(docs: list[dict[str, Any]]) -> None:
    """The contract: operator pods in the host network, Service cilia-operator with a port
    named grpc (the agents read its EndpointSlices), agents told k8s:<namespace>/cilia-operator
    and allowed to read exactly those slices."""
    pod = _find(docs, "Deployment", "cilia-operator")["spec"]["template"]["spec"]
    assert pod["hostNetwork"] is True
    svc = _find(docs, "Service", "cilia-operator")
    assert [(p["name"], p["port"]) for p in svc["spec"]["ports"]] == [("grpc", 4250)]
    agent = _find(docs, "DaemonSet", "cilia-agent")["spec"]["template"]["spec"]["containers"][0]
    assert f"--operator=k8s:{NAMESPACE}/cilia-operator" in agent["args"]
    assert set(_rules(docs, "cilia-agent")) >= {
        ("namespace", "discovery.k8s.io", "endpointslices", v) for v in ("get", "list", "watch")
    }


def test_every_secret_a_pod_mounts_is_rendered(docs: list[dict[str, Any]]) -> None:
    """hubble.tls.auto (method helm): each Secret volume has its Secret with the keys mounted
    (tls.crt, tls.key, ca.crt; cilia-agent-tls: ca.crt only), certificates that parse and chain
    to the CA Secret of their trust domain, with the names the peers check."""
    from cryptography import x509

    secrets = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Secret"}
    mounted = set()
    for d in docs:
        pod = d.get("spec", {}).get("template", {}).get("spec") or {}
        for vol in pod.get("volumes", []):
            if "secret" in vol:
                mounted.add(vol["secret"]["secretName"])
    assert mounted == {
        "cilia-operator-tls", "cilia-agent-tls", "hubble-server-certs",
        "hubble-relay-client-certs", "hubble-relay-server-certs", "hubble-ui-client-certs",
    }  # fmt: skip
    assert mounted <= set(secrets), mounted - set(secrets)
    import base64

    def cert(secret: str, key: str) -> x509.Certificate:
        return x509.load_pem_x509_certificate(base64.b64decode(secrets[secret]["data"][key]))

    assert set(secrets["cilia-agent-tls"]["data"]) == {"ca.crt"}
    for name, ca_secret, dns in (
        ("cilia-operator-tls", "cilia-ca", "cilia-operator"),
        ("hubble-server-certs", "hubble-ca-secret", "*.default.hubble-grpc.cilium.io"),
        ("hubble-relay-server-certs", "hubble-ca-secret", "*.hubble-relay.cilium.io"),
        ("hubble-relay-client-certs", "hubble-ca-secret", None),
        ("hubble-ui-client-certs", "hubble-ca-secret", None),
    ):
        assert set(secrets[name]["data"]) == {"tls.crt", "tls.key", "ca.crt"}, name
        leaf, ca = cert(name, "tls.crt"), cert(ca_secret, "ca.crt")
        assert cert(name, "ca.crt") == ca, name
        leaf.verify_directly_issued_by(ca)
        if dns:
            sans = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
            assert dns in sans.get_values_for_type(x509.DNSName), (name, sans)
    assert cert("cilia-agent-tls", "ca.crt") == cert("cilia-ca", "ca.crt")


def test_k8s_service_host_reaches_every_cilia_container(helm: Path) -> None:
    """k8sServiceHost/Port set: every container of every workload (init containers too) gets
    KUBERNETES_SERVICE_HOST/PORT; unset: none does."""
    docs = documents(
        template(helm, values={"k8sServiceHost": "192.0.2.10", "k8sServicePort": 6445})
    )
    seen = 0
    for d in docs:
        pod = d.get("spec", {}).get("template", {}).get("spec")
        if not pod:
            continue
        for c in [*pod.get("initContainers", []), *pod["containers"]]:
            env = {e["name"]: e.get("value") for e in c.get("env", [])}
            assert env.get("KUBERNETES_SERVICE_HOST") == "192.0.2.10", (
                d["metadata"]["name"],
                c["name"],
            )
            assert env.get("KUBERNETES_SERVICE_PORT") == "6445", (d["metadata"]["name"], c["name"])
            seen += 1
    assert seen >= 15
    for d in _workloads(documents(template(helm))):
        for c in d:
            assert "KUBERNETES_SERVICE_HOST" not in {e["name"] for e in c.get("env", [])}


def _workloads(docs: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    out = []
    for d in docs:
        pod = d.get("spec", {}).get("template", {}).get("spec")
        if pod:
            out.append([*pod.get("initContainers", []), *pod["containers"]])
    return out


def test_disruption_budgets_and_crds_kept_on_uninstall(docs: list[dict[str, Any]]) -> None:
    """PodDisruptionBudgets for the operator, the relay and hubble-ui (maxUnavailable 1, as
    the module's); CRDs annotated helm.sh/resource-policy: keep (policies and pools survive
    an uninstall)."""
    for name, app in (("cilia-operator", "cilia-operator"), ("cilia-relay", "cilia-relay"),
                      ("hubble-ui", "hubble-ui")):  # fmt: skip
        pdb = _find(docs, "PodDisruptionBudget", name)
        assert pdb["spec"] == {"maxUnavailable": 1, "selector": {"matchLabels": {"app": app}}}
    crds = [d for d in docs if d["kind"] == "CustomResourceDefinition"]
    assert len(crds) == 12
    assert all(d["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep" for d in crds)


def test_the_uninstall_hook_runs_a_command_the_agent_has(helm: Path) -> None:
    """The post-delete node-cleanup DaemonSet (a hook: not in the release's manifest) runs
    `cilia-agent init clean-state --all-state` with flags the agent's parser accepts, then its
    CNI removal; it runs on every node (tolerates everything) in the host's network."""
    hooks = [
        d
        for d in documents(template(helm), hooks=True)
        if HOOK in (d["metadata"].get("annotations") or {})
    ]
    assert [(d["kind"], d["metadata"]["name"]) for d in hooks] == [
        ("DaemonSet", "cilia-node-cleanup")
    ]
    assert hooks[0]["metadata"]["annotations"][HOOK] == "post-delete"
    images, _ = check_flags(hooks)
    assert images == {"cilia-agent"}
    spec = hooks[0]["spec"]["template"]["spec"]
    assert spec["tolerations"] == [{"operator": "Exists"}] and spec["hostNetwork"] is True
    script = spec["initContainers"][1]["args"][0]
    assert "rm -f /host/etc/cni/net.d/05-cilia.conflist" in script
    assert "rm -f /host/cni-bin/cilia-cni" in script
    off = documents(template(helm, values={"nodeCleanup": {"enabled": False}}), hooks=True)
    assert not [d for d in off if d["metadata"]["name"] == "cilia-node-cleanup"]


def test_the_uninstall_hooks_cni_removal_restores_the_node(helm: Path, tmp_path: Path) -> None:
    """The hook's remove-cni script, run for real with its /host paths under a temporary
    directory: Cilia's conflist, plugin wrapper, plugin bundle and sysctl drop-in are gone,
    the configs cni.exclusive had moved aside are back under their names, nothing else is
    touched."""
    import subprocess

    [hook] = [
        d
        for d in documents(template(helm), hooks=True)
        if d["metadata"]["name"] == "cilia-node-cleanup"
    ]
    script = hook["spec"]["template"]["spec"]["initContainers"][1]["args"][0]
    host = tmp_path / "host"
    netd, cnibin = host / "etc/cni/net.d", host / "cni-bin"
    lib, sysctl = host / "opt/cni/cilia", host / "etc/sysctl.d"
    for d in (netd, cnibin, lib / "0.1.0-abc", sysctl):
        d.mkdir(parents=True)
    (netd / "05-cilia.conflist").write_text("{}")
    (netd / "10-flannel.conflist.cilia_bak").write_text('{"name": "flannel"}')
    (netd / "99-loopback.conf").write_text("{}")
    (cnibin / "cilia-cni").write_text("#!/bin/sh\n")
    (cnibin / "loopback").write_text("#!/bin/sh\n")
    (lib / "0.1.0-abc" / "cilia-cni").write_text("x")
    (sysctl / "99-zzz-override_cilia.conf").write_text("net.ipv4.ip_forward=1\n")
    (sysctl / "10-other.conf").write_text("")
    out = subprocess.run(["sh", "-ec", script.replace("/host/", f"{host}/")],
                         capture_output=True, text=True, check=False, timeout=30)  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert sorted(p.name for p in netd.iterdir()) == ["10-flannel.conflist", "99-loopback.conf"]
    assert (netd / "10-flannel.conflist").read_text() == '{"name": "flannel"}'
    assert sorted(p.name for p in cnibin.iterdir()) == ["loopback"]
    assert not lib.exists()
    assert sorted(p.name for p in sysctl.iterdir()) == ["10-other.conf"]
    # a second run (a retried pod) finds nothing to do and still succeeds
    again = subprocess.run(["sh", "-ec", script.replace("/host/", f"{host}/")],
                           capture_output=True, text=True, check=False, timeout=30)  # fmt: skip
    assert again.returncode == 0, again.stderr
