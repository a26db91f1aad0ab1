"""Bad invocations of the real binary: the right CNI error code, nothing changed."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from support import current_stack, endpoint_ips, pool_used

from cilia_testkit import cni, host

pytestmark = [pytest.mark.e2e, pytest.mark.privileged]


def _snapshot(pod: cni.Pod) -> tuple[bool, set[str], int]:
    """(the pod's host veth exists, the agent's endpoint IPs, addresses in use).

    The host veth is looked up by the name the agent would give it: other runs on this host
    (private agents, other tests) create and delete ``lxc*`` links of their own meanwhile.
    """
    return pod.host_veth in host.host_lxc_links(), endpoint_ips(), pool_used()


def _error_code(outcome: cni.CniOutcome) -> int:
    assert outcome.returncode != 0, f"expected a CNI error, got success: {outcome.stdout}"
    error = outcome.json
    assert set(error) >= {"cniVersion", "code", "msg"}, error
    assert error["msg"], error
    return int(error["code"])


def _pod_has_no_interface(pod: cni.Pod) -> bool:
    links = host.sh("ip", "-n", pod.name, "-o", "link").stdout
    return "eth0" not in links


def _add_env(pod: cni.Pod) -> dict[str, Any]:
    return {
        "container_id": pod.container_id,
        "netns": pod.netns,
        "ifname": pod.ifname,
        "args": cni.cni_args(pod.namespace, pod.name, pod.container_id),
    }


def test_malformed_json_is_rejected_with_code_6_and_changes_nothing(
    make_pod: Callable[..., cni.Pod],
) -> None:
    pod = make_pod()
    before = _snapshot(pod)

    outcome = cni.invoke("ADD", stdin='{"cniVersion": "1.0.0", "name": ', **_add_env(pod))

    assert _error_code(outcome) == 6
    assert _snapshot(pod) == before
    assert _pod_has_no_interface(pod)


def test_missing_container_id_is_rejected_with_code_4_and_changes_nothing(
    conflist: dict[str, Any], make_pod: Callable[..., cni.Pod]
) -> None:
    pod = make_pod()
    before = _snapshot(pod)
    env = _add_env(pod) | {"container_id": None}

    outcome = cni.invoke("ADD", stdin=json.dumps(cni.plugin_netconf(conflist)), **env)

    assert _error_code(outcome) == 4
    assert "CNI_CONTAINERID" in outcome.json["msg"]
    assert _snapshot(pod) == before
    assert _pod_has_no_interface(pod)


@contextlib.contextmanager
def _agent_down() -> Iterator[None]:
    """The agent is stopped for the test and started again (waiting for readiness) after."""
    current_stack().stop_component("agent")
    try:
        yield
    finally:
        current_stack().start_component("agent")


def test_add_with_agent_down_returns_code_11_and_leaves_nothing_behind(
    conflist: dict[str, Any], make_pod: Callable[..., cni.Pod]
) -> None:
    pod = make_pod()
    before = _snapshot(pod)
    with _agent_down():
        outcome = pod.add(conflist)
        assert _error_code(outcome) == 11, outcome.stdout
        assert pod.host_veth not in host.host_lxc_links()
        assert _pod_has_no_interface(pod)
    assert _snapshot(pod) == before
    assert pod.container_id not in current_stack().agent.endpoint_list("-o", "json").stdout
