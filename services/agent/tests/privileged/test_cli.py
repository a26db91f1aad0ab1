"""The real ``cilia-agent`` console script: serve (with the eBPF datapath), status,
endpoint list, bpf maps, metrics, SIGTERM."""

from __future__ import annotations

import json
import pathlib
import signal
import socket
import subprocess
import sys
import time
import urllib.request

from .conftest import Env

BIN = pathlib.Path(sys.executable).parent / "cilia-agent"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_serve_status_endpoint_list_metrics_and_clean_sigterm(env: Env) -> None:
    sock = env.tmp / "cli.sock"
    port = _free_port()
    log = (env.tmp / "agent.log").open("w+")  # a pipe would fill up at debug level
    proc = subprocess.Popen(
        [
            str(BIN),
            "serve",
            "--node-name",
            "cli-node",
            "--operator",
            "",
            "--state-dir",
            str(env.state_dir),
            "--socket",
            str(sock),
            "--cni-conf-dir",
            str(env.tmp / "net.d"),
            "--host-device-name",
            env.host_device,
            "--prometheus-serve-addr",
            f"127.0.0.1:{port}",
            "--log-level",
            "debug",
            "--bpf-root",
            str(env.pin_dir),
            "--hubble-listen-address",
            "",
        ],
        stderr=log,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60  # compiles bpf_lxc.c first
        while not sock.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        st = subprocess.run(
            [str(BIN), "status", "--socket", str(sock)], capture_output=True, text=True
        )
        assert st.returncode == 1, st.stderr  # running, not ready: no CIDR
        assert "cli-node" in st.stdout and "not ready" in st.stdout
        assert f"Datapath: eBPF loaded, pin dir {env.pin_dir}" in st.stdout
        assert "Hubble: 0/4095 flows" in st.stdout
        hubble_sock = env.tmp / "hubble.sock"
        assert hubble_sock.stat().st_mode & 0o777 == 0o600
        assert (env.pin_dir / "cilia_policy").exists()
        ipcache = subprocess.run(
            [str(BIN), "bpf", "ipcache", "list", "--bpf-pin-dir", str(env.pin_dir), "-o", "json"],
            capture_output=True,
            text=True,
        )
        assert ipcache.returncode == 0, ipcache.stderr
        assert all(e["identity"] == 1 for e in json.loads(ipcache.stdout)), "node addresses = host"
        missing = subprocess.run(
            [str(BIN), "bpf", "policy", "list", "--bpf-pin-dir", str(env.tmp / "nope")],
            capture_output=True,
            text=True,
        )
        assert missing.returncode == 1 and "cannot open pinned map" in missing.stderr
        ls = subprocess.run(
            [str(BIN), "endpoint", "list", "--socket", str(sock), "-o", "json"],
            capture_output=True,
            text=True,
        )
        assert ls.returncode == 0 and json.loads(ls.stdout) == []
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read()
        text = body.decode()
        for name in (
            "cilium_endpoint ",
            "cilium_ip_addresses{",
            "cilium_ipam_capacity{",
            "cilium_policy ",
            "# TYPE cilium_drop_count_total counter",
            "# TYPE cilium_forward_count_total counter",
            "# TYPE hubble_flows_processed_total counter",
        ):
            assert name in text
        assert sock.stat().st_mode & 0o777 == 0o600
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(15) == 0
        assert not sock.exists() and not hubble_sock.exists()
        log.seek(0)
        lines = [json.loads(line) for line in log.read().splitlines() if line.startswith("{")]
        assert any(line["msg"] == "stopped" for line in lines)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
