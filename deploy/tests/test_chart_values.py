"""The chart's values with the real helm: `helm lint`, a matrix of value combinations that
render to manifests the Kubernetes schemas and the binaries' parsers accept with the flags
each value maps to, and bad values refused by values.schema.json or templates/validate.yaml
with one clear line and nothing rendered.

The bad values are files under deploy/tests/bad-values/, each starting with a comment line
``# refused: <text the error must hold>``, so a reader sees the rule beside its input.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
from helmrender import CHART, container, documents, find, run_helm, template
from test_chart_manifests import KUBERNETES_VERSION, check_flags

BAD_VALUES = Path(__file__).with_name("bad-values")


def _agent_args(docs: list[dict[str, Any]]) -> list[str]:
    args: list[str] = container(docs, "DaemonSet", "cilia-agent", "agent")["args"]
    return args


def _operator_args(docs: list[dict[str, Any]]) -> list[str]:
    args: list[str] = container(docs, "Deployment", "cilia-operator", "operator")["args"]
    return args


def test_helm_lint_passes_with_default_and_strict(helm: Path) -> None:
    out = run_helm(helm, "lint", "--strict", str(CHART))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "1 chart(s) linted, 0 chart(s) failed" in out.stdout


def test_helm_lint_fails_on_a_bad_value(helm: Path) -> None:
    """lint runs the schema too: the check above could fail."""
    out = run_helm(helm, "lint", str(CHART), "--set", "routingMode=geneve")
    assert out.returncode != 0 and "routingMode" in out.stdout + out.stderr


MATRIX: list[tuple[str, dict[str, Any], list[str], list[str]]] = [
    # (id, values, agent args expected, operator args expected)
    (
        "defaults",
        {},
        [
            "--ipam=kubernetes",
            "--routing-mode=native",
            "--auto-direct-node-routes=false",
            "--enable-ipv4-masquerade=true",
            "--enable-bpf-masquerade=false",
            "--kube-proxy-replacement=false",
        ],
        ["--ipam=kubernetes"],
    ),
    (
        "cluster-pool-native-routes",
        {
            "ipam": {
                "mode": "cluster-pool",
                "operator": {
                    "clusterPoolIPv4PodCIDRList": ["10.8.0.0/16", "10.9.0.0/16"],
                    "clusterPoolIPv4MaskSize": 26,
                },
            },
            "autoDirectNodeRoutes": True,
            "ipv4NativeRoutingCIDR": "10.8.0.0/15",
        },
        [
            "--ipam=cluster-pool",
            "--auto-direct-node-routes=true",
            "--ipv4-native-routing-cidr=10.8.0.0/15",
        ],
        [
            "--ipam=cluster-pool",
            "--cluster-pool-ipv4-cidr=10.8.0.0/16,10.9.0.0/16",
            "--cluster-pool-ipv4-mask-size=26",
        ],
    ),
    (
        "multi-pool-tunnel-bpf-masq",
        {
            "ipam": {
                "mode": "multi-pool",
                "operator": {
                    "autoCreateCiliumPodIPPools": {
                        "default": {"ipv4": {"cidrs": ["10.10.0.0/16"], "maskSize": 24}},
                        "blue": {
                            "ipv4": {"cidrs": ["10.20.0.0/16", "10.21.0.0/16"], "maskSize": 27}
                        },
                    }
                },
            },
            "routingMode": "tunnel",
            "MTU": 1450,
        },
        [
            "--ipam=multi-pool",
            "--routing-mode=tunnel",
            "--tunnel-protocol=vxlan",
            "--enable-bpf-masquerade=false",
            "--mtu=1450",
            "--ipam-default-ip-pool=default",
        ],
        [
            "--ipam=multi-pool",
            "--auto-create-cilium-pod-ip-pools=blue=ipv4-cidrs:10.20.0.0/16,"
            "10.21.0.0/16;ipv4-mask-size:27 default=ipv4-cidrs:10.10.0.0/16;ipv4-mask-size:24",
        ],
    ),
    (
        "bpf-masquerade",
        {
            "kubeProxyReplacement": True,
            "k8sServiceHost": "192.0.2.1",
            "bpf": {"masquerade": True},
        },
        [
            "--enable-ipv4-masquerade=true",
            "--enable-bpf-masquerade=true",
            "--kube-proxy-replacement=true",
        ],
        [],
    ),
    (
        "no-masquerade-kpr",
        {
            "enableIPv4Masquerade": False,
            "kubeProxyReplacement": True,
            "k8sServiceHost": "192.0.2.1",
            "k8sServicePort": 6445,
            "cluster": {"name": "blue"},
            "policyEnforcementMode": "always",
            "policyAuditMode": True,
            "cni": {"exclusive": False, "uninstall": True, "chainingMode": "portmap"},
        },
        [
            "--enable-ipv4-masquerade=false",
            "--enable-bpf-masquerade=false",
            "--kube-proxy-replacement=true",
            "--cluster-name=blue",
            "--enable-policy=always",
            "--policy-audit-mode=true",
            "--cni-exclusive=false",
            "--cni-uninstall=true",
            "--cni-chaining-mode=portmap",
        ],
        ["--ipam=kubernetes"],
    ),
]


@pytest.mark.parametrize(("values", "agent", "operator"), [m[1:] for m in MATRIX],
                         ids=[m[0] for m in MATRIX])  # fmt: skip
def test_value_matrix_renders_valid_manifests_with_the_mapped_flags(
    helm: Path, values: dict[str, Any], agent: list[str], operator: list[str]
) -> None:
    docs = documents(template(helm, values=values))
    agent_args, operator_args = _agent_args(docs), _operator_args(docs)
    assert set(agent) <= set(agent_args), set(agent) - set(agent_args)
    assert set(operator) <= set(operator_args), set(operator) - set(operator_args)
    # what must not be there
    if values.get("routingMode") == "tunnel":
        assert not [a for a in agent_args if a.startswith("--auto-direct-node-routes")]
    else:
        assert not [a for a in agent_args if a.startswith("--tunnel-protocol")]
    if "MTU" not in values:
        assert not [a for a in agent_args if a.startswith("--mtu")], "MTU 0 = detect: no flag"
    errors = []
    for d in docs:
        if d["apiVersion"].startswith("monitoring.coreos.com/"):
            continue  # not a kind kubernetes-validate knows (the manifest test checks them)
        try:
            kubernetes_validate.validate(d, KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            errors.append(f"{d['kind']}/{d['metadata']['name']}: {exc.message}")
    assert not errors, "\n".join(errors)
    check_flags(docs)


def test_cni_paths_and_images_follow_their_values(helm: Path) -> None:
    docs = documents(template(helm, values={
        "cni": {"binPath": "/usr/libexec/cni", "confPath": "/etc/kubernetes/cni/net.d",
                "image": {"repository": "registry.example/cilia-cni", "tag": "9.9"}},
        "image": {"repository": "registry.example/cilia-agent", "tag": "1.2",
                  "pullPolicy": "Always"},
        "operator": {"image": {"repository": "registry.example/op", "tag": "3"}, "replicas": 3},
    }))  # fmt: skip
    pod = documents(template(helm))  # defaults, for contrast
    spec = find(docs, "DaemonSet", "cilia-agent")
    volumes = {v["name"]: v for v in spec["spec"]["template"]["spec"]["volumes"]}
    assert volumes["cni-path"]["hostPath"]["path"] == "/usr/libexec/cni"
    assert volumes["etc-cni-netd"]["hostPath"]["path"] == "/etc/kubernetes/cni/net.d"
    agent = container(docs, "DaemonSet", "cilia-agent", "agent")
    assert (agent["image"], agent["imagePullPolicy"]) == (
        "registry.example/cilia-agent:1.2",
        "Always",
    )
    assert container(docs, "DaemonSet", "cilia-agent", "install-cni-binaries")["image"] == (
        "registry.example/cilia-cni:9.9"
    )
    updater = find(docs, "DaemonSet", "cilia-safe-agent-updater")["spec"]["template"]["spec"]
    prepulled = {c["image"] for c in updater["initContainers"]}
    assert {"registry.example/cilia-agent:1.2", "registry.example/cilia-cni:9.9"} <= prepulled
    op = find(docs, "Deployment", "cilia-operator")
    assert op["spec"]["replicas"] == 3
    assert container(pod, "DaemonSet", "cilia-agent", "agent")["image"] == "cilia-agent:0.1.0"


def test_vxlan_offload_init_step_only_in_tunnel_mode(helm: Path) -> None:
    def inits(values: dict[str, Any]) -> list[str]:
        docs = documents(template(helm, values=values))
        spec = find(docs, "DaemonSet", "cilia-agent")["spec"]["template"]["spec"]
        return [c["name"] for c in spec["initContainers"]]

    assert "handle-vxlan-offload" not in inits({})
    tunnel = inits({"routingMode": "tunnel", "autoDirectNodeRoutes": False})
    assert tunnel.index("clearing-unnecessary-iptables") < tunnel.index("handle-vxlan-offload")
    assert tunnel.index("handle-vxlan-offload") < tunnel.index("mount-cgroup")
    docs = documents(
        template(helm, values={"routingMode": "tunnel", "autoDirectNodeRoutes": False})
    )
    step = container(docs, "DaemonSet", "cilia-agent", "handle-vxlan-offload")
    assert step["args"] == ["init", "handle-vxlan-offload"]
    node_ip = next(e for e in step["env"] if e["name"] == "NODE_IP")
    assert node_ip["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"


def _bad_cases() -> list[Path]:
    return sorted(BAD_VALUES.glob("*.yaml"))


def test_there_are_bad_value_cases() -> None:
    assert len(_bad_cases()) >= 10


@pytest.mark.parametrize("path", _bad_cases(), ids=lambda p: p.stem)
def test_bad_values_are_refused_with_one_clear_line(helm: Path, path: Path) -> None:
    """`helm template` (which `helm install` runs first: nothing is sent to the cluster when it
    fails) exits non-zero, renders nothing, and the error holds the case's expected text."""
    first = path.read_text().splitlines()[0]
    m = re.match(r"^# refused: (.+)$", first)
    assert m, f"{path.name}: first line must be '# refused: <text>'"
    out = template(helm, values_file=path)
    assert out.returncode != 0, f"{path.name} was accepted:\n{out.stdout[:400]}"
    assert out.stdout == ""
    assert m.group(1) in out.stderr, out.stderr
    # one line states the problem: a schema violation ("- at '/path': why") or a template's
    # fail ("Error: execution error at (file:line): why"); the rest is helm's frame
    problems = [line for line in out.stderr.splitlines()
                if line.lstrip().startswith("- at ") or line.startswith("Error: execution error")]  # fmt: skip
    assert len(problems) == 1, out.stderr


def test_the_cidr_arithmetic_tells_neighbours_from_overlaps(helm: Path) -> None:
    """Adjacent blocks pass, a one-address overlap is refused (the helpers compute ranges,
    not string prefixes)."""
    ok = template(
        helm,
        values={
            "nodeCIDRs": ["10.1.0.0/16"],
            "ipam": {
                "mode": "cluster-pool",
                "operator": {"clusterPoolIPv4PodCIDRList": ["10.0.0.0/16"]},
            },
        },
    )
    assert ok.returncode == 0, ok.stderr
    bad = template(
        helm,
        values={
            "nodeCIDRs": ["10.0.255.255/32"],
            "ipam": {
                "mode": "cluster-pool",
                "operator": {"clusterPoolIPv4PodCIDRList": ["10.0.0.0/16"]},
            },
        },
    )
    assert bad.returncode != 0 and "overlaps node network 10.0.255.255/32" in bad.stderr
