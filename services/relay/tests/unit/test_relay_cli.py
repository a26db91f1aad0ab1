"""``cilia-relay`` command line: ``--version``, bind errors and flag validation of ``serve``."""

from __future__ import annotations

import pathlib
import socket
import subprocess
import sys

import pytest

from cilia_relay import __version__


def test_version_flag_prints_name_and_version() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "cilia_relay", "--version"],
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    )
    assert out.stdout.strip() == f"cilia-relay {__version__}"


def test_serve_fails_with_exit_2_when_address_is_taken(tmp_path: pathlib.Path) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        address = f"127.0.0.1:{sock.getsockname()[1]}"
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "cilia_relay",
                "serve",
                "--health-listen-address",
                address,
                "--listen-address",
                f"unix:{tmp_path}/relay.sock",
            ],
            capture_output=True,
            text=True,
            timeout=30,
        )
    assert out.returncode == 2
    assert "cannot listen on" in out.stderr


def test_go_style_port_only_address_listens_on_all_interfaces() -> None:
    from cilia_relay.config import grpc_address

    assert grpc_address(":4222") == "[::]:4222"
    assert grpc_address("127.0.0.1:4222") == "127.0.0.1:4222"
    assert grpc_address("unix:/run/x.sock") == "unix:/run/x.sock"


def _relay(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "cilia_relay", *args], capture_output=True, text=True, timeout=30
    )


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--sort-buffer-len-max", "0"], "--sort-buffer-len-max"),
        (["--sort-buffer-drain-timeout", "1"], "is not a duration"),
        (["--dial-timeout", "5 seconds"], "--dial-timeout"),
        (["--retry-timeout", "-1s"], "--retry-timeout"),
        (["--listen-address", "nowhere"], "--listen-address"),
        (["--peer-service", "unix:"], "--peer-service"),
        (["--prometheus-serve-addr", "localhost"], "--prometheus-serve-addr"),
        (["--log-level", "loud"], "--log-level"),
        (["--no-such-flag"], "unrecognized arguments"),
    ],
)
def test_serve_refuses_bad_flags_with_exit_2_and_one_line(flags: list[str], message: str) -> None:
    out = _relay("serve", *flags)
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    assert message in lines[0]
