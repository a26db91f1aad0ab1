"""Docker-mode upgrade of a containerised agent under live pod traffic (issue 6, "Must show").

The host's agent runs as a container (privileged, host network, the host's /sys/fs/bpf,
/run/netns, /lib/modules, /usr/src bind-mounted, and the stack's run directory — its
``/var/run/cilia`` — bound at the same path so the conflist's socket path is valid on the host).
Redis and the operator come from ``scripts/stack.sh up redis operator``. Two pods are plumbed by
the real ``cilia-cni`` on the host talking to the containerised agent's socket, and exchange a
continuous UDP request/echo stream (one datagram every 10 ms, both directions). Then:

1. ``cilia-safe-agent-updater --mode docker`` upgrades image A → B (B = A with another label):
   exit 0, the container runs B;
2. a broken image C (entrypoint ``false``) is rolled back automatically: exit 22, B runs again;
3. not one datagram of the stream was lost over the whole run, and a new pod still gets an IP.

The fixed-port stack must be free (the stack's ports are fixed by the team brief): the test
waits for it and stops its own redis/operator afterwards. It drives Docker only through the
``docker`` CLI and the project's ``.venv`` binaries, so the e2e tox env needs nothing else.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

import cnirun  # noqa: E402

pytestmark = [pytest.mark.privileged, pytest.mark.e2e]

CONTAINER = "cilia-e2e-upgrade-agent"
NETNS_PREFIX = "cilia-e2e-upg-"
IMAGE_BASE = "cilia-agent:e2e-upgrade"
IMAGES = {
    "A": ("cilia-agent:e2e-upgrade-a", ['LABEL io.cilia.e2e.build="a"']),
    "B": ("cilia-agent:e2e-upgrade-b", ['LABEL io.cilia.e2e.build="b"']),
    "C": ("cilia-agent:e2e-upgrade-c", ['ENTRYPOINT ["false"]']),
}
FIXED_PORTS = (6390, 4250, 9962, 9963, 4244, 4245, 4222)
STACK_FREE_WAIT_SECONDS = float(os.environ.get("CILIA_E2E_STACK_WAIT", "120"))
AGENT_START_SECONDS = 120.0
UPDATER = cnirun.VENV_BIN / "cilia-safe-agent-updater"
STREAM_PORT = 7811

ECHO = """
import socket, sys
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.bind(("0.0.0.0", int(sys.argv[1])))
print("listening", flush=True)
while True:
    data, peer = s.recvfrom(64)
    s.sendto(data, peer)
"""

# Sends one datagram (its sequence number) every interval until SIGTERM, then waits up to
# 2 s for the outstanding echoes and prints {"sent", "received", "missing"} as JSON.
STREAM = """
import json, select, signal, socket, sys, time
target, port, interval = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.connect((target, port))
stop = False
def on_term(*_):
    global stop
    stop = True
signal.signal(signal.SIGTERM, on_term)
sent, got = 0, set()
next_at = time.monotonic()
def drain(timeout):
    r, _, _ = select.select([s], [], [], timeout)
    while r:
        try:
            got.add(int(s.recv(64)))
        except (ConnectionRefusedError, ValueError):
            pass
        r, _, _ = select.select([s], [], [], 0)
print("streaming", flush=True)
while not stop:
    try:
        s.send(str(sent).encode())
    except ConnectionRefusedError:
        pass
    sent += 1
    next_at += interval
    drain(max(0.0, next_at - time.monotonic()))
end = time.monotonic() + 2.0
while len(got) < sent and time.monotonic() < end:
    drain(0.1)
print(json.dumps({"sent": sent, "received": len(got),
                  "missing": sorted(set(range(sent)) - got)[:50]}), flush=True)
"""


def _docker(
    *argv: str, check: bool = True, timeout: float = 120.0
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["docker", *argv],
        capture_output=True,
        text=True,
        check=check,
        timeout=timeout,
        env={**os.environ, "DOCKER_BUILDKIT": "0"},
    )


def _port_busy(port: int) -> bool:
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return True
    return False


def _stack_free() -> bool:
    if any(cnirun.component_pid(c) for c in ("redis", "operator", "agent", "relay")):
        return False
    return not any(_port_busy(p) for p in FIXED_PORTS)


def _require() -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root: network namespaces, veth, BPF, a Docker engine")
    if shutil.which("docker") is None:
        pytest.fail("docker CLI missing: apt-get install docker.io (scripts/setup.sh)")
    if _docker("info", check=False, timeout=30).returncode != 0:
        pytest.fail("Docker engine not running: start dockerd (scripts/setup.sh / .ci/run)")
    if not UPDATER.exists():
        pytest.fail(f"{UPDATER} missing: run scripts/setup.sh")


def _build_images() -> dict[str, str]:
    """Build the agent image with helper G's builder, then derive A, B and C; return ids."""
    build = subprocess.run(
        [
            str(cnirun.VENV_BIN / "python"),
            str(ROOT / "scripts" / "images.py"),
            "--quiet",
            "--tag",
            IMAGE_BASE,
            "agent",
        ],
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert build.returncode == 0, build.stderr[-3000:]
    ids = {}
    for key, (tag, lines) in IMAGES.items():
        dockerfile = "\n".join([f"FROM {IMAGE_BASE}", *lines]) + "\n"
        out = subprocess.run(
            ["docker", "build", "-q", "-t", tag, "-"],
            input=dockerfile,
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
            env={**os.environ, "DOCKER_BUILDKIT": "0"},
        )
        assert out.returncode == 0, out.stderr
        ids[key] = _docker("image", "inspect", "-f", "{{.Id}}", tag).stdout.strip()
    return ids


def _ensure_bpffs() -> None:
    mounts = pathlib.Path("/proc/mounts").read_text()
    if not any(line.split()[1:3] == ["/sys/fs/bpf", "bpf"] for line in mounts.splitlines()):
        subprocess.run(["mount", "-t", "bpf", "bpf", "/sys/fs/bpf"], check=True)


def _privilege_flags(image: str) -> list[str]:
    """``--privileged``, or where the engine cannot grant it, the same minus what it lacks.

    A Docker engine that itself runs in a container without CAP_SYS_RESOURCE in its bounding
    set (as on the project's sandboxed machines) fails every ``--privileged`` container with
    "unable to apply caps"; then all other capabilities, no seccomp/AppArmor profile and
    unmasked, writable /proc/sys give the agent what it uses (bpf, netlink, iptables, setns,
    sysctls).
    """
    probe = _docker("run", "--rm", "--privileged", "--entrypoint", "true", image, check=False)
    if probe.returncode == 0:
        return ["--privileged"]
    return [
        "--cap-add", "ALL", "--cap-drop", "SYS_RESOURCE",
        "--security-opt", "seccomp=unconfined", "--security-opt", "apparmor=unconfined",
        "--security-opt", "systempaths=unconfined",
    ]  # fmt: skip


def _run_agent(image: str) -> None:
    run = cnirun.RUN
    out = _docker(
        "run",
        "-d",
        "--name",
        CONTAINER,
        *_privilege_flags(image),
        "--network",
        "host",
        "--restart",
        "unless-stopped",
        "-v",
        "/sys/fs/bpf:/sys/fs/bpf:rw",
        "-v",
        "/run/netns:/run/netns:rw,rslave",
        "-v",
        "/lib/modules:/lib/modules:ro",
        "-v",
        "/usr/src:/usr/src:ro",
        "-v",
        f"{run}:{run}:rw",
        image,
        "serve",
        "--node-name",
        socket.gethostname(),
        "--operator",
        "127.0.0.1:4250",
        "--state-dir",
        f"{run}/agent/state",
        "--socket",
        str(cnirun.AGENT_SOCKET),
        "--cni-conf-dir",
        str(cnirun.CONFLIST.parent),
        "--cni-conf-name",
        cnirun.CONFLIST.name,
        "--prometheus-serve-addr",
        ":9962",
        "--log-level",
        "info",
        check=False,
    )
    assert out.returncode == 0, out.stderr


def _container_image() -> str:
    return _docker("inspect", "-f", "{{.Image}}", CONTAINER).stdout.strip()


def _agent_logs() -> str:
    out = _docker("logs", "--tail", "60", CONTAINER, check=False)
    return out.stdout[-4000:] + out.stderr[-4000:]


def _updater(image: str, health_timeout: int) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            str(UPDATER),
            "--mode",
            "docker",
            "--container",
            CONTAINER,
            "--image",
            image,
            "--agent-health-address",
            f"unix:{cnirun.AGENT_SOCKET}",
            "--health-timeout",
            str(health_timeout),
            "--health-interval",
            "0.5",
            "--stop-timeout",
            "10",
            "--redis",
            "redis://127.0.0.1:6390/0",
            "--lock-name",
            "cilia:e2e:safe-agent-updater",
        ],
        capture_output=True,
        text=True,
        timeout=health_timeout * 3 + 120,
        check=False,
    )


def _agent_healthy() -> bool:
    return cnirun.agent_cli("status", "--timeout", "2", timeout=15).returncode == 0


@pytest.fixture
def containerised_host() -> Iterator[dict[str, str]]:
    """Redis + operator from the stack, the agent as a container from image A; image ids."""
    _require()
    _docker("rm", "-f", CONTAINER, f"{CONTAINER}-previous", check=False)
    for name in cnirun.list_netns(NETNS_PREFIX):
        cnirun.delete_netns(name)
    images = _build_images()
    # Other e2e runs share the fixed ports: wait until the stack is free, then start our
    # redis + operator; another run may win the race between the check and `up`, so retry.
    deadline = time.monotonic() + STACK_FREE_WAIT_SECONDS
    while True:
        up = None
        if _stack_free():
            up = cnirun.stack("up", "--fresh", "redis", "operator", check=False)
            if up.returncode == 0:
                break
            if "needs a stopped stack" not in up.stderr:
                cnirun.stack("down", check=False)
                pytest.fail(f"scripts/stack.sh up redis operator failed:\n{up.stderr}")
        if time.monotonic() > deadline:
            pytest.fail(
                f"the fixed-port stack stayed busy for {STACK_FREE_WAIT_SECONDS:g} s "
                "(another e2e run?)"
            )
        time.sleep(2.0)
    try:
        _ensure_bpffs()
        cnirun.create_netns(f"{NETNS_PREFIX}keep")  # /run/netns exists, shared, before binding
        with contextlib.suppress(FileNotFoundError):
            cnirun.CONFLIST.unlink()
        _run_agent(IMAGES["A"][0])
        if not cnirun.wait_for(
            lambda: cnirun.CONFLIST.exists() and _agent_healthy(), AGENT_START_SECONDS, interval=0.5
        ):
            pytest.fail(f"containerised agent not ready:\n{_agent_logs()}")
        yield images
    finally:
        _docker("rm", "-f", CONTAINER, f"{CONTAINER}-previous", check=False)
        for name in cnirun.list_netns(NETNS_PREFIX):
            cnirun.delete_netns(name)
        cnirun.stack("down", check=False)


def _netns_python(netns: str, code: str, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        ["ip", "netns", "exec", netns, sys.executable, "-c", code, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.mark.timeout(600)
def test_upgrade_a_to_b_then_broken_c_rolls_back_without_losing_a_packet(
    containerised_host: dict[str, str],
) -> None:
    images = containerised_host
    assert _container_image() == images["A"]
    conflist = cnirun.load_conflist()
    pods = [cnirun.Pod(name=f"{NETNS_PREFIX}{i}") for i in (1, 2)]
    server = client = None
    try:
        for pod in pods:
            pod.create_netns()
            pod.add(conflist, timeout=60).check()
        server = _netns_python(pods[1].name, ECHO, str(STREAM_PORT))
        assert server.stdout is not None and server.stdout.readline().strip() == "listening"
        client = _netns_python(pods[0].name, STREAM, pods[1].ip, str(STREAM_PORT), "0.01")
        assert client.stdout is not None and client.stdout.readline().strip() == "streaming"
        time.sleep(1.0)  # traffic flowing before the first replacement

        upgrade = _updater(IMAGES["B"][0], health_timeout=120)
        assert upgrade.returncode == 0, upgrade.stderr[-4000:] + _agent_logs()
        assert _container_image() == images["B"]
        assert '"step": "AgentUpdated"' in upgrade.stderr

        broken = _updater(IMAGES["C"][0], health_timeout=15)
        assert broken.returncode == 22, broken.stderr[-4000:] + _agent_logs()
        assert '"step": "AgentRolledBack"' in broken.stderr
        assert _container_image() == images["B"]
        assert _agent_healthy()
        time.sleep(1.0)  # traffic after the rollback too

        client.send_signal(signal.SIGTERM)
        out, _err = client.communicate(timeout=30)
        stats = json.loads(out.strip().splitlines()[-1])
        assert stats["sent"] > 500, stats
        assert stats["missing"] == [] and stats["received"] == stats["sent"], stats

        late = cnirun.Pod(name=f"{NETNS_PREFIX}3")
        late.create_netns()
        pods.append(late)
        late.add(cnirun.load_conflist(), timeout=60).check()
        assert cnirun.ping(late.name, pods[1].ip, count=2)
    finally:
        for proc in (client, server):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()
        with contextlib.suppress(Exception):
            conf = cnirun.load_conflist()
            for pod in pods:
                pod.delete(conf, timeout=30)
