"""cilia_testkit.procs: no preexec_fn, default signals through an exec wrapper, log lines,
kill and reap."""

from __future__ import annotations

import asyncio
import json
import pathlib
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from cilia_testkit import procs

SHOW_SIGINT = (
    "import signal; h = signal.getsignal(signal.SIGINT); "
    "print('ignored' if h == signal.SIG_IGN else h.__name__)"
)


def test_default_signals_wrapper_gives_an_ignored_sigint_back() -> None:
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)  # inherited across exec
    try:
        plain = procs.spawn([sys.executable, "-c", SHOW_SIGINT], stdout=subprocess.PIPE)
        wrapped = procs.spawn(
            [sys.executable, "-c", SHOW_SIGINT], stdout=subprocess.PIPE, default_signals=True
        )
        out_plain, _ = plain.communicate(timeout=30)
        out_wrapped, _ = wrapped.communicate(timeout=30)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert out_plain.strip() == b"ignored"
    assert out_wrapped.strip() == b"default_int_handler"  # KeyboardInterrupt


def test_spawning_from_a_threaded_process_uses_no_python_hook(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[dict[str, object]] = []
    real = subprocess.Popen

    def record(*args: object, **kwargs: object) -> object:
        calls.append(kwargs)
        return real(*args, **kwargs)  # type: ignore[call-overload]

    monkeypatch.setattr(subprocess, "Popen", record)
    stop = threading.Event()
    busy = [threading.Thread(target=stop.wait, daemon=True) for _ in range(4)]
    for thread in busy:
        thread.start()
    try:
        children = [
            procs.spawn(["true"], new_session=True, default_signals=True) for _ in range(20)
        ]
        assert [child.wait(30) for child in children] == [0] * 20
    finally:
        stop.set()
    assert all(call.get("preexec_fn") is None for call in calls)
    assert all(call["start_new_session"] is True for call in calls)


def test_wait_for_file_line_sees_a_line_written_later(tmp_path: pathlib.Path) -> None:
    log = tmp_path / "log"
    proc = procs.spawn(["sh", "-c", f"echo one > {log}; sleep 0.3; echo 'two ready' >> {log}"])
    line = procs.wait_for_file_line(log, lambda s: "ready" in s, timeout=10, proc=proc)
    assert line == "two ready"
    assert proc.wait(10) == 0


def test_wait_for_file_line_reports_an_exit_and_a_timeout(tmp_path: pathlib.Path) -> None:
    proc = procs.spawn(["sh", "-c", "exit 3"])
    with pytest.raises(procs.ProcessExited) as info:
        procs.wait_for_file_line(tmp_path / "none", lambda s: True, timeout=10, proc=proc)
    assert info.value.returncode == 3
    with pytest.raises(TimeoutError):
        procs.wait_for_file_line(tmp_path / "none", lambda s: True, timeout=0.2)


def test_listening_reads_the_announced_addresses() -> None:
    line = {"msg": "listening", "listener": "grpc", "address": "127.0.0.1:41234"}
    assert procs.listening(json.dumps(line)) == ("grpc", "127.0.0.1:41234")
    assert procs.listening(json.dumps({"msg": "ready"})) is None
    assert procs.listening("Traceback (most recent call last):") is None
    assert procs.listening("[1, 2]") is None


def test_read_listening_collects_every_listener_from_a_child_log() -> None:
    lines = [
        {"msg": "starting"},
        {"msg": "listening", "listener": "observer", "address": "127.0.0.1:40001"},
        {"msg": "listening", "listener": "health", "address": "unix:/tmp/h.sock"},
    ]
    script = "; ".join(f"print({json.dumps(json.dumps(x))}, flush=True)" for x in lines)

    async def main() -> tuple[dict[str, str], str]:
        proc = await procs.spawn_async(
            [sys.executable, "-c", script + "; import time; time.sleep(30)"],
            stdout=asyncio.subprocess.PIPE,
        )
        assert proc.stdout is not None
        try:
            found = await procs.read_listening(proc.stdout, ["observer", "health"], timeout=20)
        finally:
            proc.kill()
            await proc.wait()
        short = await procs.spawn_async(
            [sys.executable, "-c", "print('no listener')"], stdout=asyncio.subprocess.PIPE
        )
        assert short.stdout is not None
        with pytest.raises(EOFError) as info:
            await procs.read_listening(short.stdout, ["observer"], timeout=20)
        await short.wait()
        return found, str(info.value)

    found, error = asyncio.run(main())
    assert found == {"observer": "127.0.0.1:40001", "health": "unix:/tmp/h.sock"}
    assert "['observer']" in error and "no listener" in error


def test_stop_escalates_to_kill_and_reaps() -> None:
    proc = procs.spawn(["sh", "-c", "trap '' TERM; while :; do sleep 0.1; done"])
    time.sleep(0.2)  # let the shell install its trap
    started = time.monotonic()
    status = procs.stop(proc, timeout=1)
    assert status == -signal.SIGKILL
    assert time.monotonic() - started < 10
    assert procs.exited(proc.pid)


def test_kill_of_a_group_takes_the_grandchildren_too(tmp_path: pathlib.Path) -> None:
    pidfile = tmp_path / "pid"
    proc = procs.spawn(["sh", "-c", f"sleep 60 & echo $! > {pidfile}; wait"], new_session=True)
    procs.wait_for_file_line(pidfile, lambda s: s.isdigit(), timeout=10, proc=proc)
    grandchild = int(pidfile.read_text())
    assert procs.kill(proc, group=True) == -signal.SIGKILL
    deadline = time.monotonic() + 10
    while not procs.exited(grandchild):  # reaped by init once its parent is gone
        assert time.monotonic() < deadline, "grandchild survived its group's SIGKILL"
        time.sleep(0.05)


def test_kill_of_an_already_reaped_process_returns_its_status() -> None:
    proc = procs.spawn(["sh", "-c", "exit 5"])
    assert proc.wait(10) == 5
    assert procs.kill(proc) == 5


def test_refused_address_refuses_connections_while_held() -> None:
    with procs.refused_address() as address:
        host, port = address.rsplit(":", 1)
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection((host, int(port)), timeout=5)
