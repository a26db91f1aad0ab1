"""cilia_testkit.redis: a private redis-server on a unix socket or a TCP port it owns."""

from __future__ import annotations

import pathlib
import random
import socket

import pytest

from cilia_testkit import redis as testredis
from cilia_testkit import skips


@pytest.fixture(autouse=True)
def _needs_redis() -> None:
    skips.require_binary("redis-server")


def _command(address: tuple[str, int] | str, *words: str) -> bytes:
    """One RESP command over a plain socket; the raw reply line."""
    family = socket.AF_UNIX if isinstance(address, str) else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.settimeout(5)
        sock.connect(address)
        payload = f"*{len(words)}\r\n".encode()
        for word in words:
            payload += f"${len(word.encode())}\r\n{word}\r\n".encode()
        sock.sendall(payload)
        return sock.recv(4096)


def test_unix_socket_server_answers_and_is_gone_after_exit() -> None:
    with testredis.RedisServer() as server:
        assert server.socket is not None and server.port is None
        assert server.url == f"unix://{server.socket}?db=0"
        assert _command(str(server.socket), "PING") == b"+PONG\r\n"
        assert _command(str(server.socket), "CONFIG", "GET", "port").endswith(b"$1\r\n0\r\n")
        directory, proc = server.directory, server.proc
    assert proc is not None and proc.poll() is not None
    assert not directory.exists()


def test_two_tcp_servers_get_distinct_ports_and_the_given_flags(tmp_path: pathlib.Path) -> None:
    with (
        testredis.RedisServer(tmp_path / "a", tcp=True) as a,
        testredis.RedisServer(tmp_path / "b", tcp=True, args=["--requirepass", "pw"]) as b,
    ):
        assert a.port is not None and b.port is not None and a.port != b.port
        assert a.url == f"redis://127.0.0.1:{a.port}/0"
        assert _command(("127.0.0.1", a.port), "PING") == b"+PONG\r\n"
        assert _command(("127.0.0.1", b.port), "PING").startswith(b"-NOAUTH")
    assert (tmp_path / "a").is_dir(), "a directory given by the caller is kept"


def test_a_taken_port_is_skipped_not_shared(
    monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path
) -> None:
    with testredis.RedisServer(tmp_path / "first", tcp=True) as first:
        taken = first.port
        assert taken is not None
        free = 31999 if taken != 31999 else 31998
        # the first port tried is the one in use, then one that is free
        monkeypatch.setattr(random, "sample", lambda _range, _n: [taken, free])
        with testredis.RedisServer(tmp_path / "second", tcp=True) as second:
            assert second.port == free
            assert second.proc is not None and second.proc.poll() is None


def test_appendonly_writes_the_append_only_file(tmp_path: pathlib.Path) -> None:
    with testredis.RedisServer(tmp_path, appendonly=True) as server:
        assert server.socket is not None
        assert _command(str(server.socket), "SET", "k", "v") == b"+OK\r\n"
    assert any(p.name.startswith("appendonly") for p in tmp_path.iterdir())


def test_a_bad_flag_is_a_start_error_with_the_log() -> None:
    with pytest.raises(testredis.RedisStartError, match="exited"):
        testredis.RedisServer(args=["--no-such-option", "1"], start_timeout=5).start()
