"""Process and slot handling of cilia_testkit.stack with plain commands (no root needed)."""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys

import pytest

from cilia_testkit.host import wait_for
from cilia_testkit.stack import SLOT_DIR, Process, StackError
from cilia_testkit.stackslots import _kill_orphans, _slot


def test_process_logs_a_header_then_output_and_stop_terminates(tmp_path: pathlib.Path) -> None:
    proc = Process("sleeper", tmp_path / "sleeper.log")
    proc.start([sys.executable, "-c", "print('up', flush=True); import time; time.sleep(60)"])
    proc.wait_ready(lambda: "up" in (tmp_path / "sleeper.log").read_text().splitlines(), 10)
    assert proc.running() and proc.pid is not None
    assert os.getsid(proc.pid) == proc.pid, "not started in its own session"
    proc.stop(timeout=5)
    assert not proc.running() and proc.pid is None
    lines = (tmp_path / "sleeper.log").read_text().splitlines()
    assert lines[0].startswith("# ") and "sleep(60)" in lines[0] and lines[1] == "up"


def test_kill_waits_until_the_process_is_gone(tmp_path: pathlib.Path) -> None:
    proc = Process("sleeper", tmp_path / "sleeper.log")
    proc.start([sys.executable, "-c", "import time; time.sleep(60)"])
    pid = proc.kill()
    assert not pathlib.Path(f"/proc/{pid}").exists() or not proc.running()
    with pytest.raises(StackError, match="not running"):
        proc.kill()


def test_wait_ready_reports_an_early_exit_with_the_log_tail(tmp_path: pathlib.Path) -> None:
    proc = Process("broken", tmp_path / "broken.log")
    proc.start([sys.executable, "-c", "import sys; print('bind failed'); sys.exit(3)"])
    with pytest.raises(StackError, match=r"exited with status 3(.|\n)*bind failed"):
        proc.wait_ready(lambda: False, 10)


def test_second_start_of_a_running_process_is_refused(tmp_path: pathlib.Path) -> None:
    proc = Process("sleeper", tmp_path / "sleeper.log")
    proc.start([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        with pytest.raises(StackError, match="already running"):
            proc.start([sys.executable, "-c", "pass"])
    finally:
        proc.stop()


def test_two_slots_held_at_once_differ() -> None:
    with _slot() as first, _slot() as second:
        assert first != second


def test_a_new_holder_of_a_slot_kills_what_a_killed_holder_left_running(
    tmp_path: pathlib.Path,
) -> None:
    run_dir = tmp_path / "cilia-orphan-run"
    orphan = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", str(run_dir)])
    unrelated = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        with _slot() as slot:
            (SLOT_DIR / f"{slot}.pids").write_text(
                f"{orphan.pid} {run_dir}\n{unrelated.pid} {run_dir}\n"
            )
            assert _kill_orphans(slot) == [orphan.pid]
            assert (SLOT_DIR / f"{slot}.pids").read_text() == ""
        assert orphan.wait(timeout=5) == -signal.SIGKILL
        assert unrelated.poll() is None, "a process not naming the run dir was killed"
    finally:
        for proc in (orphan, unrelated):
            proc.kill()
            proc.wait()


def test_a_process_started_elsewhere_is_found_and_stopped_through_its_pidfile(
    tmp_path: pathlib.Path,
) -> None:
    pidfile = tmp_path / "sleeper.pid"
    first = Process("sleeper", tmp_path / "sleeper.log", pidfile=pidfile, binary="sleep(61)")
    first.start([sys.executable, "-c", "import time; time.sleep(61)"])
    assert first.proc is not None
    try:
        # a later command: a new Process object knowing only the pidfile
        later = Process("sleeper", tmp_path / "sleeper.log", pidfile=pidfile, binary="sleep(61)")
        # (until the child has exec'd, /proc/PID/cmdline is still the parent's)
        assert wait_for(later.running, 5) and later.pid == first.proc.pid
        wrong = Process("sleeper", tmp_path / "sleeper.log", pidfile=pidfile, binary="redis")
        assert wrong.pid is None, "a pid whose command line lacks the binary was adopted"
        pid, killed = later.stop(timeout=5)
        assert (pid, killed) == (first.proc.pid, False)
        assert first.proc.wait(timeout=5) == -signal.SIGTERM
        assert not pidfile.exists() and later.pid is None
    finally:
        first.stop()
