"""``--ipam kubernetes`` against a real kube-apiserver: a node's pod CIDRs are its Node
object's ``spec.podCIDRs``; a Node without them is reported on its CiliumNode and its agent
never becomes ready (no address is guessed).

Its own module: CiliumNodes are cluster-scoped, and another module's operator (another IPAM
mode) on the same API server would reconcile the same records while it runs.
"""

from __future__ import annotations

import ipaddress
import json
import os
from typing import Any

import pytest
from support import pod_object

from cilia_testkit import ROOT, cni, host
from cilia_testkit.kubeapi import KubeAPI, unique_name
from cilia_testkit.stack import Stack

pytestmark = [pytest.mark.e2e, pytest.mark.privileged]

#: Seconds the operator may take to report the node without pod CIDRs.
REPORT_SECONDS = 15.0


def test_ipam_kubernetes_takes_the_nodes_pod_cidrs_and_reports_a_node_without_any(
    kube_apiserver: KubeAPI, pods_registry: Any
) -> None:
    kube = kube_apiserver
    kube.install_crds(ROOT / "deploy" / "helm" / "cilia" / "files" / "crds")
    node, bare, namespace = unique_name("ipam"), unique_name("bare"), unique_name("ipamns")
    pod_cidr = "10.251.7.0/24"  # no other test's pool is near it
    objects = {
        "apiVersion": "v1",
        "kind": "List",
        "items": [
            {"apiVersion": "v1", "kind": "Node", "metadata": {"name": node},
             "spec": {"podCIDRs": [pod_cidr]}},
            {"apiVersion": "v1", "kind": "Node", "metadata": {"name": bare}},
            {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}},
            {"apiVersion": "v1", "kind": "ServiceAccount",
             "metadata": {"name": "default", "namespace": namespace}},
        ],
    }  # fmt: skip
    applied = kube.kubectl("apply", "-f", "-", input=json.dumps(objects), check=False)
    assert applied.returncode == 0, applied.stderr
    stack = Stack(
        "e2e-k8s-ipam",
        relay=False,
        auto_pool=False,
        operator_args=(
            "--store", "kubernetes", "--kubeconfig", str(kube.kubeconfig), "--ipam", "kubernetes",
        ),
        agents=0,
        agent_args=("--ipam", "kubernetes"),
    )  # fmt: skip
    pod = cni.Pod(name=f"cilia-e2e-{os.getpid()}-k8s-ipam", namespace=namespace)
    try:
        stack.start()
        stack.add_agent(node_name=node).start()
        made = kube.kubectl(
            "apply", "-n", namespace, "-f", "-", check=False,
            input=json.dumps(pod_object(pod.name, node, "ipam", "default")),
        )  # fmt: skip
        assert made.returncode == 0, made.stderr
        pod.create_netns()
        outcome = pod.add(stack.agent.conflist())
        assert outcome.returncode == 0, outcome.stdout + stack.logs()
        assert ipaddress.ip_address(pod.ip) in ipaddress.ip_network(pod_cidr), pod.ip
        # a node whose Node object has no podCIDRs: said so on its CiliumNode, no address
        lonely = stack.add_agent(node_name=bare)
        lonely.launch()

        def reported() -> str:
            got = stack.operator_cli("get", "ciliumnodes", bare, "-o", "json")
            return got.stdout if "no IPv4 spec.podCIDRs" in got.stdout else ""

        assert host.wait_for(lambda: bool(reported()), REPORT_SECONDS), stack.logs()
        assert 'podCIDRs": [' not in reported().replace(" ", ""), reported()
        assert not lonely.conflist_path.exists(), "a node without pod CIDRs is not ready"
    finally:
        if pod.result is not None and stack.agent.conflist_path.exists():
            pod.delete(stack.agent.conflist())
        pod.destroy_netns()
        stack.stop()
        kube.kubectl("delete", "namespace", namespace, "--wait=false", check=False)
        kube.kubectl("delete", "node", node, bare, check=False)
