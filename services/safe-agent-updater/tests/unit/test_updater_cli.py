"""The updater skeleton: ``--version`` and a health server that reports SERVING."""

from __future__ import annotations

import os
import pathlib
import signal
import socket
import subprocess
import sys
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cilia_safe_agent_updater import __version__
from cilia_safe_agent_updater.__main__ import build_parser, main
from cilia_safe_agent_updater.exitcodes import Exit
from cilia_testkit import procs

STARTUP_TIMEOUT_SECONDS = 20.0


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


def test_serve_reports_serving_on_health_address_and_stops_on_sigterm(
    tmp_path: pathlib.Path,
) -> None:
    # a unix socket of its own: no TCP port to pick (the taken-port case is tested below)
    address = f"unix:{tmp_path}/health.sock"
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


@pytest.mark.parametrize(
    ("flag", "value", "form"),
    [
        ("--redis", "127.0.0.1:6379", "redis://HOST[:PORT][/DB]"),
        ("--redis", "redis://h:port/0", "redis://HOST[:PORT][/DB]"),
        ("--redis", "redis://h/zero", "database 'zero' is not a number"),
        ("--redis", "redis:///0", "no host"),
        ("--docker-url", "localhost", "tcp://HOST:PORT"),
        ("--docker-url", "tcp://h:notaport", "unix:///PATH"),
        ("--image", "Cilia Agent:1", "[REGISTRY[:PORT]/]NAME[:TAG][@DIGEST]"),
        ("--image", "cilia-agent:", "[REGISTRY[:PORT]/]NAME[:TAG][@DIGEST]"),
        # path components are lowercase; a first component without '.'/':' (not 'localhost')
        # is a path component, as in Docker's normalisation (the engine refuses these too)
        ("--image", "Nginx:1", "repository path lowercase"),
        ("--image", "UPPER/case:tag", "repository path lowercase"),
        ("--image", "LOCALHOST/agent:1", "repository path lowercase"),
        ("--image", "registry.local/Cilia/agent:1", "repository path lowercase"),
        ("--image", "registry.local:5000/cilia/Agent:1", "repository path lowercase"),
        ("--docker-url", "unix://relative/path", "unix:///PATH"),
        ("--docker-url", "unix://", "unix:///PATH"),
    ],
)
def test_malformed_addresses_and_image_are_usage_errors(
    flag: str, value: str, form: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Exit 2 (usage) naming the flag and the expected form, before any connection is
    tried (3 is kept for a well-formed address that does not answer)."""
    argv = ["--mode", "docker", "--image", "cilia-agent:1", "--docker-url", "tcp://127.0.0.1:9"]
    with pytest.raises(SystemExit) as exit_info:
        main([*argv, flag, value])
    assert exit_info.value.code == Exit.USAGE
    err = capsys.readouterr().err
    assert f"argument {flag}: {value!r}" in err and form in err, err


def test_well_formed_engine_address_that_does_not_answer_exits_3() -> None:
    with procs.refused_address() as refused:  # held bound, never listening
        got = subprocess.run(
            [sys.executable, "-m", "cilia_safe_agent_updater", "--mode", "docker",
             "--image", "registry.local:5000/cilia/agent:1.2@sha256:" + "a" * 64,
             "--docker-url", f"tcp://{refused}", "--docker-timeout", "5",
             "--redis", "redis://127.0.0.1:6379/0"],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
    assert got.returncode == Exit.API_UNAVAILABLE, got.stderr
    assert "--docker-url: Docker engine" in got.stderr


@pytest.mark.parametrize(
    "url",
    [
        "redis://admin:s3cr3tPW@h:port/0",  # malformed: parse-time message
        "redis://admin:s3cr3tPW@h/zero",
        "unix:///run/redis.sock?password=s3cr3tPW&db=x",
    ],
)
def test_malformed_redis_url_error_does_not_echo_the_password(
    url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--mode", "docker", "--image", "cilia-agent:1", "--redis", url])
    assert exit_info.value.code == Exit.USAGE
    captured = capsys.readouterr()
    assert "s3cr3tPW" not in captured.out + captured.err, captured.err
    assert "argument --redis: " in captured.err and "***" in captured.err, captured.err


_KUBECONFIG_NOT_A_URL = """\
apiVersion: v1
kind: Config
clusters: [{name: c, cluster: {server: "not a url"}}]
users: [{name: u, user: {token: t}}]
contexts: [{name: x, context: {cluster: c, user: u}}]
current-context: x
"""


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        (b"garbage: [", "ParserError"),
        (bytes(range(128, 256)) * 2, "UnicodeDecodeError"),
        (b"[1, 2]", "TypeError"),
        (_KUBECONFIG_NOT_A_URL.encode(), "cluster server 'not a url' is not a URL"),
        (b"", "is empty"),
    ],
    ids=["bad-yaml", "binary", "wrong-shape", "server-not-a-url", "empty"],
)
def test_unreadable_kubeconfig_is_a_usage_error_without_traceback(
    content: bytes, problem: str, tmp_path: pathlib.Path
) -> None:
    """README: exit 2 for an unreadable kubeconfig; one line naming the file and the problem."""
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_bytes(content)
    got = subprocess.run(
        [sys.executable, "-m", "cilia_safe_agent_updater", "--mode", "kubernetes",
         "--node-name", "n", "--kubeconfig", str(kubeconfig), "--api-retries", "0"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert got.returncode == Exit.USAGE, got.stderr
    assert "Traceback" not in got.stderr, got.stderr
    last = got.stderr.strip().splitlines()[-1]
    assert last.startswith(f"cilia-safe-agent-updater: --kubeconfig {kubeconfig}: "), last
    assert "unreadable kubeconfig" in last and problem in last, last


@pytest.mark.parametrize(
    "image",
    [
        "cilia-agent:1",
        "cilia/agent_x.y__z--w:1.2",
        "localhost/cilia-agent:1",
        "localhost:5000/cilia-agent",
        "registry.local:5000/cilia/agent:1.2",
        # the registry host is a DNS name: case-insensitive, the grammar allows upper case
        "Registry.Local:5000/cilia/agent:1.2",
        "REGISTRY:5000/cilia/agent",
        "cilia-agent@sha256:" + "a" * 64,
    ],
)
def test_well_formed_image_references_are_accepted(image: str) -> None:
    args = build_parser().parse_args(["--mode", "docker", "--image", image])
    assert args.image == image


def test_absolute_unix_docker_url_is_accepted() -> None:
    args = build_parser().parse_args(["--docker-url", "unix:///var/run/docker.sock"])
    assert args.docker_url == "unix:///var/run/docker.sock"


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--health-listen-address", "nowhere"], "--health-listen-address: 'nowhere' is not"),
        (["--shutdown-grace-period", "-1"], "--shutdown-grace-period: Input should be greater"),
        (["--log-level", "loud"], "--log-level: Input should be"),
    ],
)
def test_serve_flags_come_from_the_config_model_and_refuse_with_one_line(
    flags: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["serve", *flags]) == Exit.USAGE
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"cilia-safe-agent-updater serve: {message}")
