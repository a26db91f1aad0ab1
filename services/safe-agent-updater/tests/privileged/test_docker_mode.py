"""Docker mode against the real Docker engine with locally built images.

The "agent" is the updater's own image running ``serve`` (a real grpc.health.v1 server) on a
unix socket in a bind-mounted directory, with host networking and a restart policy, as the
agent container runs in deploy/compose. Image A and B differ only by a label; image C has an
entrypoint that exits at once. The base image comes from scripts/images.py (helper G's
builder); A/B/C are two-line derivations of it.
"""

from __future__ import annotations

import contextlib
import io
import pathlib
import secrets
import subprocess
import sys
import time
from collections.abc import Iterator

import docker
import docker.errors
import pytest
import redis

from cilia_safe_agent_updater import health
from cilia_safe_agent_updater.__main__ import main
from cilia_safe_agent_updater.exitcodes import Exit
from cilia_testkit import procs, skips
from cilia_testkit.redis import RedisServer

pytestmark = pytest.mark.privileged

ROOT = pathlib.Path(__file__).resolve().parents[4]
BASE_TAG = "cilia-sau-test:base"
SOCKET_DIR = "/run/sau-test"


@pytest.fixture(scope="module")
def engine() -> Iterator[docker.DockerClient]:
    skips.require_docker()
    client = docker.from_env(version="auto", timeout=600)
    client.ping()
    yield client
    client.close()


def _derive(client: docker.DockerClient, base: str, tag: str, lines: list[str]) -> str:
    dockerfile = "\n".join([f"FROM {base}", *lines]) + "\n"
    image, _ = client.images.build(fileobj=io.BytesIO(dockerfile.encode()), tag=tag, rm=True)
    return str(image.id)


@pytest.fixture(scope="module")
def images(engine: docker.DockerClient) -> dict[str, str]:
    """Image ids of A, B (A + another label) and C (entrypoint exits)."""
    # The project's image builder (scripts/images.py) as a user runs it; the host wheels it
    # builds are cached by a digest of their sources, so an unchanged tree rebuilds nothing.
    built = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "images.py"), "safe-agent-updater",
         "--tag", BASE_TAG, "--quiet", "--jobs", "1"],
        capture_output=True, text=True, timeout=1800, check=False,
    )  # fmt: skip
    assert built.returncode == 0, built.stdout + built.stderr
    base = str(engine.images.get(BASE_TAG).id)
    return {
        "A": _derive(engine, base, "cilia-sau-test:a", ['LABEL io.cilia.test.build="a"']),
        "B": _derive(engine, base, "cilia-sau-test:b", ['LABEL io.cilia.test.build="b"']),
        "C": _derive(engine, base, "cilia-sau-test:c", ['ENTRYPOINT ["false"]']),
    }


@pytest.fixture
def agent(
    engine: docker.DockerClient, images: dict[str, str], tmp_path: pathlib.Path
) -> Iterator[tuple[str, str]]:
    """A running "agent" container from image A; yields (container name, health address)."""
    name = f"sau-test-{secrets.token_hex(3)}"
    sockdir = tmp_path / "sock"
    sockdir.mkdir()
    sockdir.chmod(0o777)  # the image runs as 65532
    address = f"unix:{sockdir}/health.sock"
    engine.containers.run(
        "cilia-sau-test:a",
        command=["serve", "--health-listen-address", f"unix:{SOCKET_DIR}/health.sock"],
        name=name,
        detach=True,
        network_mode="host",
        volumes={str(sockdir): {"bind": SOCKET_DIR, "mode": "rw"}},
        environment={"CILIA_TEST_ENV": "kept"},
        labels={"io.cilia.test.owner": "sau"},
        restart_policy={"Name": "unless-stopped"},
    )
    assert health.wait_serving(address, attempts=100, interval=0.2, rpc_timeout=1.0)
    yield name, address
    for n in (name, f"{name}-previous"):
        with contextlib.suppress(docker.errors.NotFound):
            engine.containers.get(n).remove(force=True)


@contextlib.contextmanager
def _redis_server(directory: pathlib.Path, *extra: str) -> Iterator[int]:
    """A private redis-server on a TCP port it owns (``extra``: more server flags); its port."""
    skips.require_binary("redis-server")
    with RedisServer(directory, tcp=True, args=extra) as server:
        assert server.port is not None
        yield server.port


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with _redis_server(tmp_path_factory.mktemp("redis")) as port:
        yield f"redis://127.0.0.1:{port}/0"


def _update(name: str, address: str, image: str, *extra: str) -> int:
    return main(
        [
            "--mode",
            "docker",
            "--container",
            name,
            "--image",
            image,
            "--agent-health-address",
            address,
            "--health-interval",
            "0.2",
            "--stop-timeout",
            "2",
            *extra,
        ]
    )


def test_same_image_is_a_noop(engine: docker.DockerClient, agent: tuple[str, str]) -> None:
    name, address = agent
    before = engine.containers.get(name).id
    assert _update(name, address, "cilia-sau-test:a") == Exit.OK
    assert engine.containers.get(name).id == before


def test_upgrade_keeps_configuration_and_health(
    engine: docker.DockerClient, agent: tuple[str, str], images: dict[str, str], redis_url: str
) -> None:
    name, address = agent
    old = engine.containers.get(name)
    assert (
        _update(name, address, "cilia-sau-test:b", "--redis", redis_url, "--lock-name", name)
        == Exit.OK
    )
    new = engine.containers.get(name)
    assert new.id != old.id
    assert new.attrs["Image"] == images["B"]
    assert new.status == "running"
    assert new.attrs["HostConfig"]["NetworkMode"] == "host"
    assert new.attrs["HostConfig"]["Binds"] == old.attrs["HostConfig"]["Binds"]
    assert new.attrs["HostConfig"]["RestartPolicy"]["Name"] == "unless-stopped"
    assert "CILIA_TEST_ENV=kept" in new.attrs["Config"]["Env"]
    assert new.attrs["Config"]["Cmd"] == old.attrs["Config"]["Cmd"]
    labels = new.attrs["Config"]["Labels"]
    assert labels["io.cilia.test.owner"] == "sau"
    assert labels["io.cilia.test.build"] == "b"  # the new image's label, not A's
    assert health.check(address, 1.0)
    with pytest.raises(docker.errors.NotFound):
        engine.containers.get(f"{name}-previous")
    assert redis.Redis.from_url(redis_url).exists(name) == 0  # lock released


def test_broken_image_is_rolled_back(
    engine: docker.DockerClient, agent: tuple[str, str], images: dict[str, str]
) -> None:
    name, address = agent
    code = _update(name, address, "cilia-sau-test:c", "--health-timeout", "3")
    assert code == Exit.ROLLED_BACK
    restored = engine.containers.get(name)
    assert restored.attrs["Image"] == images["A"]
    assert restored.status == "running"
    assert health.check(address, 1.0)
    names = {c.name for c in engine.containers.list(all=True)}
    assert f"{name}-previous" not in names
    assert not [c for c in engine.containers.list(all=True) if c.attrs["Image"] == images["C"]]


def test_lock_held_elsewhere_leaves_the_container_alone(
    engine: docker.DockerClient, agent: tuple[str, str], redis_url: str
) -> None:
    name, address = agent
    before = engine.containers.get(name).id
    other = redis.Redis.from_url(redis_url).lock(name, timeout=30)
    assert other.acquire(blocking=False)
    try:
        code = _update(
            name,
            address,
            "cilia-sau-test:b",
            "--redis",
            redis_url,
            "--lock-name",
            name,
            "--lock-wait-timeout",
            "0.5",
        )
    finally:
        other.release()
    assert code == Exit.LOCK_TIMEOUT
    assert engine.containers.get(name).id == before


def test_unavailable_image_and_missing_container(
    engine: docker.DockerClient, agent: tuple[str, str]
) -> None:
    name, address = agent
    before = engine.containers.get(name).id
    # A registry on a closed local port: the engine's pull fails at once, never leaves the host.
    missing = f"127.0.0.1:9/cilia-sau-test:missing-{secrets.token_hex(3)}"
    assert _update(name, address, missing) == Exit.IMAGE_UNAVAILABLE
    assert engine.containers.get(name).id == before
    assert _update(f"{name}-nope", address, "cilia-sau-test:b") == Exit.CONTAINER_NOT_FOUND


def test_docker_mode_requires_image() -> None:
    assert main(["--mode", "docker", "--image", ""]) == Exit.USAGE


def test_interrupted_update_is_recovered(
    engine: docker.DockerClient, agent: tuple[str, str], images: dict[str, str]
) -> None:
    """Only ``<name>-previous`` exists (updater killed after the rename): it comes back."""
    name, address = agent
    container = engine.containers.get(name)
    container.stop(timeout=2)
    container.rename(f"{name}-previous")
    assert _update(name, address, "cilia-sau-test:a") == Exit.OK
    restored = engine.containers.get(name)
    assert restored.id == container.id
    assert restored.status == "running"
    # the replacement container starts on a loaded 2-core host: give it 30 s, not 10
    assert health.wait_serving(address, attempts=150, interval=0.2, rpc_timeout=1.0)


def test_pull_always_falls_back_to_the_local_image(
    engine: docker.DockerClient, agent: tuple[str, str], images: dict[str, str]
) -> None:
    """No registry here: ``--pull-policy always`` tolerates a failed pull of a local image."""
    name, address = agent
    local_ref = "127.0.0.1:9/cilia-sau-test:b"  # closed local port: the pull fails at once
    engine.images.get(images["B"]).tag(local_ref)
    try:
        assert _update(name, address, local_ref, "--pull-policy", "always") == Exit.OK
        assert engine.containers.get(name).attrs["Image"] == images["B"]
    finally:
        engine.images.remove(local_ref)


def _image_of(engine: docker.DockerClient, name: str) -> str | None:
    """The image id of container ``name``; None while no container holds the name (between
    the updater's rename of the old one and the creation of its replacement)."""
    try:
        return str(engine.containers.get(name).attrs["Image"])
    except docker.errors.NotFound:
        return None


def test_loop_mode_applies_the_image_on_its_own(
    engine: docker.DockerClient,
    agent: tuple[str, str],
    images: dict[str, str],
    tmp_path: pathlib.Path,
) -> None:
    name, address = agent
    # the log goes to a file: a pipe nobody reads while polling would fill and block it
    log_path = tmp_path / "updater.log"
    with log_path.open("w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "cilia_safe_agent_updater", "--mode", "docker",
             "--container", name, "--image", "cilia-sau-test:b", "--agent-health-address",
             address, "--health-interval", "0.2", "--stop-timeout", "2", "--interval", "0.5"],
            stdout=subprocess.DEVNULL, stderr=log,
        )  # fmt: skip
        try:
            deadline = time.monotonic() + 120
            while _image_of(engine, name) != images["B"]:
                assert proc.poll() is None, log_path.read_text()[-3000:]
                assert time.monotonic() < deadline, "loop mode never replaced the container"
                time.sleep(0.5)
            assert proc.poll() is None  # still looping after a successful pass
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    # the replacement container starts on a loaded 2-core host: give it 30 s, not 10
    assert health.wait_serving(address, attempts=150, interval=0.2, rpc_timeout=1.0)


def test_loop_mode_does_not_retry_a_rolled_back_image(
    engine: docker.DockerClient,
    agent: tuple[str, str],
    images: dict[str, str],
    tmp_path: pathlib.Path,
) -> None:
    name, address = agent
    log_path = tmp_path / "updater.log"
    with log_path.open("w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "cilia_safe_agent_updater", "--mode", "docker",
             "--container", name, "--image", "cilia-sau-test:c", "--agent-health-address",
             address, "--health-interval", "0.2", "--health-timeout", "2",
             "--stop-timeout", "2", "--interval", "0.2"],
            stdout=subprocess.DEVNULL, stderr=log,
        )  # fmt: skip
        try:
            deadline = time.monotonic() + 120
            while log_path.read_text().count('"step": "ImageSkipped"') < 2:
                assert proc.poll() is None, log_path.read_text()[-3000:]
                assert time.monotonic() < deadline, "no ImageSkipped step"
                time.sleep(0.2)
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    text = log_path.read_text()
    assert text.count('"step": "AgentRolledBack"') == 1
    assert text.count('"step": "AgentStarted"') == 1
    assert engine.containers.get(name).attrs["Image"] == images["A"]
    # the replacement container starts on a loaded 2-core host: give it 30 s, not 10
    assert health.wait_serving(address, attempts=150, interval=0.2, rpc_timeout=1.0)


SECRET = "s3cr3tPW"


def _updater(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "cilia_safe_agent_updater", "--mode", "docker", *argv],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_redis_password_never_printed_when_redis_refuses_or_rejects_it(
    engine: docker.DockerClient, tmp_path: pathlib.Path
) -> None:
    """Connection refused and a wrong password (a real redis-server with requirepass): exit 3,
    the message names the redacted URL, the password appears nowhere in stdout/stderr."""
    with procs.refused_address() as address:  # held bound, never listening: refused
        closed = int(address.rsplit(":", 1)[1])
        refused = _updater("--image", "cilia-sau-test:b", "--container", "sau-nonexistent",
                           "--redis", f"redis://admin:{SECRET}@127.0.0.1:{closed}/0")  # fmt: skip
    with _redis_server(tmp_path, "--requirepass", "the-right-one") as port:
        rejected = _updater("--image", "cilia-sau-test:b", "--container", "sau-nonexistent",
                            "--redis", f"redis://admin:{SECRET}@127.0.0.1:{port}/0",
                            "--lock-wait-timeout", "1")  # fmt: skip
        rejected_default_user = _updater(
            "--image", "cilia-sau-test:b", "--container", "sau-nonexistent",
            "--redis", f"redis://:{SECRET}@127.0.0.1:{port}/0", "--lock-wait-timeout", "1",
        )  # fmt: skip
    for got, port_shown in (
        (refused, closed),
        (rejected, port),
        (rejected_default_user, port),
    ):
        assert got.returncode == Exit.API_UNAVAILABLE, got.stderr
        assert SECRET not in got.stdout + got.stderr, got.stderr
        assert "--redis redis://" in got.stderr and f":***@127.0.0.1:{port_shown}/0" in got.stderr
        assert '"exit_code": 3' in got.stderr  # the JSON log line, redacted too
