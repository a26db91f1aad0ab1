"""Every service image: built by scripts/images.py, started, ``--version``, health check.

Real Docker engine (Debian's docker.io, started by scripts/setup.sh), no registry: the base
image is built with debootstrap when missing. The stack test runs Redis, the operator, the
agent (its eBPF datapath loaded inside the container), the relay and the updater's health
server on a private bridge network and waits until Docker reports every HEALTHCHECK healthy.

Privileged (root, a Docker engine). The engine cannot grant --privileged on this kind of
machine (CAP_SYS_RESOURCE is missing from the bounding set), so the agent gets explicit
capabilities, as deploy/compose does.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from scripts import images

ROOT = Path(__file__).resolve().parents[2]

docker = pytest.importorskip("docker")

pytestmark = [pytest.mark.privileged, pytest.mark.timeout(1500)]

#: Capabilities of the agent container (instead of --privileged, see the module docstring).
AGENT_CAPS = ["NET_ADMIN", "SYS_ADMIN", "NET_RAW", "SYS_MODULE"]
AGENT_SECURITY = ["seccomp=unconfined", "apparmor=unconfined"]
#: Seconds the stack gets until every container is healthy (a deadline, not an assertion).
HEALTH_DEADLINE = 180.0


@pytest.fixture(scope="module")
def client() -> Any:
    if os.geteuid() != 0:
        pytest.skip("needs root (Docker engine, debootstrap)")
    return images.docker_client()


@pytest.fixture(scope="module")
def built(client: Any) -> dict[str, str]:
    """Build every image once per session (the engine's layer cache makes reruns cheap)."""
    return images.build_all(progress=lambda m: print(f"[images] {m}", flush=True))


def _run(client: Any, image: str, *args: str, **kw: Any) -> str:
    out = client.containers.run(image, list(args), remove=True, stdout=True, stderr=True, **kw)
    return out.decode() if isinstance(out, bytes) else str(out)


def test_every_image_is_labelled_and_tagged(client: Any, built: dict[str, str]) -> None:
    for name, image_id in built.items():
        img = client.images.get(image_id)
        labels = img.labels
        assert labels["org.opencontainers.image.title"] == f"cilia-{name}"
        assert re.fullmatch(r"[0-9a-f]{40}|unknown", labels["org.opencontainers.image.revision"])
        expected = images.service_version(name) if name in images.SERVICES else "bookworm"
        assert labels["org.opencontainers.image.version"] == expected
        assert f"cilia-{name}:{expected}" in img.tags
        assert any(t.startswith(f"cilia-{name}:git-") for t in img.tags)


@pytest.mark.parametrize("service", ["operator", "relay", "safe-agent-updater"])
def test_non_root_where_the_service_allows(
    client: Any, built: dict[str, str], service: str
) -> None:
    assert client.images.get(built[service]).attrs["Config"]["User"] == "65532:65532"
    assert _run(client, built[service], "-c", "id -u", entrypoint="sh").strip() == "65532"


@pytest.mark.parametrize("service", ["operator", "agent", "relay", "safe-agent-updater"])
def test_version(client: Any, built: dict[str, str], service: str) -> None:
    out = _run(client, built[service], "--version")
    assert out.strip() == f"cilia-{service} {images.service_version(service)}"


def test_cni_image_answers_version_command(client: Any, built: dict[str, str]) -> None:
    reply = json.loads(_run(client, built["cni"]))
    assert "1.0.0" in reply["supportedVersions"]
    version = _run(
        client,
        built["cni"],
        "-c",
        "import importlib.metadata as m; print(m.version('cilia-cni'))",
        entrypoint="python",
    )
    assert version.strip() == images.service_version("cni")


def test_cni_installer_puts_a_working_plugin_on_the_host(
    client: Any, built: dict[str, str], tmp_path: Path
) -> None:
    """cilia-cni-install copies the frozen bundle + a wrapper; the HOST then execs the plugin
    with an empty environment (no PATH: no host python3 involved)."""
    host = tmp_path / "opt-cni"
    kw = {
        "entrypoint": "cilia-cni-install",
        "volumes": {str(host): {"bind": "/host/opt/cni", "mode": "rw"}},
        "environment": {"CILIA_CNI_HOST_LIB_DIR": str(host / "cilia")},
    }
    _run(client, built["cni"], **kw)
    _run(client, built["cni"], **kw)  # idempotent: the same copy is reused
    copies = [p for p in (host / "cilia").iterdir() if not p.name.startswith(".")]
    assert len(copies) == 1, copies
    assert not list((host / "bin").glob(".cilia-cni*")), "temporary file left behind"
    plugin = host / "bin" / "cilia-cni"
    res = subprocess.run(
        [str(plugin)], env={"CNI_COMMAND": "VERSION"}, capture_output=True, text=True, input=""
    )
    assert res.returncode == 0, res.stderr
    assert "1.1.0" in json.loads(res.stdout)["supportedVersions"]


@pytest.fixture
def stack(client: Any, built: dict[str, str]) -> Iterator[dict[str, Any]]:
    """Redis, operator, agent, relay and the updater on a private bridge network."""
    tag = f"cilia-imgtest-{uuid.uuid4().hex[:8]}"
    net = client.networks.create(tag, driver="bridge")
    state = client.volumes.create(f"{tag}-run")
    containers: dict[str, Any] = {}
    common = {"detach": True, "network": tag, "labels": {"io.cilia.test": tag}}
    try:
        containers["redis"] = client.containers.run(
            built["redis"], name=f"{tag}-redis", hostname="redis", **common
        )
        containers["operator"] = client.containers.run(
            built["operator"],
            [
                "serve",
                f"--store=redis://{tag}-redis:6379/0",
                "--listen=0.0.0.0:4250",
                "--disable-tls",  # a private test network; mTLS is tested in test_mtls.py
                "--auto-create-cilium-pod-ip-pools=default=ipv4-cidrs:10.77.0.0/16;ipv4-mask-size:24",
            ],
            name=f"{tag}-operator",
            # the image's health check follows the plaintext server here (its default is
            # the health-only listener of the TLS command line)
            environment={"CILIA_HEALTH_ADDRESS": "127.0.0.1:4250"},
            **common,
        )
        containers["agent"] = client.containers.run(
            built["agent"],
            [
                "serve",
                f"--operator={tag}-operator:4250",
                "--state-dir=/var/run/cilia/state",
                "--socket=/var/run/cilia/cilia.sock",
                "--cni-conf-dir=/tmp/cni",
                "--prometheus-serve-addr=",
                "--hubble-listen-address=",
                f"--bpf-pin-dir=/sys/fs/bpf/{tag}",
                f"--node-name={tag}-node",
            ],
            name=f"{tag}-agent",
            cap_add=AGENT_CAPS,
            security_opt=AGENT_SECURITY,
            volumes={
                "/lib/modules": {"bind": "/lib/modules", "mode": "ro"},
                state.name: {"bind": "/var/run/cilia", "mode": "rw"},
            },
            **common,
        )
        containers["relay"] = client.containers.run(
            built["relay"],
            ["serve", "--peer-service=unix:/var/run/cilia/hubble.sock"],
            name=f"{tag}-relay",
            user="0:0",  # the agent's sockets are 0600 root
            volumes={state.name: {"bind": "/var/run/cilia", "mode": "ro"}},
            **common,
        )
        containers["safe-agent-updater"] = client.containers.run(
            built["safe-agent-updater"], name=f"{tag}-updater", **common
        )
        yield containers
    finally:
        for c in containers.values():
            with contextlib.suppress(docker.errors.APIError):
                c.remove(force=True, v=True)
        state.remove(force=True)
        net.remove()


def test_stack_reaches_healthy(stack: dict[str, Any]) -> None:
    """Each image's own HEALTHCHECK (gRPC health, `cilia-agent status`, redis-cli ping)."""
    deadline = time.monotonic() + HEALTH_DEADLINE
    status: dict[str, str] = {}
    while time.monotonic() < deadline:
        for name, c in stack.items():
            c.reload()
            if c.status == "exited":
                pytest.fail(f"{name} exited:\n{c.logs(tail=30).decode()}")
            status[name] = c.attrs["State"].get("Health", {}).get("Status", "none")
        if all(s == "healthy" for s in status.values()):
            break
        time.sleep(2)
    unhealthy = {n: s for n, s in status.items() if s != "healthy"}
    detail = "\n".join(
        f"--- {n}: {stack[n].attrs['State'].get('Health', {}).get('Log', [])[-1:]}\n"
        f"{stack[n].logs(tail=15).decode()}"
        for n in unhealthy
    )
    assert not unhealthy, f"not healthy after {HEALTH_DEADLINE:.0f} s: {unhealthy}\n{detail}"
    # the agent registered with the operator through the network (its status says ready)
    code, out = stack["agent"].exec_run(["cilia-agent", "status"])
    assert code == 0, out.decode()
