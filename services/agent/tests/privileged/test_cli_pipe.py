"""``cilia-agent status`` / ``endpoint list`` writing into a pipe whose reader went away
(``cilia-agent endpoint list -o json | head -1``): a quiet exit, no BrokenPipeError."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import time

from .conftest import Env

BIN = pathlib.Path(sys.executable).parent / "cilia-agent"
STARTUP_TIMEOUT_SECONDS = 60.0


def _into_closed_pipe(*args: str) -> subprocess.CompletedProcess[str]:
    """Run ``cilia-agent ARGS`` with stdout a pipe whose read end is already closed (the
    first write or flush fails with EPIPE, as after ``head -1`` exited)."""
    reader, writer = os.pipe()
    os.close(reader)
    try:
        return subprocess.run(
            [str(BIN), *args], stdout=writer, stderr=subprocess.PIPE, text=True, timeout=60
        )
    finally:
        os.close(writer)


def test_output_into_a_closed_pipe_exits_quietly(env: Env) -> None:
    sock = env.tmp / "pipe.sock"
    log = (env.tmp / "agent.log").open("w+")
    proc = subprocess.Popen(
        [str(BIN), "serve", "--node-name", f"pipe-{env.tag}", "--operator", "",
         "--state-dir", str(env.state_dir), "--socket", str(sock),
         "--cni-conf-dir", str(env.tmp / "net.d"), "--cni-del-queue-dir", str(env.tmp / "dq"),
         "--host-device-name", env.host_device, "--prometheus-serve-addr", "",
         "--hubble-listen-address", "", "--enable-bpf=false", "--enable-ipv4-masquerade=false"],
        stderr=log, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_SECONDS
        while not sock.exists() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.05)
        assert sock.exists(), "agent did not start"
        # the commands work into a live pipe ...
        ok = subprocess.run([str(BIN), "endpoint", "list", "--socket", str(sock), "-o", "json"],
                            capture_output=True, text=True, timeout=60)  # fmt: skip
        assert ok.returncode == 0 and ok.stdout.strip() == "[]", ok.stderr
        # ... and end quietly when the reader is gone
        for args in (
            ("endpoint", "list", "--socket", str(sock), "-o", "json"),
            ("endpoint", "list", "--socket", str(sock)),
            ("status", "--socket", str(sock), "-o", "json"),
        ):
            got = _into_closed_pipe(*args)
            assert "Traceback" not in got.stderr and "BrokenPipe" not in got.stderr, got.stderr
            assert got.stderr == "", got.stderr
            assert got.returncode == 1, (args, got.returncode)
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(15)
        log.close()
