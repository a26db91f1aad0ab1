"""ADD/DEL against a contract-level cilia.agent.v1 peer on a tmp unix socket: result
formatting per CNI spec version, what the agent receives, gRPC status → CNI code."""

from __future__ import annotations

import json
import os
import subprocess

import grpc
import pytest
from cni_testlib import AgentServer, assert_cni_error, cni_binary, cni_env, exec_cni, netconf

from cilia.agent.v1 import agent_pb2


@pytest.mark.parametrize("version", ["0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0"])
def test_add_prints_spec_result_in_the_netconf_version(agent: AgentServer, version: str) -> None:
    run = exec_cni(cni_env("ADD"), netconf(agent.socket, version=version))
    assert run.returncode == 0, run
    assert run.stderr == ""
    result = run.json
    host, container = result["interfaces"]
    assert host["name"].startswith("lxc") and len(host["name"]) == 14
    assert "sandbox" not in host
    assert container == {
        "name": "eth0",
        "mac": "02:00:00:00:00:02",
        "sandbox": "/var/run/netns/cilia-t-cni",
        **({"mtu": 1500} if version == "1.1.0" else {}),
    }
    assert ("mtu" in host) is (version == "1.1.0")
    assert result["cniVersion"] == version
    ip = {"address": "10.251.0.2/32", "gateway": "10.251.0.1", "interface": 1}
    if version.startswith("0."):
        ip["version"] = "4"  # 0.3.x/0.4.0 shape; 1.0.0 dropped the field
    assert result["ips"] == [ip]
    assert result["routes"] == [{"dst": "0.0.0.0/0", "gw": "10.251.0.1"}]
    assert set(result) == {"cniVersion", "interfaces", "ips", "routes"}


def test_add_sends_annotations_from_args_and_runtime_config(agent: AgentServer) -> None:
    conf = netconf(
        agent.socket,
        args={"cni": {"annotations": {"ipam.cilium.io/ip-pool": "blue", "a": "args"}}},
        runtimeConfig={"io.kubernetes.cri.pod-annotations": {"a": "runtime", "b": "x"}},
    )
    assert exec_cni(cni_env("ADD"), conf).returncode == 0
    (request,) = agent.servicer.add_requests
    assert dict(request.annotations) == {"ipam.cilium.io/ip-pool": "blue", "a": "args", "b": "x"}
    assert request.prev_result == ""


def test_chained_add_sends_prev_result_and_passes_it_through(agent: AgentServer) -> None:
    prev = {
        "cniVersion": "1.0.0",
        "interfaces": [
            {"name": "veth1", "mac": "02:aa:00:00:00:01"},
            {"name": "eth0", "mac": "02:aa:00:00:00:02", "sandbox": "/var/run/netns/x"},
        ],
        "ips": [{"address": "10.77.0.5/24", "gateway": "10.77.0.1", "interface": 1}],
        "routes": [{"dst": "0.0.0.0/0", "gw": "10.77.0.1"}],
        "dns": {"nameservers": ["10.77.0.10"]},
    }
    agent.servicer.add_response = agent_pb2.AddResponse(endpoint_id=7)
    run = exec_cni(cni_env("ADD"), netconf(agent.socket, prevResult=prev))
    assert run.returncode == 0, run
    (request,) = agent.servicer.add_requests
    assert json.loads(request.prev_result) == prev
    assert run.json == prev


def test_add_sends_attachment_labels_and_pod_identity_to_the_agent(agent: AgentServer) -> None:
    env = cni_env(
        "ADD",
        container_id="pod-1234",
        CNI_IFNAME="net1",
        CNI_ARGS="IgnoreUnknown=1;K8S_POD_NAMESPACE=shop;K8S_POD_NAME=web-0;FOO=",
    )
    labels = [{"key": "app", "value": "web"}, {"key": "tier", "value": ""}]
    run = exec_cni(env, netconf(agent.socket, mtu=9000, args={"cni": {"labels": labels}}))
    assert run.returncode == 0, run
    (request,) = agent.servicer.add_requests
    assert request.container_id == "pod-1234"
    assert request.ifname == "net1"
    assert request.netns == "/var/run/netns/cilia-t-cni"
    assert dict(request.labels) == {"app": "web", "tier": ""}
    assert (request.pod_namespace, request.pod_name) == ("shop", "web-0")
    assert request.mtu == 9000
    assert request.pool == ""


def test_add_twice_for_the_same_ifname_fails_with_code_100(agent: AgentServer) -> None:
    conf = netconf(agent.socket)
    assert exec_cni(cni_env("ADD"), conf).returncode == 0
    err = assert_cni_error(exec_cni(cni_env("ADD"), conf), 100, "already exists")
    assert "ALREADY_EXISTS" in err["details"]


@pytest.mark.parametrize(
    ("status", "code"),
    [
        (grpc.StatusCode.UNAVAILABLE, 11),
        (grpc.StatusCode.INVALID_ARGUMENT, 7),
        (grpc.StatusCode.NOT_FOUND, 8),
        (grpc.StatusCode.ALREADY_EXISTS, 100),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, 999),  # not the pool's message: see below
        (grpc.StatusCode.FAILED_PRECONDITION, 999),
        (grpc.StatusCode.INTERNAL, 999),
        (grpc.StatusCode.UNIMPLEMENTED, 999),
    ],
)
def test_add_maps_agent_status_to_cni_code(
    agent: AgentServer, status: grpc.StatusCode, code: int
) -> None:
    agent.servicer.fail_add = (status, f"agent says {status.name.lower()}")
    run = exec_cni(cni_env("ADD"), netconf(agent.socket))
    err = assert_cni_error(run, code, agent.socket)
    assert status.name in err["details"]
    assert f"agent says {status.name.lower()}" in err["msg"] + err["details"]
    if code == 11:
        # The agent answered: the message carries its reason, not "start the agent".
        assert "cannot complete ADD now: agent says unavailable" in err["msg"]
    assert run.stderr == ""
    assert agent.servicer.del_requests == [], "a refused ADD is the agent's to roll back"


def test_resource_exhausted_is_101_only_for_the_agents_pool_exhaustion(
    agent: AgentServer,
) -> None:
    message = "no free IPv4 address in pool 'default' (10.251.0.0/26)"
    agent.servicer.fail_add = (grpc.StatusCode.RESOURCE_EXHAUSTED, message)
    err = assert_cni_error(exec_cni(cni_env("ADD"), netconf(agent.socket)), 101, message)
    assert "RESOURCE_EXHAUSTED" in err["details"]


def test_pool_exhausted_reason_is_101_whatever_the_message(agent: AgentServer) -> None:
    """The agent names pool exhaustion by a google.rpc.ErrorInfo reason (POOL_EXHAUSTED,
    domain agent.cilia.io, in grpc-status-details-bin): the plugin reads the reason, not the
    text, which may say anything."""
    message = "the pool 'blue' ran dry"
    agent.servicer.fail_add = (grpc.StatusCode.RESOURCE_EXHAUSTED, message)
    agent.servicer.fail_add_reason = "POOL_EXHAUSTED"
    err = assert_cni_error(exec_cni(cni_env("ADD"), netconf(agent.socket)), 101, message)
    assert err["details"] == "gRPC RESOURCE_EXHAUSTED (POOL_EXHAUSTED)"


def test_another_reason_with_the_old_pool_message_is_not_101(agent: AgentServer) -> None:
    """An agent that sends reasons is trusted on them: the old message match is only the
    fallback for an agent that sends none."""
    message = "no free IPv4 address in pool 'default' (policy map full)"
    agent.servicer.fail_add = (grpc.StatusCode.RESOURCE_EXHAUSTED, message)
    agent.servicer.fail_add_reason = "POLICY_MAP_FULL"
    err = assert_cni_error(exec_cni(cni_env("ADD"), netconf(agent.socket)), 999, message)
    assert "RESOURCE_EXHAUSTED" in err["details"]


def test_request_over_the_agents_grpc_size_limit_is_code_7_not_pool_exhausted(
    agent: AgentServer,
) -> None:
    """50,000 labels of ~100 bytes: the AddRequest (~5.5 MB) exceeds grpcio's 4 MiB receive
    limit; the server answers RESOURCE_EXHAUSTED "Received message larger than max" (before:
    101 "pool exhausted")."""
    labels = [{"key": f"k{i:05d}", "value": "v" * 100} for i in range(50_000)]
    conf = netconf(agent.socket, args={"cni": {"labels": labels}})
    err = assert_cni_error(
        exec_cni(cni_env("ADD"), conf), 7, "larger than max", "message size limit"
    )
    assert "RESOURCE_EXHAUSTED" in err["details"]
    assert agent.servicer.add_requests == []


def test_add_that_outlives_its_timeout_fails_with_code_11_and_is_rolled_back(
    agent: AgentServer,
) -> None:
    agent.servicer.add_delay = 3.0
    conf = netconf(agent.socket, **{"agent-timeout-seconds": 0.5})
    run = exec_cni(cni_env("ADD"), conf)
    err = assert_cni_error(run, 11, "did not answer ADD within 0.5s", "agent-timeout-seconds")
    assert "rolled back" in err["details"]
    (request,) = agent.servicer.del_requests
    assert (request.container_id, request.ifname) == ("c0ffee01", "eth0")


def test_add_with_a_result_breaking_the_contract_fails_with_999_and_is_rolled_back(
    agent: AgentServer,
) -> None:
    agent.servicer.add_response = agent_pb2.AddResponse(
        interfaces=[agent_pb2.Interface(name="lxc0")],
        ips=[agent_pb2.IPConfig(address="10.251.0.9/32", interface=4)],
    )
    err = assert_cni_error(exec_cni(cni_env("ADD"), netconf(agent.socket)), 999, "interface")
    assert "rolled back" in err["details"]
    assert len(agent.servicer.del_requests) == 1


def test_del_removes_the_attachment_and_prints_nothing(agent: AgentServer) -> None:
    conf = netconf(agent.socket)
    assert exec_cni(cni_env("ADD"), conf).returncode == 0
    run = exec_cni(cni_env("DEL"), conf)
    assert (run.returncode, run.stdout, run.stderr) == (0, "", "")
    (request,) = agent.servicer.del_requests
    assert request.netns == "/var/run/netns/cilia-t-cni"
    assert agent.servicer.attachments == {}


def test_del_succeeds_when_there_is_nothing_to_delete_and_netns_is_empty(
    agent: AgentServer,
) -> None:
    for _ in range(2):
        run = exec_cni(cni_env("DEL", CNI_NETNS=""), netconf(agent.socket))
        assert (run.returncode, run.stdout) == (0, ""), run
    assert [r.netns for r in agent.servicer.del_requests] == ["", ""]


def test_del_ignores_malformed_cni_args_and_prev_result(agent: AgentServer) -> None:
    conf = netconf(agent.socket, prevResult={"cniVersion": "1.0.0", "interfaces": []})
    run = exec_cni(cni_env("DEL", CNI_ARGS="not-a-pair"), conf)
    assert run.returncode == 0, run


@pytest.mark.parametrize(
    ("status", "code"),
    [(grpc.StatusCode.UNAVAILABLE, 11), (grpc.StatusCode.INTERNAL, 999)],
)
def test_del_maps_agent_status_to_cni_code(
    agent: AgentServer, status: grpc.StatusCode, code: int
) -> None:
    agent.servicer.fail_del = (status, "agent failed")
    assert_cni_error(exec_cni(cni_env("DEL"), netconf(agent.socket)), code, agent.socket)


def test_log_file_gets_json_lines_with_the_container_id(agent: AgentServer, short_tmp: str) -> None:
    log = os.path.join(short_tmp, "cni.log")
    conf = netconf(agent.socket, **{"log-file": log})
    assert exec_cni(cni_env("ADD", container_id="logged-1"), conf).returncode == 0
    agent.servicer.fail_del = (grpc.StatusCode.UNAVAILABLE, "not ready")
    assert exec_cni(cni_env("DEL", container_id="logged-1"), conf).returncode == 1
    with open(log) as f:
        lines = [json.loads(line) for line in f]
    assert [(line["command"], line["level"]) for line in lines] == [
        ("ADD", "info"),
        ("ADD", "info"),
        ("DEL", "info"),
        ("DEL", "error"),
    ]
    assert {line["containerID"] for line in lines} == {"logged-1"}
    assert lines[1]["result"].startswith('{"cniVersion"')
    assert lines[3]["code"] == 11
    assert os.stat(log).st_mode & 0o777 == 0o600


def test_unwritable_log_file_does_not_fail_the_operation(agent: AgentServer) -> None:
    conf = netconf(agent.socket, **{"log-file": "/proc/cilia-cni-no-such-dir/cni.log"})
    run = exec_cni(cni_env("ADD"), conf)
    assert run.returncode == 0, run
    assert "cannot write log-file" in run.stderr


def _exec_with_fds(
    env: dict[str, str], stdin: bytes | None, stdout: str | None
) -> subprocess.CompletedProcess[bytes]:
    """Exec cilia-cni with stdin ``None`` = closed fd 0, stdout a path or ``None`` = closed."""
    full_env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), **env}
    redirs = ("<&- " if stdin is None else "") + (f">{stdout}" if stdout else ">&-")
    return subprocess.run(
        ["/bin/sh", "-c", f'exec "$0" {redirs}', cni_binary()],
        input=stdin,
        env=full_env,
        stderr=subprocess.PIPE,
        timeout=30,
        check=False,
    )


@pytest.mark.parametrize("target", ["/dev/full", None], ids=["dev-full", "closed"])
def test_successful_add_whose_result_cannot_be_written_exits_non_zero(
    agent: AgentServer, target: str | None
) -> None:
    stdin = json.dumps(netconf(agent.socket)).encode()
    proc = _exec_with_fds(cni_env("ADD", container_id="fullout1"), stdin, target)
    assert proc.returncode == 1, proc
    assert b"Traceback" not in proc.stderr
    assert [r.container_id for r in agent.servicer.add_requests] == ["fullout1"]  # it did ADD


def test_closed_stdin_is_code_5(agent: AgentServer, short_tmp: str) -> None:
    out = os.path.join(short_tmp, "out.json")
    proc = _exec_with_fds(cni_env("ADD"), None, out)
    assert proc.returncode == 1, proc
    with open(out) as f:
        reply = json.load(f)
    assert reply["code"] == 5, reply
    assert "stdin" in reply["msg"]
