"""``cilia-relay serve`` and ``cilia-relay observe`` exec'd as processes.

Two contract-level fake agents run in the test's event loop (real gRPC on unix
sockets); the relay is a real ``python -m cilia_relay serve`` process on TCP ports it binds
itself (port 0, read back from its ``"listening"`` log lines); ``observe`` is exec'd against
it (through cilia_testkit.procs: no ``preexec_fn``) and its output parsed.
"""

from __future__ import annotations

import asyncio
import json
import os
import pathlib
import signal
import subprocess
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
from cilia_testkit import procs, skips

pytestmark = pytest.mark.timeout(90)

ENV = {**os.environ, "PYTHONUNBUFFERED": "1"}


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


#: The relay's listeners, each logged as ``"listening"`` with the address it bound.
LISTENERS = ("observer", "health", "metrics")


async def start_relay(
    peer_service: str, expect_connected: int
) -> tuple[asyncio.subprocess.Process, dict[str, str]]:
    """The relay on ports it binds itself; ``(process, {listener: "127.0.0.1:PORT"})``."""
    proc = await procs.spawn_async(
        [
            sys.executable,
            "-m",
            "cilia_relay",
            "serve",
            "--peer-service",
            peer_service,
            "--listen-address",
            "127.0.0.1:0",
            "--health-listen-address",
            "127.0.0.1:0",
            "--prometheus-serve-addr",
            "127.0.0.1:0",
            "--retry-timeout",
            "300ms",
            "--sort-buffer-drain-timeout",
            "200ms",
            "--peer-update-interval",
            "200ms",
        ],
        env=ENV,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    assert proc.stderr is not None
    try:
        addresses = await procs.read_listening(proc.stderr, LISTENERS, timeout=30)
    except EOFError as exc:
        raise AssertionError(f"relay exited early: {exc}") from None
    deadline = time.monotonic() + 30
    async with grpc.aio.insecure_channel(addresses["observer"]) as channel:
        stub = observer_pb2_grpc.ObserverStub(channel)
        while True:
            assert proc.returncode is None, "relay exited early"
            try:
                nodes = (await stub.GetNodes(observer_pb2.GetNodesRequest(), timeout=2)).nodes
                if sum(n.state == relay_pb2.NODE_CONNECTED for n in nodes) == expect_connected:
                    return proc, addresses
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
    proc = await procs.spawn_async(
        [sys.executable, "-m", "cilia_relay", "observe", *args],
        env=ENV,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


def test_observe_prints_merged_compact_lines_and_json_through_the_relay_process(
    sockdir: pathlib.Path,
) -> None:
    async def main() -> None:
        base = time.time_ns() - 120 * NS
        a, b = fake_cluster(sockdir, base)
        async with agents(a, b):
            relay, listening = await start_relay(a.address, expect_connected=2)
            server = listening["observer"]
            try:
                # health is SERVING on the health port once the Peer stream is up
                async with grpc.aio.insecure_channel(listening["health"]) as ch:
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
                        urllib.request.urlopen(f"http://{listening['metrics']}/metrics", timeout=5)
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


def test_observe_follow_streams_new_flows_and_survives_an_agent_dying(
    sockdir: pathlib.Path,
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
            relay, listening = await start_relay(a.address, expect_connected=2)
            proc = await procs.spawn_async(
                [sys.executable, "-m", "cilia_relay", "observe",
                 "--server", listening["observer"], "--last", "1", "--follow"],
                env=ENV, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
                # a test run started in the background (`cmd &`) inherits SIGINT ignored, and
                # Python then never installs KeyboardInterrupt: an exec wrapper (no Python
                # hook in the forked child) gives the child the default disposition back
                default_signals=True,
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
        (["--last", str(2**64)], "--last must be <= 18446744073709551615"),  # was a traceback
        (["--server", ""], "--server must not be empty"),  # was "cannot connect to  within"
        (["--timeout", "soon"], "is not a duration"),
    ],
)
def test_observe_refuses_bad_flags_with_exit_2_and_one_line(args: list[str], message: str) -> None:
    code, _out, err = asyncio.run(observe("--server", "unix:/nonexistent", *args))
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert message in lines[0]


def _upstream_hubble() -> pathlib.Path:
    """The upstream CLI built by ``scripts/hubble-cli.sh`` (skip — in CI fail — when missing)."""
    root = pathlib.Path(__file__).resolve().parents[4]
    out = subprocess.run(
        [str(root / "scripts" / "hubble-cli.sh"), "--path"],
        capture_output=True, text=True, timeout=30, check=True,
    )  # fmt: skip
    path = pathlib.Path(out.stdout.strip())
    if not os.access(path, os.X_OK):
        skips.unsupported(
            f"the upstream hubble CLI is not built at {path} (make test-setup builds it)"
        )
    return path


def test_upstream_hubble_reads_thousands_of_batched_flows_packed_per_frame_then_ok(
    sockdir: pathlib.Path,
) -> None:
    """Two batching agents x 3,000 flows through the relay's h2 listener (many flows per
    HTTP/2 DATA frame) to the unmodified Go client: every flow exactly once, exit 0."""
    hubble = _upstream_hubble()
    per_agent = 3000

    async def main() -> list[str]:
        base = time.time_ns() - 600 * NS
        a_sock, b_sock = sockdir / "a.sock", sockdir / "b.sock"
        a = FakeAgent(
            "node-a",
            a_sock,
            [make_flow(base + 2 * i, "node-a", src=("default", "fe", i % 60000, 1)) for i in range(per_agent)],
            peers={"node-a": f"unix:{a_sock}", "node-b": f"unix:{b_sock}"},
            batches=True,
        )  # fmt: skip
        b = FakeAgent(
            "node-b",
            b_sock,
            [make_flow(base + 2 * i + 1, "node-b", src=("default", "fe", i % 60000, 1)) for i in range(per_agent)],
            batches=True,
        )  # fmt: skip
        async with agents(a, b):
            relay, listening = await start_relay(a.address, expect_connected=2)
            try:
                proc = await procs.spawn_async(
                    [str(hubble), "observe", "--server", listening["observer"],
                     "--last", str(per_agent), "-o", "jsonpb", "--print-node-name"],
                    env={**ENV, "HUBBLE_CONFIG": "/dev/null"},
                    stdout=asyncio.subprocess.PIPE,
                    stderr=asyncio.subprocess.PIPE,
                )  # fmt: skip
                out, err = await asyncio.wait_for(proc.communicate(), 60)
                assert proc.returncode == 0, err.decode()
                return [line for line in out.decode().splitlines() if line.startswith('{"flow"')]
            finally:
                await stop_relay(relay)

    lines = asyncio.run(main())
    flows = [json.loads(line)["flow"] for line in lines]
    assert len(flows) == 2 * per_agent
    keys = {(f["node_name"], f["l4"]["TCP"].get("source_port", 0), f["time"]) for f in flows}
    assert len(keys) == 2 * per_agent  # none twice
    assert {f["node_name"] for f in flows} == {"node-a", "node-b"}
