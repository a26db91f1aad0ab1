"""Kubernetes mode: a policy Cilia cannot enforce as written gets a Warning Event saying the
agents enforce it fail closed (``policy/reporter.py``), on the session's REAL kube-apiserver.

The API server accepts a NetworkPolicy with a named port and an ``endPort`` (Cilia's
parser does not), so the operator must say so where a user looks (``kubectl get events``,
``kubectl describe``); a policy enforced as written gets no Event.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

from cluster import running_operator
from stores import kube_cilia

from cilia_testkit.kubeapi import KubeAPI, unique_name

__all__ = ["kube_cilia"]


def _events(kube: KubeAPI, namespace: str) -> list[dict[str, Any]]:
    out = kube.kubectl("get", "events", "-n", namespace, "-o", "json")
    return list(json.loads(out.stdout)["items"])


def test_a_networkpolicy_with_a_named_port_gets_a_fail_closed_event(kube_cilia: KubeAPI) -> None:
    kube = kube_cilia
    ns = unique_name("pe")
    kube.kubectl("create", "namespace", ns)
    # an egress named port: Cilia resolves named ports on ingress only
    named = {
        "apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
        "metadata": {"name": "named", "namespace": ns},
        "spec": {"podSelector": {"matchLabels": {"app": "web"}},
                 "policyTypes": ["Egress"],
                 "egress": [{"ports": [{"protocol": "TCP", "port": "serve-80"}]}]},
    }  # fmt: skip
    fine = {
        "apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
        "metadata": {"name": "fine", "namespace": ns},
        "spec": {"podSelector": {}, "ingress": [{"ports": [{"protocol": "TCP", "port": 80}]}]},
    }  # fmt: skip

    async def scenario() -> list[dict[str, Any]]:
        settings = {"kubeconfig": str(kube.kubeconfig), "store_watch_timeout": 5}
        async with running_operator("kubernetes", **settings) as (op, _):
            assert op.policy_reporter is not None
            for doc in (fine, named):  # created while the operator runs: the watch sees them
                kube.kubectl("apply", "-f", "-", input=json.dumps(doc))
            deadline = time.monotonic() + 15
            while time.monotonic() < deadline:
                events = [e for e in _events(kube, ns) if e.get("reason") == "PolicyFailClosed"]
                if events:
                    return events
                await asyncio.sleep(0.2)
            return []

    events = asyncio.run(scenario())
    (event,) = events
    assert event["type"] == "Warning"
    assert event["involvedObject"]["kind"] == "NetworkPolicy"
    assert event["involvedObject"]["name"] == "named"
    assert event["message"].startswith("egress default-deny (fail closed): ")
    assert "spec.egress[0]: named port 'serve-80'" in event["message"]
    assert "serve-80" in event["message"]
    names = {e["involvedObject"]["name"] for e in _events(kube, ns)}
    assert "fine" not in names, "a policy enforced as written gets no Event"
