"""The chart computes the agent generation hash itself, and the safe-agent-updater agrees.

1. Offline: on a render by the real helm, ``cilia-safe-agent-updater hash`` (the updater's own
   definition, ``generation.template_hash``) prints the value the chart stamped on the agent
   pod template and on the updater DaemonSet (object and pod template); a value change that
   touches the agent's pod (MTU) changes it, one that does not (relay replicas) does not.
2. Against a REAL kube-apiserver (the testkit's ``kube_apiserver``): the rendered agent
   DaemonSet applied in a namespace of this test, an agent pod on a node carrying the
   annotation the DaemonSet's template has (as the DaemonSet controller copies it), and the
   updater in kubernetes mode with ``--expected-generation`` taken from the rendered updater
   pod template (what the downward API gives it): exit 0, step AgentUpToDate, the pod kept.
   After the chart is rendered again with another MTU and applied, the same pod is outdated:
   the updater goes on to the image check (exit 14 on a node that reports no images, before
   deleting anything), and an updater of the old render exits 19 (generation skew).

No DaemonSet controller runs on the test server, so there are no ControllerRevisions and the
updater compares the annotations, which is what the chart's hash is for.
"""

from __future__ import annotations

import io
import json
import subprocess
import sys
from contextlib import redirect_stderr
from pathlib import Path
from typing import Any

import pytest
import yaml
from helmrender import documents, find, template

from cilia_safe_agent_updater.__main__ import main
from cilia_safe_agent_updater.exitcodes import Exit
from cilia_testkit.kubeapi import KubeAPI, unique_name

ANNOTATION = "safe-agent-updater-daemonset-generation"


def _stamps(docs: list[dict[str, Any]]) -> tuple[str, str, str]:
    agent = find(docs, "DaemonSet", "cilia-agent")
    updater = find(docs, "DaemonSet", "cilia-safe-agent-updater")
    return (
        agent["spec"]["template"]["metadata"]["annotations"][ANNOTATION],
        updater["metadata"]["annotations"][ANNOTATION],
        updater["spec"]["template"]["metadata"]["annotations"][ANNOTATION],
    )


def _updater_hash(rendered_yaml: str) -> str:
    out = subprocess.run(
        [str(Path(sys.executable).parent / "cilia-safe-agent-updater"), "hash", "-f", "-"],
        input=rendered_yaml, capture_output=True, text=True, check=False, timeout=60,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_the_updater_computes_the_hash_the_chart_stamped(helm: Path) -> None:
    out = template(helm)
    agent, updater, updater_pod = _stamps(documents(out))
    assert len(agent) == 64 and int(agent, 16) >= 0
    assert agent == updater == updater_pod
    assert _updater_hash(out.stdout) == agent

    mtu = template(helm, values={"MTU": 1450})
    assert _stamps(documents(mtu))[0] != agent, "an agent flag changed: a new generation"
    assert _updater_hash(mtu.stdout) == _stamps(documents(mtu))[0]
    relay = template(helm, values={"hubble": {"relay": {"replicas": 2}}})
    assert _stamps(documents(relay))[0] == agent, "the agent's pod did not change"


def _apply(kube: KubeAPI, *docs: dict[str, Any]) -> None:
    out = kube.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(docs), check=False)
    assert out.returncode == 0, out.stderr


def _run_updater(kube: KubeAPI, ns: str, node: str, expected: str) -> tuple[int, list[str]]:
    err = io.StringIO()
    with redirect_stderr(err):
        code = main(["--mode", "kubernetes", "--kubeconfig", str(kube.kubeconfig),
                     "--namespace", ns, "--node-name", node, "--agent-health-address", "",
                     "--expected-generation", expected, "--poll-interval", "0.05",
                     "--image-check-attempts", "1", "--api-retry-backoff", "0.01"])  # fmt: skip
    steps = []
    for line in err.getvalue().splitlines():
        try:
            steps.append(json.loads(line).get("step", ""))
        except ValueError:
            continue
    return code, steps


@pytest.fixture
def namespace(kube_apiserver: KubeAPI) -> str:
    ns = unique_name("gen")
    _apply(kube_apiserver, {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}})
    # no controller manager runs here to create the namespace's default ServiceAccount
    _apply(kube_apiserver, {"apiVersion": "v1", "kind": "ServiceAccount",
                            "metadata": {"name": "default", "namespace": ns}})  # fmt: skip
    return ns


def test_the_updater_accepts_the_charts_generation_on_a_real_api_server(
    helm: Path, kube_apiserver: KubeAPI, namespace: str
) -> None:
    kube, ns = kube_apiserver, namespace
    first = documents(template(helm, namespace=ns))
    agent_ds = find(first, "DaemonSet", "cilia-agent")
    generation, _, expected = _stamps(first)
    _apply(kube, agent_ds)
    node = f"{ns}-node"
    _apply(kube, {"apiVersion": "v1", "kind": "Node", "metadata": {"name": node}})
    pod_meta = agent_ds["spec"]["template"]["metadata"]
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "cilia-agent-x1", "namespace": ns, "labels": pod_meta["labels"],
                     "annotations": pod_meta["annotations"]},
        "spec": {"nodeName": node, "containers": [{"name": "agent", "image": "cilia-agent:0.1.0"}]},
    }  # fmt: skip
    _apply(kube, pod)
    uid = json.loads(kube.kubectl("get", "pod", "cilia-agent-x1", "-n", ns, "-o", "json").stdout)[
        "metadata"
    ]["uid"]

    code, steps = _run_updater(kube, ns, node, expected)
    assert code == Exit.OK, steps
    assert "AgentUpToDate" in steps and "AgentOutdated" not in steps

    # the chart rendered again with an agent change, applied: the pod is now outdated
    second = documents(template(helm, namespace=ns, values={"MTU": 1450}))
    new_generation, _, new_expected = _stamps(second)
    assert new_generation != generation
    _apply(kube, find(second, "DaemonSet", "cilia-agent"))
    code, steps = _run_updater(kube, ns, node, new_expected)
    assert code == Exit.IMAGES_MISSING, steps  # the node reports no images: nothing deleted
    assert "AgentOutdated" in steps
    still = json.loads(kube.kubectl("get", "pod", "cilia-agent-x1", "-n", ns, "-o", "json").stdout)
    assert still["metadata"]["uid"] == uid
    # an updater pod of the first render sees the DaemonSet moved on
    code, steps = _run_updater(kube, ns, node, expected)
    assert code == Exit.GENERATION_SKEW, steps
