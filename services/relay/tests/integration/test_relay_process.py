"""``cilia-relay serve`` and ``cilia-relay observe`` exec'd as processes.

Two contract-level fake agents run in the test's event loop (real gRPC on unix
sockets); the relay is a real ``python -m cilia_relay serve`` process on TCP ports;
``observe`` is exec'd against it and its output parsed.
"""

from __future__ import annotations

import asyncio
import json
import os
import pathlib
import signal
import socket
import sys
import time
import urllib.request
from collections.abc import AsyncIterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from relay_fakes import NS, FakeAgent, agents, make_flow

from cilia.hubble.flow import flow_pb2
from cilia.hubble.observer import observer_pb2, observer_pb2_grpc
from cilia.hubble.relay import relay_pb2

pytestmark = pytest.mark.timeout(90)

ENV = {**os.environ, "PYTHONUNBUFFERED": "1"}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def fake_cluster(sockdir: pathlib.Path, base: int) -> tuple[FakeAgent, FakeAgent]:
    a_sock, b_sock = sockdir / "a.sock", sockdir / "b.sock"
    a = FakeAgent(
        "node-a",
        a_sock,
        [
            make_flow(base + 0 * NS, "node-a"),
            make_flow(
                base + 2 * NS,
                "node-a",
                src=("default", "other", 41000, 1003),
                verdict=flow_pb2.DROPPED,
                drop_reason=133,
            ),
            make_flow(base + 4 * NS, "node-a"),
        ],
        peers={
            "node-a": f"unix:{a_sock}",
            "node-b": f"unix:{b_sock}",
            "node-c": f"unix:{sockdir}/missing.sock",
        },
    )
    b = FakeAgent(
        "node-b",
        b_sock,
        [
            make_flow(base + 1 * NS, "node-b"),
            make_flow(base + 3 * NS, "node-b"),
            make_flow(
                base + 5 * NS,
                "node-b",
                src=("default", "other", 41001, 1003),
                verdict=flow_pb2.DROPPED,
                drop_reason=181,
            ),
        ],
    )
    return a, b


@pytest.fixture
def ports() -> dict[str, int]:
    return {"listen": free_port(), "health": free_port(), "metrics": free_port()}


async def start_relay(
    peer_service: str, ports: dict[str, int], expect_connected: int
) -> asyncio.subprocess.Process:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "cilia_relay",
        "serve",
        "--peer-service",
        peer_service,
        "--listen-address",
        f"127.0.0.1:{ports['listen']}",
        "--health-listen-address",
        f"127.0.0.1:{ports['health']}",
        "--prometheus-serve-addr",
        f"127.0.0.1:{ports['metrics']}",
        "--retry-timeout",
        "300ms",
        "--sort-buffer-drain-timeout",
        "200ms",
        "--peer-update-interval",
        "200ms",
        env=ENV,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    deadline = time.monotonic() + 30
    async with grpc.aio.insecure_channel(f"127.0.0.1:{ports['listen']}") as channel:
        stub = observer_pb2_grpc.ObserverStub(channel)
        while True:
            assert proc.returncode is None, "relay exited early"
            try:
                nodes = (await stub.GetNodes(observer_pb2.GetNodesRequest(), timeout=2)).nodes
                if sum(n.state == relay_pb2.NODE_CONNECTED for n in nodes) == expect_connected:
                    return proc
            except grpc.aio.AioRpcError:
                pass
            assert time.monotonic() < deadline, "relay did not connect to the agents"
            await asyncio.sleep(0.1)


async def stop_relay(proc: asyncio.subprocess.Process) -> str:
    if proc.returncode is None:
        proc.send_signal(signal.SIGTERM)
    _, err = await asyncio.wait_for(proc.communicate(), 20)
    assert proc.returncode == 0, err.decode()
    return err.decode()


async def observe(*args: str) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "cilia_relay",
        "observe",
        *args,
        env=ENV,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


def test_observe_prints_merged_compact_lines_and_json_through_the_relay_process(
    sockdir: pathlib.Path, ports: dict[str, int]
) -> None:
    async def main() -> None:
        base = time.time_ns() - 120 * NS
        a, b = fake_cluster(sockdir, base)
        async with agents(a, b):
            relay = await start_relay(a.address, ports, expect_connected=2)
            server = f"127.0.0.1:{ports['listen']}"
            try:
                # health is SERVING on the health port once the Peer stream is up
                async with grpc.aio.insecure_channel(f"127.0.0.1:{ports['health']}") as ch:
                    status = await health_pb2_grpc.HealthStub(ch).Check(
                        health_pb2.HealthCheckRequest(), timeout=2
                    )
                assert status.status == health_pb2.HealthCheckResponse.SERVING

                code, out, err = await observe("--server", server, "--last", "3")
                assert code == 0, err
                lines = out.splitlines()
                assert len(lines) == 6, out
                assert lines[0].endswith(
                    "default/frontend:40000 (ID:1001) -> default/backend:8080 (ID:1002) "
                    "to-endpoint FORWARDED (TCP Flags: SYN)"
                )
                assert (
                    "default/other:41000 (ID:1003) -> default/backend:8080 (ID:1002) "
                    "Policy denied DROPPED (TCP Flags: SYN)"
                ) in lines[2]
                assert "Policy denied by denylist DROPPED" in lines[5]
                assert "1 nodes are unavailable: node-c" in err

                code, out, err = await observe(
                    "--server",
                    server,
                    "--last",
                    "3",
                    "-o",
                    "json",
                    "--verdict",
                    "DROPPED",
                    "--pod",
                    "default/other",
                )
                assert code == 0, err
                rows = [json.loads(line) for line in out.splitlines()]
                assert [r["node_name"] for r in rows] == ["node-a", "node-b"] * 3
                assert rows[2]["flow"]["verdict"] == "DROPPED"
                assert rows[2]["flow"]["drop_reason_desc"] == "POLICY_DENIED"
                assert rows[2]["flow"]["source"]["pod_name"] == "other"
                # the filters reached both agents exactly as hubble builds them
                expected = [
                    flow_pb2.FlowFilter(verdict=[flow_pb2.DROPPED], source_pod=["default/other"]),
                    flow_pb2.FlowFilter(
                        verdict=[flow_pb2.DROPPED], destination_pod=["default/other"]
                    ),
                ]
                for agent in (a, b):
                    assert list(agent.requests[-1].whitelist) == expected
                    assert agent.requests[-1].number == 3

                metrics = await asyncio.to_thread(
                    lambda: (
                        urllib.request.urlopen(
                            f"http://127.0.0.1:{ports['metrics']}/metrics", timeout=5
                        )
                        .read()
                        .decode()
                    )
                )
                assert 'hubble_relay_pool_peer_connection_status{status="READY"} 2.0' in metrics
                assert (
                    'hubble_relay_pool_peer_connection_status{status="NIL_CONNECTION"} 1.0'
                    in metrics
                )
            finally:
                await stop_relay(relay)

    asyncio.run(main())


def _default_sigint() -> None:
    """In the child before exec: SIGINT back to its default disposition."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_observe_follow_streams_new_flows_and_survives_an_agent_dying(
    sockdir: pathlib.Path, ports: dict[str, int]
) -> None:
    async def lines_of(stream: asyncio.StreamReader) -> AsyncIterator[str]:
        while True:
            line = await asyncio.wait_for(stream.readline(), 15)
            if not line:
                return
            yield line.decode().rstrip("\n")

    async def main() -> None:
        base = time.time_ns() - 120 * NS
        a, b = fake_cluster(sockdir, base)
        async with agents(a, b):
            relay = await start_relay(a.address, ports, expect_connected=2)
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "cilia_relay", "observe",
                "--server", f"127.0.0.1:{ports['listen']}", "--last", "1", "--follow",
                env=ENV, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
                # a test run started in the background (`cmd &`) inherits SIGINT ignored, and
                # Python then never installs KeyboardInterrupt: give the child the default back
                preexec_fn=_default_sigint,
            )  # fmt: skip
            try:
                assert proc.stdout is not None and proc.stderr is not None
                seen: list[str] = []
                reader = lines_of(proc.stdout)
                while len(seen) < 2:
                    seen.append(await reader.__anext__())
                await b.stop()
                await a.push(make_flow(time.time_ns(), "node-a", src=("default", "late", 1, 1004)))
                line = await reader.__anext__()
                assert "default/late:1 (ID:1004) -> default/backend:8080" in line
                assert proc.returncode is None, "observe must keep following"
                error = await asyncio.wait_for(proc.stderr.readline(), 30)
                while b"Error" not in error:
                    error = await asyncio.wait_for(proc.stderr.readline(), 30)
                assert b"on 1 nodes: node-b" in error
            finally:
                if proc.returncode is None:
                    proc.send_signal(signal.SIGINT)
                await asyncio.wait_for(proc.wait(), 30)
                await stop_relay(relay)
            assert proc.returncode == 0, "observe exits 0 on SIGINT"

    asyncio.run(main())


def test_observe_exits_1_with_a_clear_message_when_the_server_is_unreachable(
    sockdir: pathlib.Path,
) -> None:
    code, out, err = asyncio.run(
        observe("--server", f"unix:{sockdir}/nothing.sock", "--timeout", "500ms")
    )
    assert code == 1
    assert out == ""
    assert err.strip() == (
        f"cilia-relay observe: cannot connect to unix:{sockdir}/nothing.sock within 0.5s "
        "(is cilia-relay serve running there?)"
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--verdict", "MAYBE"], "invalid --verdict value"),
        (["--port", "99999"], "invalid --port value"),
        (["--protocol", "smoke"], "invalid --protocol value"),
        (["--pod", "a", "--from-pod", "b"], "filters --from-pod and --pod cannot be combined"),
        (["-o", "yaml"], "invalid choice"),
        (["--last", "many"], "invalid int value"),
        (["--timeout", "soon"], "is not a duration"),
    ],
)
def test_observe_refuses_bad_flags_with_exit_2_and_one_line(args: list[str], message: str) -> None:
    code, _out, err = asyncio.run(observe("--server", "unix:/nonexistent", *args))
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert message in lines[0]
