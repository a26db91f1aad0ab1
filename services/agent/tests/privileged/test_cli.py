"""The real ``cilia-agent`` console script: serve (with the eBPF datapath), status,
endpoint list, bpf maps, metrics, SIGTERM."""

from __future__ import annotations

import json
import pathlib
import re
import signal
import subprocess
import sys
import time
import urllib.request
from typing import Any

import grpc

from cilia.agent.v1 import agent_pb2, agent_pb2_grpc
from cilia_testkit.host import wait_for
from cilia_testkit.stack import read_listeners

from .conftest import Env
from .fake_operator import FakeOperator

BIN = pathlib.Path(sys.executable).parent / "cilia-agent"


def test_serve_status_endpoint_list_metrics_and_clean_sigterm(env: Env) -> None:
    sock = env.tmp / "cli.sock"
    log = (env.tmp / "agent.log").open("w+")  # a pipe would fill up at debug level
    proc = subprocess.Popen(
        [
            str(BIN),
            "serve",
            "--node-name",
            "cli-node",
            "--operator",
            "",
            "--state-dir",
            str(env.state_dir),
            "--socket",
            str(sock),
            "--cni-conf-dir",
            str(env.tmp / "net.d"),
            "--cni-del-queue-dir",
            str(env.tmp / "del-queue"),
            "--host-device-name",
            env.host_device,
            "--prometheus-serve-addr",
            "127.0.0.1:0",  # bound by the agent, read back from its "listening" line
            "--log-level",
            "debug",
            "--bpf-root",
            str(env.pin_dir),
            "--hubble-listen-address",
            "",
            "--hubble-metrics",
            "flow",
            "--hubble-metrics-server",
            "127.0.0.1:0",
            "--enable-ipv4-masquerade=false",  # the host's nat table is not the test's
        ],
        stderr=log,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60  # compiles bpf_lxc.c first
        while not sock.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        st = subprocess.run(
            [str(BIN), "status", "--socket", str(sock)], capture_output=True, text=True
        )
        assert st.returncode == 1, st.stderr  # running, not ready: no CIDR
        assert "cli-node" in st.stdout and "not ready" in st.stdout
        assert f"Datapath: eBPF loaded, pin dir {env.pin_dir}" in st.stdout
        assert "Hubble: 0/4095 flows" in st.stdout
        assert "Routing: native, 0 other nodes\n" in st.stdout + "\n"  # no operator: alone
        js = subprocess.run(
            [str(BIN), "status", "--socket", str(sock), "-o", "json"],
            capture_output=True,
            text=True,
        )
        assert js.returncode == 1, js.stderr
        status = json.loads(js.stdout)
        assert status["nodeName"] == "cli-node"
        assert status["ready"] is False
        # the datapath and Hubble counts as JSON numbers, zero ones included
        assert status["datapath"]["pinDir"] == str(env.pin_dir)
        assert status["datapath"]["policySynced"] is True  # no operator: nothing to wait for
        assert status["datapath"]["policies"] == 0
        assert isinstance(status["datapath"]["identities"], int)
        assert status["datapath"]["ipcacheEntries"] >= 1  # the node's own addresses
        assert status["hubble"] == {"numFlows": 0, "maxFlows": 4095, "seenFlows": 0}
        hubble_sock = env.tmp / "hubble.sock"
        assert hubble_sock.stat().st_mode & 0o777 == 0o600
        assert (env.pin_dir / "cilia_policy").exists()
        ipcache = subprocess.run(
            [str(BIN), "bpf", "ipcache", "list", "--bpf-pin-dir", str(env.pin_dir), "-o", "json"],
            capture_output=True,
            text=True,
        )
        assert ipcache.returncode == 0, ipcache.stderr
        assert all(e["identity"] == 1 for e in json.loads(ipcache.stdout)), "node addresses = host"
        missing = subprocess.run(
            [str(BIN), "bpf", "policy", "list", "--bpf-pin-dir", str(env.tmp / "nope")],
            capture_output=True,
            text=True,
        )
        assert missing.returncode == 1 and "cannot open pinned map" in missing.stderr
        ls = subprocess.run(
            [str(BIN), "endpoint", "list", "--socket", str(sock), "-o", "json"],
            capture_output=True,
            text=True,
        )
        assert ls.returncode == 0 and json.loads(ls.stdout) == []
        assert wait_for(lambda: "metrics" in read_listeners(env.tmp / "agent.log"), 30)
        metrics = read_listeners(env.tmp / "agent.log")["metrics"]
        body = urllib.request.urlopen(f"http://{metrics}/metrics", timeout=5).read()
        text = body.decode()
        for name in (
            "cilium_endpoint ",
            "cilium_ip_addresses{",
            "cilium_ipam_capacity{",
            "cilium_policy ",
            "# TYPE cilium_drop_count_total counter",
            "# TYPE cilium_forward_count_total counter",
        ):
            assert name in text
        # Hubble's flow metrics are on their own endpoint (--hubble-metrics-server), as upstream
        assert wait_for(lambda: "hubble-metrics" in read_listeners(env.tmp / "agent.log"), 30)
        hubble_metrics = read_listeners(env.tmp / "agent.log")["hubble-metrics"]
        hubble_text = urllib.request.urlopen(f"http://{hubble_metrics}/metrics", timeout=5).read()
        assert "# TYPE hubble_flows_processed_total counter" in hubble_text.decode()
        assert "hubble_flows_processed_total" not in text
        assert sock.stat().st_mode & 0o777 == 0o600
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(15) == 0
        assert not sock.exists() and not hubble_sock.exists()
        log.seek(0)
        lines = [json.loads(line) for line in log.read().splitlines() if line.startswith("{")]
        assert any(line["msg"] == "stopped" for line in lines)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()


def _serve(env: Env, op_address: str, log: Any) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [
            str(BIN),
            "serve",
            "--node-name",
            f"kill-{env.tag}",
            "--operator",
            op_address,
            "--state-dir",
            str(env.state_dir),
            "--socket",
            str(env.tmp / "k.sock"),
            "--cni-conf-dir",
            str(env.tmp / "net.d"),
            "--cni-del-queue-dir",
            str(env.tmp / "del-queue"),
            "--host-device-name",
            env.host_device,
            "--prometheus-serve-addr",
            "",
            "--bpf-pin-dir",
            str(env.pin_dir),
            "--hubble-listen-address",
            "",
            "--operator-reconnect-min-backoff",
            "0.1",
            "--operator-reconnect-max-backoff",
            "0.5",
            "--enable-ipv4-masquerade=false",  # the host's nat table is not the test's
        ],
        stderr=log,
        text=True,
    )


def _ping(netns: str, ip: str, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        ["ip", "netns", "exec", netns, "ping", "-q", *args, ip], stdout=subprocess.PIPE, text=True
    )


def test_kill_9_and_restart_of_the_agent_process_loses_no_packet(env: Env) -> None:
    op = FakeOperator(env.cidr)
    log = (env.tmp / "agent.log").open("w+")
    procs: list[subprocess.Popen[str]] = []
    try:
        procs.append(_serve(env, op.address, log))
        sock = env.tmp / "k.sock"
        channel = grpc.insecure_channel(f"unix:{sock}")
        attach = agent_pb2_grpc.AttachmentServiceStub(channel)  # type: ignore[no-untyped-call]
        debug = agent_pb2_grpc.DebugServiceStub(channel)  # type: ignore[no-untyped-call]
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if debug.Status(agent_pb2.StatusRequest(), timeout=1).ready:
                    break
            except grpc.RpcError:
                pass
            time.sleep(0.1)
        pods = {}
        for name in ("frontend", "backend", "other"):
            path = env.add_netns()
            resp = attach.Add(
                agent_pb2.AddRequest(
                    container_id=f"k-{name}",
                    ifname="eth0",
                    netns=path,
                    labels={"app": name},
                    pod_namespace="default",
                    pod_name=name,
                ),
                timeout=30,
            )
            pods[name] = (path.rsplit("/", 1)[1], resp.ips[0].address.split("/")[0])
        channel.close()
        op.apply_policy(
            {
                "apiVersion": "cilium.io/v2",
                "kind": "CiliumNetworkPolicy",
                "metadata": {"name": "l3", "namespace": "default"},
                "spec": {
                    "endpointSelector": {"matchLabels": {"app": "backend"}},
                    "ingress": [{"fromEndpoints": [{"matchLabels": {"app": "frontend"}}]}],
                },
            }
        )
        backend_ip = pods["backend"][1]
        deadline = time.monotonic() + 10
        while _ping(pods["other"][0], backend_ip, "-c1", "-W1").wait() == 0:
            assert time.monotonic() < deadline, "policy never applied"
        flood = _ping(pods["frontend"][0], backend_ip, "-i", "0.002", "-c", "5000")
        time.sleep(0.5)
        procs[0].kill()  # kill -9: no cleanup at all
        procs[0].wait()
        assert _ping(pods["other"][0], backend_ip, "-c1", "-W1").wait() != 0, "enforced while down"
        sock.unlink(missing_ok=True)
        procs.append(_serve(env, op.address, log))
        deadline = time.monotonic() + 60
        while not sock.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert sock.exists() and flood.poll() is None, "restart outlasted the ping flood"
        out, _ = flood.communicate(timeout=60)
        m = re.search(r"(\d+) packets transmitted, (\d+) received", out)
        assert m and m.group(1) == "5000" and m.group(2) == "5000", out
        assert _ping(pods["other"][0], backend_ip, "-c1", "-W1").wait() != 0, "still enforced"
        eps = subprocess.run(
            [
                str(BIN),
                "endpoint",
                "list",
                "--socket",
                str(sock),
                "-o",
                "json",
                "--bpf-pin-dir",
                str(env.pin_dir),
            ],
            capture_output=True,
            text=True,
        )
        assert eps.returncode == 0, eps.stderr
        by_pod = {e["pod_name"]: e for e in json.loads(eps.stdout)}
        assert by_pod["backend"]["policy_enforcement"]["ingress"] is True
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(15)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        log.close()
        op.stop()
