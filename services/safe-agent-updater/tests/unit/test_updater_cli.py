"""The updater skeleton: ``--version`` and a health server that reports SERVING."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cilia_safe_agent_updater import __version__

STARTUP_TIMEOUT_SECONDS = 20.0


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _health_status(address: str) -> int:
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        response = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=1.0)
        return int(response.status)


def test_version_flag_prints_name_and_version() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "cilia_safe_agent_updater", "--version"],
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    )
    assert out.stdout.strip() == f"cilia-safe-agent-updater {__version__}"


def test_serve_reports_serving_on_health_address_and_stops_on_sigterm() -> None:
    address = f"127.0.0.1:{_free_port()}"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "cilia_safe_agent_updater",
            "serve",
            "--health-listen-address",
            address,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_SECONDS
        status = None
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                status = _health_status(address)
                break
            except grpc.RpcError:
                time.sleep(0.1)
        assert status == health_pb2.HealthCheckResponse.SERVING, proc.stderr
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_serve_fails_with_exit_2_when_address_is_taken() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        address = f"127.0.0.1:{sock.getsockname()[1]}"
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "cilia_safe_agent_updater",
                "serve",
                "--health-listen-address",
                address,
            ],
            capture_output=True,
            text=True,
            timeout=30,
        )
    assert out.returncode == 2
    assert "cannot listen on" in out.stderr
