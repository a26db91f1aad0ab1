"""cilia_testkit.skips: reasons, skip outside CI, failure in CI."""

from __future__ import annotations

import os
import pathlib
import socket
import threading

import pytest

from cilia_testkit import skips


def test_require_none_is_a_no_op(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(skips.CI_ENV, "1")
    skips.require(None)


def test_missing_requirement_skips_with_its_reason_outside_ci(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(skips.CI_ENV, raising=False)
    with pytest.raises(pytest.skip.Exception, match="needs 'no-such-tool-x'"):
        skips.require_binary("no-such-tool-x", "x-tools")


def test_missing_requirement_fails_in_ci_naming_the_variable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(skips.CI_ENV, "1")
    with pytest.raises(pytest.fail.Exception) as info:
        skips.require_binary("no-such-tool-x", "x-tools")
    assert "CILIA_REQUIRE_PRIVILEGED=1" in str(info.value)
    assert "apt-get install x-tools" in str(info.value)


def test_host_in_use_skips_even_in_ci(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(skips.CI_ENV, "1")
    with pytest.raises(pytest.skip.Exception, match="socket exists"):
        skips.host_in_use("a socket exists")


def test_binary_missing_is_none_for_a_binary_on_path() -> None:
    assert skips.binary_missing("sh") is None


def test_root_missing_follows_the_effective_uid(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert skips.root_missing("tc") == "needs root (tc)"
    assert skips.netns_missing() == "needs root (network namespaces, veth, iptables)"
    assert (skips.bpf_missing() or "").startswith("needs root")
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    assert skips.root_missing() is None


def test_bpf_missing_names_bpffs_when_it_is_not_mounted(
    monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path
) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    monkeypatch.setattr(skips, "BPFFS", tmp_path / "absent")
    assert skips.bpf_missing() == f"bpffs is not mounted at {tmp_path / 'absent'}"


def _fake_engine(path: pathlib.Path, status: bytes) -> threading.Thread:
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    server.listen(1)

    def answer() -> None:
        conn, _ = server.accept()
        with conn, server:
            request = b""
            while b"\r\n\r\n" not in request:
                request += conn.recv(4096)
            assert request.startswith(b"GET /_ping HTTP/1.1")
            conn.sendall(b"HTTP/1.1 " + status + b"\r\nContent-Length: 2\r\n\r\nOK")

    thread = threading.Thread(target=answer, daemon=True)
    thread.start()
    return thread


def test_docker_missing_pings_the_engine_socket(
    monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path
) -> None:
    sock = tmp_path / "docker.sock"
    monkeypatch.setenv("DOCKER_HOST", f"unix://{sock}")
    assert (skips.docker_missing() or "").startswith(f"no Docker engine at {sock}")
    thread = _fake_engine(sock, b"200 OK")
    assert skips.docker_missing() is None
    thread.join(5)
    sock.unlink()
    thread = _fake_engine(sock, b"500 Internal Server Error")
    assert skips.docker_missing() == f"the Docker engine at {sock} answers /_ping with HTTP 500"
    thread.join(5)
