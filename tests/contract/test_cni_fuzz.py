"""Fuzzed environment and stdin against a real cilia-agent: every invocation answers with
a success of the right shape or a spec error JSON with a documented code, never a
traceback, and never leaves partial state (the agent's endpoints and address usage are
unchanged after every failed invocation; a successful ADD is DEL'd and checked too).

10,000 cases drive the plugin's entry function in this process (``plugin.run``, stdout
captured as its return value, the real agent behind the socket); 200 more exec the real
binary (the ``main`` wrapper, ``os._exit``, stderr silence)."""

from __future__ import annotations

import json
import os
from typing import Any

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from realagent import DOCUMENTED_CODES, RealAgent, exec_cni, run_in_process

from cilia.agent.v1 import agent_pb2

SUPPORTED = ("0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0")
COMMANDS = ["ADD", "DEL", "CHECK", "VERSION", "STATUS", "GC"]
IN_PROCESS_CASES = int(os.environ.get("CILIA_CNI_FUZZ_CASES", "10000"))
#: Invocations per hypothesis example in process: drawing is most of a case's cost and
#: hypothesis' per-example overhead halves when examples carry a batch.
BATCH = 20
BINARY_CASES = 200

# Environment values cannot hold NUL or lone surrogates.
TEXT = st.text(
    alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), max_size=12
)
# JSON strings may hold what no environment can: a lone surrogate ("\ud800" in the
# JSON text, json.dumps' escape of one), which no UTF-8 encode accepts later.
LONE_SURROGATE_TEXT = st.builds(
    lambda a, s, b: a + s + b, TEXT, st.characters(categories=["Cs"]), TEXT
)
JSON_TEXT = TEXT | LONE_SURROGATE_TEXT
# Absolute paths holding a lone surrogate (always refused, so nothing is ever created).
PATHS = LONE_SURROGATE_TEXT.map(lambda t: "/tmp/cilia-cnit-fuzz-" + t)
# Small on purpose: generating the data is most of the cost of a case.
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | JSON_TEXT,
    lambda inner: st.lists(inner, max_size=2) | st.dictionaries(JSON_TEXT, inner, max_size=2),
    max_leaves=4,
)
# Placeholders replaced at run time: the real agent's socket, an absent one, a tmp DEL
# queue, and a real netns (1 in 200: a successful ADD + DEL costs ~100 cases; most ADDs
# fail at the agent with code 8).
AGENT, ABSENT, QUEUE, NETNS = "@agent", "@absent", "@queue", "@netns"
ABSENT_NETNS = "/var/run/netns/cilia-cnit-fuzz-absent"
NETNS_VALUES = st.sampled_from([NETNS] + [ABSENT_NETNS] * 199)

ENV_VALUES: dict[str, st.SearchStrategy[str]] = {
    "CNI_COMMAND": st.sampled_from([*COMMANDS, "", "add"]) | TEXT,
    "CNI_CONTAINERID": st.sampled_from(["c0ffee", "fuzz-1"]) | TEXT,
    "CNI_NETNS": NETNS_VALUES | st.just("") | TEXT,
    "CNI_IFNAME": st.sampled_from(["eth0", "net1"]) | TEXT,
    "CNI_ARGS": st.sampled_from(["", "K8S_POD_NAMESPACE=a;K8S_POD_NAME=b"]) | TEXT,
    "CNI_PATH": st.sampled_from(["/opt/cni/bin", ""]) | TEXT,
}
VALID_ENV = st.fixed_dictionaries(
    {
        "CNI_COMMAND": st.sampled_from(COMMANDS),
        "CNI_CONTAINERID": st.sampled_from(["c0ffee", "fuzz-1", "fuzz-2"]),
        "CNI_NETNS": NETNS_VALUES,
        "CNI_IFNAME": st.sampled_from(["eth0", "net1"]),
        "CNI_ARGS": st.sampled_from(["", "K8S_POD_NAMESPACE=a;K8S_POD_NAME=b"]),
        "CNI_PATH": st.just("/opt/cni/bin"),
    }
)
LABELS = st.lists(
    st.fixed_dictionaries({"key": st.sampled_from(["app", "tier"]) | JSON_TEXT, "value": JSON_TEXT})
    | JSON_VALUES,
    max_size=3,
)
PREV_RESULT = st.fixed_dictionaries(
    {},
    optional={
        "cniVersion": st.sampled_from(SUPPORTED) | JSON_VALUES,
        "interfaces": st.lists(
            st.fixed_dictionaries(
                {"name": st.sampled_from(["eth0", "lxc1"]) | JSON_VALUES},
                optional={"sandbox": st.just("/var/run/netns/x") | JSON_VALUES},
            )
            | JSON_VALUES,
            max_size=2,
        ),
        "ips": st.lists(
            st.fixed_dictionaries(
                {"address": st.sampled_from(["10.238.0.9/32", "bad"]) | JSON_VALUES},
                optional={"interface": st.integers(-1, 2) | JSON_VALUES},
            ),
            max_size=2,
        ),
        "routes": st.lists(st.fixed_dictionaries({"dst": st.just("0.0.0.0/0") | JSON_VALUES})),
    },
)
NETCONF_VALUES: dict[str, st.SearchStrategy[Any]] = {
    "cniVersion": st.sampled_from([*SUPPORTED, "0.2.0"]) | JSON_VALUES,
    "name": st.just("cilia") | JSON_VALUES,
    "type": st.just("cilia-cni") | JSON_VALUES,
    "agent-socket": st.sampled_from([AGENT, ABSENT]) | PATHS | JSON_VALUES,
    "agent-timeout-seconds": st.sampled_from([5, 2.5]) | JSON_VALUES,
    "agent-del-timeout-seconds": st.sampled_from([5]) | JSON_VALUES,
    "log-file": st.sampled_from(["", "relative.log", 3]) | PATHS,
    "mtu": st.sampled_from([0, 1500]) | JSON_VALUES,
    "del-queue-dir": st.just(QUEUE) | PATHS | JSON_VALUES,
    "del-queue-max": st.sampled_from([1, 256]) | JSON_VALUES,
    "agent-max-response-bytes": st.sampled_from([4096, 4194304]) | JSON_VALUES,
    "args": st.fixed_dictionaries(
        {"cni": st.fixed_dictionaries({"labels": LABELS, "annotations": JSON_VALUES})}
    )
    | JSON_VALUES,
    "runtimeConfig": st.fixed_dictionaries(
        {"io.kubernetes.cri.pod-annotations": st.dictionaries(JSON_TEXT, JSON_TEXT, max_size=2)}
    )
    | JSON_VALUES,
    "prevResult": PREV_RESULT | JSON_VALUES,
    "cni.dev/valid-attachments": st.lists(
        st.fixed_dictionaries({"containerID": JSON_TEXT, "ifname": JSON_TEXT}) | JSON_VALUES,
        max_size=2,
    )
    | JSON_VALUES,
    "cni.dev/attachments": st.lists(
        st.fixed_dictionaries({"containerID": JSON_TEXT, "ifname": JSON_TEXT}) | JSON_VALUES,
        max_size=2,
    )
    | JSON_VALUES,
}
VALID_NETCONF = st.fixed_dictionaries(
    {
        "cniVersion": st.sampled_from(SUPPORTED),
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
        "prevResult": PREV_RESULT,
        "cni.dev/attachments": st.just([{"containerID": "c0ffee", "ifname": "eth0"}]),
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


class Fuzz:
    """Placeholders resolved against the real agent, plus the invariant check."""

    def __init__(self, agent: RealAgent, netns: str) -> None:
        self.agent = agent
        self.netns = netns
        self.absent = os.path.join(agent.dir, "absent.sock")
        self.queue = os.path.join(agent.dir, "fuzz-del-queue")
        self.baseline = (agent.endpoints(), agent.usage())
        assert self.baseline[0] == [], "the fuzz starts from an agent without endpoints"

    def env(self, env: dict[str, str]) -> dict[str, str]:
        return {k: (self.netns if v == NETNS else v) for k, v in env.items()}

    def stdin(self, kind_value: tuple[str, Any]) -> bytes:
        kind, value = kind_value
        if kind == "bytes":
            return bytes(value)
        if kind == "netconf":
            # Never the default queue dir of the host: a real agent would replay our DELs.
            value = dict(value)
            value.setdefault("del-queue-dir", QUEUE)
            names = {AGENT: self.agent.socket, ABSENT: self.absent, QUEUE: self.queue}
            for key in ("agent-socket", "del-queue-dir"):
                if isinstance(value.get(key), str):
                    value[key] = names.get(value[key], value[key])
        return json.dumps(value).encode()

    def check(self, env: dict[str, str], status: int, out: str, rerun: Any, stdin: bytes) -> None:
        """Assert the outcome's shape; re-read the agent's state when it could have
        changed (the invocation named its socket)."""
        touches_agent = self.touches_agent(stdin)
        command = env.get("CNI_COMMAND")
        if status == 0:
            event(f"success {command}")
            assert command in COMMANDS, out
            if command == "VERSION":
                reply = json.loads(out)
                assert reply["supportedVersions"] == list(SUPPORTED)
                assert reply["cniVersion"] in SUPPORTED
            elif command == "ADD":
                result = json.loads(out)
                assert result["cniVersion"] in SUPPORTED
                assert any(i.get("name") == env["CNI_IFNAME"] for i in result["interfaces"])
                # Undo it through the plugin itself; the state must come back.
                status, out = rerun(dict(env, CNI_COMMAND="DEL"), stdin)
                assert (status, out) == (0, ""), out
            else:
                assert out == "", out
        else:
            assert status == 1, out
            err = json.loads(out)
            assert set(err) == {"cniVersion", "code", "msg", "details"}, err
            assert err["cniVersion"] in SUPPORTED
            assert err["code"] in DOCUMENTED_CODES, err
            assert not err["msg"].startswith("cilia-cni internal error"), err  # a plugin bug
            assert isinstance(err["msg"], str) and err["msg"]
            assert isinstance(err["details"], str)
            event(f"error code {err['code']}")
        if touches_agent:
            # One Status call: endpoint count and per-pool usage (the baseline is empty).
            status = self.agent.debug.Status(agent_pb2.StatusRequest(), timeout=10)
            usage = sorted((p.pool, p.used, p.capacity) for p in status.pools)
            assert (status.endpoint_count, usage) == (0, self.baseline[1]), status

    def touches_agent(self, stdin: bytes) -> bool:
        """Whether this stdin can reach the real agent (its socket is named in it)."""
        return self.agent.socket.encode() in stdin


@pytest.fixture(scope="module")
def fuzz(real_agent_process: RealAgent) -> Any:
    from realagent import Netns

    if real_agent_process.proc is None:
        real_agent_process.start()
    ns = Netns()
    try:
        yield Fuzz(real_agent_process, ns.add())
    finally:
        ns.cleanup()


def _in_process(env: dict[str, str], stdin: bytes) -> tuple[int, str]:
    return run_in_process(env, stdin)


def _binary(env: dict[str, str], stdin: bytes) -> tuple[int, str]:
    run = exec_cni(env, stdin)
    assert run.stderr == "", run
    return run.returncode, run.stdout


#: Per-test limit (the suite's default is 300 s): 10,000 cases on a loaded 2-core host.
FUZZ_TIMEOUT_SECONDS = 900


@pytest.mark.timeout(FUZZ_TIMEOUT_SECONDS)
@settings(
    max_examples=max(1, IN_PROCESS_CASES // BATCH),
    deadline=None,
    database=None,
    suppress_health_check=list(HealthCheck),
)
@given(cases=st.lists(st.tuples(ENV, STDIN), min_size=BATCH, max_size=BATCH))
def test_fuzzed_invocation_in_process_gives_success_or_spec_error_and_no_partial_state(
    real_agent: RealAgent, fuzz: Fuzz, cases: list[tuple[dict[str, str], tuple[str, Any]]]
) -> None:
    for env, stdin in cases:
        env, data = fuzz.env(env), fuzz.stdin(stdin)
        status, out = _in_process(env, data)
        fuzz.check(env, status, out, _in_process, data)


@pytest.mark.timeout(FUZZ_TIMEOUT_SECONDS)
@settings(
    max_examples=BINARY_CASES,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(env=ENV, stdin=STDIN)
def test_fuzzed_invocation_of_the_binary_gives_success_or_spec_error_never_a_traceback(
    real_agent: RealAgent, fuzz: Fuzz, env: dict[str, str], stdin: tuple[str, Any]
) -> None:
    env, data = fuzz.env(env), fuzz.stdin(stdin)
    status, out = _binary(env, data)
    fuzz.check(env, status, out, _binary, data)
