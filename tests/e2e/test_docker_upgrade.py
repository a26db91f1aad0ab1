"""Docker-mode upgrade of a containerised agent under live pod traffic (issue 6, "Must show").

The agent runs as a container (privileged — see :func:`_privilege_flags` — host network, the
host's /sys/fs/bpf, /run/netns, /lib/modules, /usr/src bind-mounted, and its run directory —
what /var/run/cilia is in production — bound at the same path so the conflist's socket path is
valid on the host). The test starts its own redis-server and cilia-operator through
:class:`cilia_testkit.stack.Stack` (redis on a unix socket, the operator on a port it binds
itself; nothing shared with the e2e session's stack or a ``make up`` one) and gives the agent private names: node ``upg-<tag>``, host device ``cilia_u<tag>``, bpffs pin
dir ``/sys/fs/bpf/cilia-upg-<tag>``, pool ``10.231.<n>.0/24``, no metrics/Hubble TCP ports.
Two pods are plumbed by the real ``cilia-cni`` on the host talking to the containerised
agent's socket, and exchange a continuous UDP request/echo stream (one datagram every 10 ms,
both directions). Then:

1. ``cilia-safe-agent-updater --mode docker`` upgrades image A → B (B = A with another label)
   under the Redis lock: exit 0, the container runs B;
2. a broken image C (entrypoint ``false``) is rolled back automatically: exit 22, B runs again;
3. not one datagram of the stream was lost over the whole run, and a new pod still gets an IP.

It drives Docker only through the ``docker`` CLI and the project's ``.venv`` binaries, so the
e2e tox env needs nothing else.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import pathlib
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator

import pytest

from cilia_testkit import ROOT, VENV_BIN, cni, netns
from cilia_testkit.host import wait_for
from cilia_testkit.stack import Stack

pytestmark = [pytest.mark.privileged, pytest.mark.e2e]

NETNS_PREFIX = "cilia-e2e-upg-"
IMAGE_BASE = "cilia-agent:e2e-upgrade"
IMAGES = {
    "A": ("cilia-agent:e2e-upgrade-a", ['LABEL io.cilia.e2e.build="a"']),
    "B": ("cilia-agent:e2e-upgrade-b", ['LABEL io.cilia.e2e.build="b"']),
    "C": ("cilia-agent:e2e-upgrade-c", ['ENTRYPOINT ["false"]']),
}
AGENT_START_SECONDS = 120.0
UPDATER = VENV_BIN / "cilia-safe-agent-updater"
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
def drain(until):
    while True:
        left = until - time.monotonic()
        r, _, _ = select.select([s], [], [], max(0.0, left))
        if r:
            try:
                got.add(int(s.recv(64)))
            except (ConnectionRefusedError, ValueError):
                pass
        elif left <= 0:
            return
print("streaming", flush=True)
while not stop:
    try:
        s.send(str(sent).encode())
    except ConnectionRefusedError:
        pass
    sent += 1
    next_at += interval
    drain(next_at)
end = time.monotonic() + 2.0
while len(got) < sent and time.monotonic() < end:
    drain(time.monotonic() + 0.1)
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
            str(VENV_BIN / "python"),
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


@dataclasses.dataclass
class Host:
    """The test's private control plane and agent names (see the module docstring)."""

    tag: str
    dir: pathlib.Path
    images: dict[str, str]
    #: the test kit stack's operator (``127.0.0.1:PORT`` it bound) and redis (unix socket)
    operator_address: str = ""
    redis_url: str = ""

    @property
    def container(self) -> str:
        return f"cilia-e2e-upg-agent-{self.tag}"

    @property
    def socket(self) -> pathlib.Path:
        return self.dir / "cilia.sock"

    @property
    def conflist(self) -> pathlib.Path:
        return self.dir / "net.d" / "05-cilia.conflist"

    @property
    def host_device(self) -> str:
        return f"cilia_u{self.tag}"

    @property
    def pin_dir(self) -> str:
        return f"/sys/fs/bpf/cilia-upg-{self.tag}"

    def agent_args(self) -> list[str]:
        return [
            "serve", "--node-name", f"upg-{self.tag}",
            "--operator", self.operator_address,
            "--state-dir", str(self.dir / "state"), "--socket", str(self.socket),
            "--cni-conf-dir", str(self.conflist.parent), "--cni-conf-name", self.conflist.name,
            "--host-device-name", self.host_device, "--bpf-pin-dir", self.pin_dir,
            "--prometheus-serve-addr", "", "--hubble-listen-address", "", "--log-level", "info",
            # host network: the host's nat table is every test's (and a kept chain would
            # outlive the test), so no masquerade chain here, as the Stack's agents
            "--enable-ipv4-masquerade=false",
        ]  # fmt: skip

    def run_agent(self, image: str) -> None:
        out = _docker(
            "run", "-d", "--name", self.container, *_privilege_flags(image),
            "--network", "host", "--restart", "unless-stopped",
            "-v", "/sys/fs/bpf:/sys/fs/bpf:rw",
            "-v", "/run/netns:/run/netns:rw,rslave",
            "-v", "/lib/modules:/lib/modules:ro",
            "-v", "/usr/src:/usr/src:ro",
            "-v", f"{self.dir}:{self.dir}:rw",
            image, *self.agent_args(),
            check=False,
        )  # fmt: skip
        assert out.returncode == 0, out.stderr

    def image(self) -> str:
        return _docker("inspect", "-f", "{{.Image}}", self.container).stdout.strip()

    def logs(self) -> str:
        out = _docker("logs", "--tail", "60", self.container, check=False)
        return out.stdout[-4000:] + out.stderr[-4000:]

    def healthy(self) -> bool:
        return (
            subprocess.run(
                [str(VENV_BIN / "cilia-agent"), "status", "--timeout", "2",
                 "--socket", str(self.socket)],
                capture_output=True, timeout=15, check=False,
            ).returncode
            == 0
        )  # fmt: skip

    def updater(self, image: str, health_timeout: int) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(UPDATER), "--mode", "docker", "--container", self.container, "--image", image,
             "--agent-health-address", f"unix:{self.socket}",
             "--health-timeout", str(health_timeout), "--health-interval", "0.5",
             "--stop-timeout", "10", "--redis", self.redis_url,
             "--lock-name", f"cilia:e2e:safe-agent-updater:{self.tag}"],
            capture_output=True, text=True, timeout=health_timeout * 3 + 120, check=False,
        )  # fmt: skip


@pytest.fixture
def containerised_host(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Host]:
    """Own redis + operator, the agent as a container from image A."""
    _require()
    tag = secrets.token_hex(3)
    host = Host(
        tag=tag,
        dir=pathlib.Path(tempfile.mkdtemp(prefix=f"cilia-upg-{tag}-", dir="/tmp")),
        images=_build_images(),
    )
    pool = f"10.231.{secrets.randbelow(250) + 1}.0/24"
    # redis (unix socket) + operator (port 0, read back) of the test kit; no agent process:
    # the agent runs as a container.
    control_plane = Stack("upg", pool_cidr=pool, mask_size=26, agents=0, relay=False)
    try:
        control_plane.start()
        host.operator_address = control_plane.operator_address
        host.redis_url = control_plane.redis_url
        _ensure_bpffs()
        netns.create_netns(f"{NETNS_PREFIX}{tag}-keep")  # /run/netns shared before binding
        host.run_agent(IMAGES["A"][0])
        if not wait_for(
            lambda: host.conflist.exists() and host.healthy(), AGENT_START_SECONDS, interval=0.5
        ):
            pytest.fail(f"containerised agent not ready:\n{host.logs()}")
        yield host
    finally:
        _docker("rm", "-f", host.container, f"{host.container}-previous", check=False)
        for name in netns.list_netns(f"{NETNS_PREFIX}{tag}"):
            netns.delete_netns(name)
        control_plane.stop()
        subprocess.run(["ip", "link", "del", host.host_device], capture_output=True, check=False)
        shutil.rmtree(host.pin_dir, ignore_errors=True)
        shutil.rmtree(host.dir, ignore_errors=True)


def _netns_python(netns: str, code: str, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        ["ip", "netns", "exec", netns, sys.executable, "-c", code, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.mark.timeout(600)
def test_upgrade_a_to_b_then_broken_c_rolls_back_without_losing_a_packet(
    containerised_host: Host,
) -> None:
    host = containerised_host
    images = host.images
    assert host.image() == images["A"]
    conflist = cni.load_conflist(host.conflist)
    pods = [cni.Pod(name=f"{NETNS_PREFIX}{host.tag}-{i}") for i in (1, 2)]
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

        upgrade = host.updater(IMAGES["B"][0], health_timeout=120)
        assert upgrade.returncode == 0, upgrade.stderr[-4000:] + host.logs()
        assert host.image() == images["B"]
        assert '"step": "AgentUpdated"' in upgrade.stderr

        broken = host.updater(IMAGES["C"][0], health_timeout=15)
        assert broken.returncode == 22, broken.stderr[-4000:] + host.logs()
        assert '"step": "AgentRolledBack"' in broken.stderr
        assert host.image() == images["B"]
        assert host.healthy()
        time.sleep(1.0)  # traffic after the rollback too

        client.send_signal(signal.SIGTERM)
        out, _err = client.communicate(timeout=30)
        stats = json.loads(out.strip().splitlines()[-1])
        print(f"UDP request/echo stream across A->B upgrade and C rollback: {stats}")
        assert stats["sent"] > 500, stats
        assert stats["missing"] == [] and stats["received"] == stats["sent"], stats

        late = cni.Pod(name=f"{NETNS_PREFIX}{host.tag}-3")
        late.create_netns()
        pods.append(late)
        late.add(cni.load_conflist(host.conflist), timeout=60).check()
        assert netns.ping(late.name, pods[1].ip, count=2)
    finally:
        for proc in (client, server):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()
        with contextlib.suppress(Exception):
            conf = cni.load_conflist(host.conflist)
            for pod in pods:
                pod.delete(conf, timeout=30)
