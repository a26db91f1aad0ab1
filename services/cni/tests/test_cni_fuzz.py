"""Fuzzed environment and stdin: the real binary always answers with a success of the
right shape or a spec error JSON with a documented code, and never a traceback."""

from __future__ import annotations

import json
import os
from typing import Any

from cni_testlib import DOCUMENTED_CODES, AgentServer, exec_cni
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

SUPPORTED = ("0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0")

# Environment values cannot hold NUL or lone surrogates.
TEXT = st.text(
    alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), max_size=24
)
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | TEXT,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(TEXT, inner, max_size=3),
    max_leaves=8,
)
# Placeholders replaced at run time by the contract agent's socket and an absent one.
AGENT, ABSENT, QUEUE = "@agent", "@absent", "@queue"

ENV_VALUES: dict[str, st.SearchStrategy[str]] = {
    "CNI_COMMAND": st.sampled_from(["ADD", "DEL", "VERSION", "CHECK", ""]) | TEXT,
    "CNI_CONTAINERID": st.sampled_from(["c0ffee", "fuzz-1"]) | TEXT,
    "CNI_NETNS": st.sampled_from(["/var/run/netns/cilia-t-fuzz", ""]) | TEXT,
    "CNI_IFNAME": st.sampled_from(["eth0", "net1"]) | TEXT,
    "CNI_ARGS": st.sampled_from(["", "K8S_POD_NAMESPACE=a;K8S_POD_NAME=b"]) | TEXT,
    "CNI_PATH": st.sampled_from(["/opt/cni/bin", ""]) | TEXT,
}
VALID_ENV = st.fixed_dictionaries(
    {
        "CNI_COMMAND": st.sampled_from(["ADD", "DEL", "VERSION"]),
        "CNI_CONTAINERID": st.sampled_from(["c0ffee", "fuzz-1", "fuzz-2"]),
        "CNI_NETNS": st.just("/var/run/netns/cilia-t-fuzz"),
        "CNI_IFNAME": st.sampled_from(["eth0", "net1"]),
        "CNI_ARGS": st.sampled_from(["", "K8S_POD_NAMESPACE=a;K8S_POD_NAME=b"]),
    }
)
LABELS = st.lists(
    st.fixed_dictionaries({"key": st.sampled_from(["app", "tier"]) | TEXT, "value": TEXT})
    | JSON_VALUES,
    max_size=3,
)
NETCONF_VALUES: dict[str, st.SearchStrategy[Any]] = {
    "cniVersion": st.sampled_from(["1.0.0", "1.1.0", "0.4.0"]) | JSON_VALUES,
    "name": st.just("cilia") | JSON_VALUES,
    "type": st.just("cilia-cni") | JSON_VALUES,
    "agent-socket": st.sampled_from([AGENT, ABSENT]) | JSON_VALUES,
    "agent-timeout-seconds": st.sampled_from([5, 2.5]) | JSON_VALUES,
    "agent-del-timeout-seconds": st.sampled_from([5]) | JSON_VALUES,
    "log-file": st.sampled_from(["", "relative.log", 3]),
    "mtu": st.sampled_from([0, 1500]) | JSON_VALUES,
    "args": st.fixed_dictionaries({"cni": st.fixed_dictionaries({"labels": LABELS})}) | JSON_VALUES,
    "prevResult": JSON_VALUES,
}
VALID_NETCONF = st.fixed_dictionaries(
    {
        "cniVersion": st.sampled_from(["1.0.0", "1.1.0"]),
        "name": st.just("cilia"),
        "type": st.just("cilia-cni"),
        "agent-socket": st.sampled_from([AGENT, AGENT, ABSENT]),
        "del-queue-dir": st.just(QUEUE),
    },
    optional={
        "args": st.fixed_dictionaries(
            {"cni": st.fixed_dictionaries({"labels": st.just([{"key": "app", "value": "x"}])})}
        ),
        "mtu": st.just(1400),
    },
)


def _mutated(
    valid: st.SearchStrategy[dict[str, Any]], values: dict[str, st.SearchStrategy[Any]]
) -> st.SearchStrategy[dict[str, Any]]:
    """A valid mapping with one key replaced by a fuzzed value or removed."""

    @st.composite
    def build(draw: st.DrawFn) -> dict[str, Any]:
        base = dict(draw(valid))
        key = draw(st.sampled_from(sorted(values)))
        if draw(st.booleans()):
            base.pop(key, None)
        else:
            base[key] = draw(values[key])
        return base

    return build()


ENV = VALID_ENV | _mutated(VALID_ENV, ENV_VALUES) | st.fixed_dictionaries({}, optional=ENV_VALUES)
NETCONF = (
    VALID_NETCONF
    | _mutated(VALID_NETCONF, NETCONF_VALUES)
    | st.fixed_dictionaries({}, optional=NETCONF_VALUES)
)
STDIN = (
    NETCONF.map(lambda conf: ("netconf", conf))
    | JSON_VALUES.map(lambda value: ("json", value))
    | st.binary(max_size=40).map(lambda raw: ("bytes", raw))
)


def _stdin(kind_value: tuple[str, Any], agent_socket: str, absent: str) -> bytes:
    kind, value = kind_value
    if kind == "bytes":
        return bytes(value)
    if kind == "netconf":
        # Never the default queue dir of the host: a queued DEL would be replayed by a
        # real agent. A netconf without the key is sent with the tmp dir too.
        value = dict(value)
        value.setdefault("del-queue-dir", QUEUE)
        for key in ("agent-socket", "del-queue-dir"):
            if isinstance(value.get(key), str):
                value[key] = {
                    AGENT: agent_socket,
                    ABSENT: absent,
                    QUEUE: os.path.join(os.path.dirname(absent), "del-queue"),
                }.get(value[key], value[key])
    return json.dumps(value).encode()


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(env=ENV, stdin=STDIN)
def test_fuzzed_invocation_gives_valid_success_or_spec_error_never_a_traceback(
    agent_server: AgentServer, env: dict[str, str], stdin: tuple[str, Any]
) -> None:
    servicer = agent_server.servicer
    servicer.fail_add = servicer.fail_del = servicer.add_response = None
    servicer.add_delay = 0.0
    absent = os.path.join(agent_server.dir, "absent.sock")
    run = exec_cni(env, _stdin(stdin, agent_server.socket, absent))
    assert run.stderr == "", run
    command = env.get("CNI_COMMAND")
    if run.returncode == 0:
        event(f"success {command}")
        assert command in ("ADD", "DEL", "VERSION", "CHECK", "GC", "STATUS"), run
        if command != "ADD" and command != "VERSION":
            assert run.stdout == ""
            return
        out = json.loads(run.stdout)
        assert out["cniVersion"] in SUPPORTED
        if command == "VERSION":
            assert out["supportedVersions"] == list(SUPPORTED)
        else:
            assert [i["name"] for i in out["interfaces"]][1] == env["CNI_IFNAME"]
            assert out["ips"] and out["routes"]
        return
    assert run.returncode == 1, run
    err = json.loads(run.stdout)
    assert set(err) == {"cniVersion", "code", "msg", "details"}, err
    assert err["cniVersion"] in SUPPORTED
    assert err["code"] in DOCUMENTED_CODES, err
    event(f"error code {err['code']}")
    assert isinstance(err["msg"], str) and err["msg"]
    assert isinstance(err["details"], str)
