"""Docker mode: replace the agent container when the desired image differs, roll back on failure.

For hosts that run ``cilia-agent`` as a container (deploy/compose). One pass (``--interval 0``)
or a loop:

1. Take the Redis lock ``--lock-name`` (redis-py ``Lock``: SET NX PX with a token, released by
   a Lua compare-and-delete) so only one host updates at a time (``--redis``; without it, no
   lock). Not taken within ``--lock-wait-timeout`` → exit 18.
2. "Pull" the desired image through the Engine API (``--pull-policy``): ``if-not-present``
   (default) uses a local image and pulls only when missing; ``always`` pulls and falls back
   to the local image when the pull fails (no registry on this machine: locally built images
   are tolerated); ``never`` only looks. Not available → exit 21.
3. Compare the image id (``sha256:…``) with the running container's ``Image``: equal → done.
4. Replace: stop the old container (``--stop-timeout``), rename it ``<name>-previous``, create
   a new one from the old ``container.attrs`` (same name, HostConfig as is — binds/mounts,
   ``network_mode``, ``privileged``, restart policy, capabilities, pid mode — plus the user's
   part of Env, Labels, Cmd, Entrypoint, User, WorkingDir: values that equal the old image's
   defaults are left out so the new image's own defaults apply), start it.
5. Wait for gRPC health SERVING on ``--agent-health-address`` (``--health-timeout``). Healthy:
   remove the previous container, done. Not healthy: remove the new container, rename the
   previous back, start it, wait for health: exit 22 (rolled back) or 23 (rollback failed).
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass
from typing import Any

import docker
import docker.errors
import redis
from docker.models.containers import Container
from docker.models.images import Image

from cilia_safe_agent_updater import health
from cilia_safe_agent_updater.exitcodes import Exit, UpdaterError
from cilia_safe_agent_updater.redact import redact_url, scrub
from cilia_safe_agent_updater.steps import Reporter

log = logging.getLogger("cilia_safe_agent_updater.docker")

PREVIOUS_SUFFIX = "-previous"


@dataclass(frozen=True)
class DockerSettings:
    """Flags of ``--mode docker`` (defaults documented in README.md). Times in seconds."""

    image: str
    container: str = "cilia-agent"
    docker_url: str = ""
    pull_policy: str = "if-not-present"
    agent_health_address: str = "unix:/var/run/cilia/cilia.sock"
    health_timeout: float = 60.0
    health_interval: float = 1.0
    health_rpc_timeout: float = 2.0
    stop_timeout: int = 10
    redis_url: str = ""
    lock_name: str = "cilia:safe-agent-updater:lock"
    lock_ttl: float = 300.0
    lock_wait_timeout: float = 600.0
    docker_timeout: float = 120.0


def docker_client(settings: DockerSettings) -> docker.DockerClient:
    """Docker client for ``--docker-url`` (empty: ``DOCKER_HOST`` or the local socket).

    The API version is negotiated (``auto``) so Debian's engine 20.10 (API 1.41) works.

    Raises:
        UpdaterError(API_UNAVAILABLE): the engine does not answer.
    """
    try:
        if settings.docker_url:
            return docker.DockerClient(
                base_url=settings.docker_url, version="auto", timeout=int(settings.docker_timeout)
            )
        return docker.from_env(version="auto", timeout=int(settings.docker_timeout))
    except docker.errors.DockerException as exc:
        raise UpdaterError(Exit.API_UNAVAILABLE, f"--docker-url: Docker engine: {exc}") from exc


def ensure_image(
    client: docker.DockerClient, reference: str, policy: str, reporter: Reporter
) -> Image:
    """Return the desired image, pulling it per ``policy`` (see module docstring).

    Raises:
        UpdaterError(IMAGE_UNAVAILABLE): neither present locally nor pullable.
    """
    local: Image | None
    try:
        local = client.images.get(reference)
    except docker.errors.ImageNotFound:
        local = None
    if policy == "never" or (policy == "if-not-present" and local is not None):
        if local is None:
            raise UpdaterError(
                Exit.IMAGE_UNAVAILABLE, f"--image {reference}: not present (--pull-policy never)"
            )
        reporter.step(
            "ImagePresent", f"image {reference} present locally", image=reference, id=local.id
        )
        return local
    try:
        pulled = client.images.pull(reference)
        image = pulled[0] if isinstance(pulled, list) else pulled
        reporter.step("ImagePulled", f"pulled {reference}", image=reference, id=image.id)
        return image
    except docker.errors.APIError as exc:
        if local is not None:
            reporter.step(
                "ImagePullFailed",
                f"pull of {reference} failed, using the local image: {exc.explanation or exc}",
                warning=True,
                image=reference,
                id=local.id,
            )
            return local
        raise UpdaterError(
            Exit.IMAGE_UNAVAILABLE, f"--image {reference}: not present and pull failed: {exc}"
        ) from exc


def _user_part(values: list[str] | None, defaults: list[str] | None) -> list[str]:
    base = set(defaults or [])
    return [v for v in values or [] if v not in base]


def _if_not_default(value: Any, default: Any) -> Any:
    return None if value == default else value


def clone_spec(container: Container, old_image: Image | None) -> dict[str, Any]:
    """Keyword arguments of ``APIClient.create_container`` that recreate ``container``.

    HostConfig is copied verbatim from ``container.attrs``; from Config only what the user set
    (Env/Labels entries, Cmd, Entrypoint, User, WorkingDir that differ from ``old_image``'s
    defaults), so the new image's defaults apply to the rest. Networks other than the
    HostConfig's NetworkMode are reattached with their aliases.
    """
    attrs = container.attrs
    cfg = attrs.get("Config") or {}
    image_cfg = (old_image.attrs.get("Config") or {}) if old_image is not None else {}
    labels = {
        k: v
        for k, v in (cfg.get("Labels") or {}).items()
        if (image_cfg.get("Labels") or {}).get(k) != v
    }
    host_config = dict(attrs.get("HostConfig") or {})
    spec: dict[str, Any] = {
        "name": attrs["Name"].lstrip("/"),
        "environment": _user_part(cfg.get("Env"), image_cfg.get("Env")),
        "labels": labels,
        "command": _if_not_default(cfg.get("Cmd"), image_cfg.get("Cmd")),
        "entrypoint": _if_not_default(cfg.get("Entrypoint"), image_cfg.get("Entrypoint")),
        "user": _if_not_default(cfg.get("User") or "", image_cfg.get("User") or "") or None,
        "working_dir": _if_not_default(
            cfg.get("WorkingDir") or "", image_cfg.get("WorkingDir") or ""
        )
        or None,
        "hostname": None if host_config.get("NetworkMode") == "host" else cfg.get("Hostname"),
        "stop_signal": cfg.get("StopSignal"),
        "tty": bool(cfg.get("Tty")),
        "host_config": host_config,
    }
    networks = (attrs.get("NetworkSettings") or {}).get("Networks") or {}
    mode = host_config.get("NetworkMode") or ""
    extra = {
        name: {"Aliases": net.get("Aliases")}
        for name, net in networks.items()
        if name != mode and mode not in ("host", "none") and not mode.startswith("container:")
    }
    if extra:
        spec["networking_config"] = {"EndpointsConfig": extra}
    return spec


def _wait_health(settings: DockerSettings) -> bool:
    attempts = max(1, int(settings.health_timeout / max(settings.health_interval, 0.01)))
    return health.wait_serving(
        settings.agent_health_address,
        attempts=attempts,
        interval=settings.health_interval,
        rpc_timeout=settings.health_rpc_timeout,
    )


def _remove(client: docker.DockerClient, name_or_id: str) -> None:
    with contextlib.suppress(docker.errors.NotFound):
        client.containers.get(name_or_id).remove(force=True)


def update_once(
    client: docker.DockerClient,
    settings: DockerSettings,
    reporter: Reporter,
    rejected: set[str] | None = None,
) -> Exit:
    """One Docker-mode pass without the lock (the caller holds it); return the exit code.

    ``rejected`` (loop mode) holds image ids that were already rolled back: such an image is
    not tried again (exit code ROLLED_BACK without touching the container) until the desired
    reference resolves to another id; a rolled-back id is added to it.

    Raises:
        UpdaterError: CONTAINER_NOT_FOUND, IMAGE_UNAVAILABLE, ROLLED_BACK, ROLLBACK_FAILED.
        docker.errors.APIError: an engine call failed (the CLI maps it to API_UNAVAILABLE).
    """
    name = settings.container
    previous = f"{name}{PREVIOUS_SUFFIX}"
    try:
        old = client.containers.get(name)
    except docker.errors.NotFound as exc:
        try:
            # An update interrupted between the rename and the new container: restore it.
            old = client.containers.get(previous)
        except docker.errors.NotFound:
            raise UpdaterError(
                Exit.CONTAINER_NOT_FOUND, f"--container {name}: no such container"
            ) from exc
        old.rename(name)
        old.start()
        reporter.step(
            "AgentRestored",
            f"found only {previous} (an interrupted update): renamed back and started",
            warning=True,
        )
        old.reload()
    desired = ensure_image(client, settings.image, settings.pull_policy, reporter)
    running_id = old.attrs.get("Image", "")
    if running_id == desired.id:
        reporter.step(
            "AgentUpToDate",
            f"container {name} already runs {settings.image} ({desired.short_id})",
            image_id=desired.id,
        )
        return Exit.OK
    if rejected is not None and desired.id in rejected:
        reporter.step(
            "ImageSkipped",
            f"{settings.image} ({str(desired.id)[:19]}) was rolled back before; not retried",
            warning=True,
            image_id=desired.id,
        )
        return Exit.ROLLED_BACK
    try:
        old_image: Image | None = client.images.get(running_id)
    except docker.errors.ImageNotFound:
        old_image = None
    spec = clone_spec(old, old_image)
    reporter.step(
        "AgentOutdated",
        f"container {name} runs {running_id[:19]}, desired {settings.image} ({str(desired.id)[:19]})",
        running=running_id,
        desired=desired.id,
    )
    _remove(client, previous)  # a leftover of an interrupted run
    old.stop(timeout=settings.stop_timeout)
    old.rename(previous)
    reporter.step("AgentStopped", f"stopped {name}, kept as {previous}", previous=previous)
    new_id = client.api.create_container(image=desired.id, **spec)["Id"]
    client.api.start(new_id)
    reporter.step(
        "AgentStarted",
        f"started {name} from {settings.image}",
        container_id=new_id,
        image=settings.image,
    )
    if _wait_health(settings):
        reporter.step(
            "AgentHealthy",
            f"agent SERVING at {settings.agent_health_address}",
            address=settings.agent_health_address,
        )
        _remove(client, previous)
        reporter.step(
            "AgentUpdated", f"container {name} runs {settings.image}", image_id=desired.id
        )
        return Exit.OK
    tail = ""
    with contextlib.suppress(docker.errors.APIError):
        tail = client.api.logs(new_id, tail=20).decode(errors="replace")
    reporter.step(
        "AgentUnhealthy",
        f"{settings.image} not SERVING within {settings.health_timeout:g} s; rolling back",
        warning=True,
        logs=tail,
    )
    _remove(client, new_id)
    restored = client.containers.get(previous)
    restored.rename(name)
    restored.start()
    if _wait_health(settings):
        reporter.step(
            "AgentRolledBack",
            f"container {name} runs the previous image again",
            warning=True,
            image_id=running_id,
        )
        if rejected is not None and desired.id:
            rejected.add(desired.id)
        raise UpdaterError(
            Exit.ROLLED_BACK,
            f"{settings.image} never became healthy within {settings.health_timeout:g} s "
            "(--health-timeout); rolled back to the previous image",
        )
    raise UpdaterError(
        Exit.ROLLBACK_FAILED,
        f"{settings.image} never became healthy and the previous image did not come back "
        f"healthy within {settings.health_timeout:g} s",
    )


def run(
    settings: DockerSettings,
    reporter: Reporter,
    client: docker.DockerClient | None = None,
    rejected: set[str] | None = None,
) -> Exit:
    """Take the Redis lock (when ``--redis``), run :func:`update_once`, release the lock.

    Raises:
        UpdaterError: LOCK_TIMEOUT, API_UNAVAILABLE, or any code of :func:`update_once`.
    """
    client = client or docker_client(settings)
    if not settings.redis_url:
        return update_once(client, settings, reporter, rejected)
    try:
        conn = redis.Redis.from_url(settings.redis_url)
        lock = conn.lock(
            settings.lock_name,
            timeout=settings.lock_ttl,
            blocking_timeout=settings.lock_wait_timeout,
        )
        acquired = lock.acquire()
    except (redis.RedisError, ValueError) as exc:
        url = settings.redis_url  # the message and the log never carry its password
        raise UpdaterError(
            Exit.API_UNAVAILABLE, f"--redis {redact_url(url)}: {scrub(str(exc), url)}"
        ) from exc
    if not acquired:
        raise UpdaterError(
            Exit.LOCK_TIMEOUT,
            f"Redis lock {settings.lock_name} not acquired within {settings.lock_wait_timeout:g} s (--lock-wait-timeout)",
        )
    reporter.step(
        "UpdateSlotAcquired", f"holding Redis lock {settings.lock_name}", lock=settings.lock_name
    )
    started = time.monotonic()
    try:
        return update_once(client, settings, reporter, rejected)
    finally:
        try:
            lock.release()
        except redis.exceptions.LockError as exc:
            log.warning(
                "Redis lock expired before release (raise --lock-ttl)",
                extra={"held_s": round(time.monotonic() - started, 1), "error": str(exc)},
            )
        except redis.RedisError as exc:
            log.warning(
                "Redis lock not released", extra={"error": scrub(str(exc), settings.redis_url)}
            )
        conn.close()
