"""Command line of ``cilia-safe-agent-updater``.

``cilia-safe-agent-updater --mode kubernetes [flags]``   one pass as an init container
``cilia-safe-agent-updater --mode docker --image IMG [flags]``   one pass or ``--interval`` loop
``cilia-safe-agent-updater hash -f rendered.yaml [--write]``   compute/stamp the generation
``cilia-safe-agent-updater serve``   gRPC health server only (the DaemonSet's long-running part)

Every interval, attempt count and timeout is a flag; README.md lists the defaults and the
exit code table (:class:`cilia_safe_agent_updater.exitcodes.Exit`).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import re
import sys
import time
import urllib.parse
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import grpc

from cilia_common import grpcserver
from cilia_common.addresses import grpc_listen_target
from cilia_common.durations import duration_arg
from cilia_common.flags import EXIT_USAGE, FlagError, add_model_flags, config_from_args
from cilia_common.logs import setup_logging
from cilia_common.runtime import announce_listening, run_until_signal
from cilia_safe_agent_updater import __version__
from cilia_safe_agent_updater.config import ServeConfig
from cilia_safe_agent_updater.exitcodes import Exit, UpdaterError
from cilia_safe_agent_updater.redact import redact_url, scrub
from cilia_safe_agent_updater.steps import Reporter

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

    _Settings = TypeVar("_Settings", bound=DataclassInstance)

COMPONENT = "cilia-safe-agent-updater"
DEFAULT_AGENT_HEALTH = "unix:/var/run/cilia/cilia.sock"

log = logging.getLogger("cilia_safe_agent_updater")


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be >= 1")
    return value


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be >= 0")
    return value


REDIS_URL_FORM = "redis://HOST[:PORT][/DB], rediss://HOST[:PORT][/DB] or unix:///PATH[?db=DB]"
DOCKER_URL_FORM = "unix:///PATH, tcp://HOST:PORT, http(s)://HOST:PORT or ssh://[USER@]HOST"
IMAGE_FORM = "[REGISTRY[:PORT]/]NAME[:TAG][@DIGEST], e.g. registry.local:5000/cilia-agent:1.2"

# The image reference grammar of the Docker/OCI distribution spec (distribution/reference):
# an optional registry host[:port] first, then lowercase path components separated by '/',
# a tag of at most 128 word characters, dots and dashes, and/or an algorithm:hex digest.
# The grammar lets a domain component be upper case (DNS names are case-insensitive), but
# Docker's normalisation (ParseNormalizedNamed, splitDockerDomain) takes the first component
# for a registry host only when it contains a '.' or a ':' or is exactly 'localhost';
# otherwise it is a path component of a docker.io repository and must be lowercase. So
# 'Registry.Local:5000/cilia/agent' is valid, 'UPPER/case' and 'Nginx' are not (the engine
# answers "repository name must be lowercase" to both).
_HOST_COMPONENT = r"[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?"
_REGISTRY = (
    rf"(?:{_HOST_COMPONENT}(?:\.{_HOST_COMPONENT})+(?::[0-9]+)?"  # has a dot
    rf"|{_HOST_COMPONENT}:[0-9]+"  # has a port
    r"|localhost)"
)
_PATH_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_IMAGE_REFERENCE = re.compile(
    rf"^(?:{_REGISTRY}/)?"
    rf"{_PATH_COMPONENT}(?:/{_PATH_COMPONENT})*"
    r"(?::[A-Za-z0-9_][A-Za-z0-9_.-]{0,127})?"
    r"(?:@[A-Za-z][A-Za-z0-9]*(?:[-_+.][A-Za-z][A-Za-z0-9]*)*:[0-9a-fA-F]{32,})?$"
)


def _redis_url(text: str) -> str:
    """argparse type of ``--redis``: empty (no lock) or a Redis URL redis-py accepts, with a
    host (redis/rediss) or socket path (unix) and a numeric database."""
    if not text:
        return text
    from redis.connection import parse_url

    shown = redact_url(text)  # never echo a password
    try:
        parse_url(text)  # type: ignore[no-untyped-call, unused-ignore]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(
            f"{shown!r} is not a Redis URL ({scrub(str(exc), text)}); expected {REDIS_URL_FORM}"
        ) from None
    url = urllib.parse.urlsplit(text)
    problem = ""
    if url.scheme in ("redis", "rediss"):
        db = url.path.strip("/")
        if not url.hostname:
            problem = "no host"
        elif db and not db.isdigit():
            problem = f"database {db!r} is not a number"
    elif not url.path:
        problem = "no socket path"
    if problem:
        raise argparse.ArgumentTypeError(
            f"{shown!r} is not a Redis URL ({problem}); expected {REDIS_URL_FORM}"
        )
    return text


def _docker_url(text: str) -> str:
    """argparse type of ``--docker-url``: empty ($DOCKER_HOST or the local socket) or an
    Engine address docker-py can parse (``docker.utils.parse_host``)."""
    if not text:
        return text
    import docker.errors
    import docker.utils

    try:
        if text.startswith("unix://") and not text.startswith("unix:///"):
            # docker-py would read unix://run/docker.sock as /run/docker.sock (legacy form):
            # an ambiguous relative-looking path is refused instead of guessed
            raise ValueError("a unix socket needs an absolute path, unix:///PATH")
        docker.utils.parse_host(text, False, False)
    except (docker.errors.DockerException, ValueError) as exc:
        raise argparse.ArgumentTypeError(
            f"{redact_url(text)!r} is not a Docker Engine address ({scrub(str(exc), text)}); "
            f"expected {DOCKER_URL_FORM}"
        ) from None
    return text


def _image(text: str) -> str:
    """argparse type of ``--image``: empty (then the mode refuses it) or an image reference
    (lowercase repository path, optional registry host -- any case -- tag and digest; see
    ``_IMAGE_REFERENCE`` for when the first component counts as the registry)."""
    if text and not _IMAGE_REFERENCE.match(text):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not an image reference; expected {IMAGE_FORM} "
            "(repository path lowercase; the first component is a registry host, which may "
            "be upper case, only with a '.' or ':' or as 'localhost'; tag [A-Za-z0-9_.-] up "
            "to 128 characters)"
        )
    return text


def build_parser() -> argparse.ArgumentParser:
    """Return the argument parser (``--mode`` flags, ``serve`` and ``hash`` sub-commands)."""
    parser = argparse.ArgumentParser(
        prog=COMPONENT,
        description="Cilia safe agent updater: replace the agent on this node/host only when "
        "its generation differs, with the new image already present, and wait until healthy.",
    )
    parser.add_argument("--version", action="version", version=f"{COMPONENT} {__version__}")
    parser.add_argument("--mode", choices=["kubernetes", "docker"], help="run one update pass")
    parser.add_argument(
        "--log-level",
        default="info",
        choices=["debug", "info", "warning", "error"],
        help="(default info)",
    )
    parser.add_argument(
        "--agent-health-address",
        default=DEFAULT_AGENT_HEALTH,
        help="gRPC health target of the agent, host:port or unix:/path; empty skips the "
        f"check in kubernetes mode (default {DEFAULT_AGENT_HEALTH})",
    )
    parser.add_argument(
        "--health-rpc-timeout",
        type=duration_arg(),
        default=2.0,
        help="deadline of one health Check, s (default 2)",
    )
    k8s = parser.add_argument_group("kubernetes mode")
    k8s.add_argument(
        "--node-name",
        default=os.environ.get("NODE_NAME", ""),
        help="this node (default $NODE_NAME)",
    )
    k8s.add_argument(
        "--kubeconfig",
        default=os.environ.get("KUBECONFIG", ""),
        help="kubeconfig file (default $KUBECONFIG, else in-cluster)",
    )
    k8s.add_argument(
        "--namespace",
        default="cilia-system",
        help="namespace of the agent DaemonSet and pods (default cilia-system)",
    )
    k8s.add_argument(
        "--agent-daemonset",
        default="cilia-agent",
        help="agent DaemonSet name (default cilia-agent)",
    )
    k8s.add_argument(
        "--agent-selector",
        default="app=cilia-agent",
        help="label selector of agent pods (default app=cilia-agent)",
    )
    k8s.add_argument(
        "--expected-generation",
        default=os.environ.get("CILIA_EXPECTED_GENERATION", ""),
        help="the updater's own generation annotation (downward API); a different agent "
        "DaemonSet generation exits 19 (default $CILIA_EXPECTED_GENERATION, empty: no check)",
    )
    k8s.add_argument(
        "--poll-interval",
        type=duration_arg(),
        default=3.0,
        help="seconds between checks of every wait (default 3, upstream 3)",
    )
    k8s.add_argument(
        "--image-check-attempts",
        type=_positive_int,
        default=20,
        help="checks of Node.status.images (default 20)",
    )
    k8s.add_argument(
        "--no-image-check",
        action="store_true",
        help="skip the Node.status.images check (nodes with > 50 images)",
    )
    k8s.add_argument(
        "--pod-replace-attempts",
        type=_positive_int,
        default=20,
        help="checks for exactly one new agent pod (default 20, upstream 20)",
    )
    k8s.add_argument(
        "--ready-attempts",
        type=_positive_int,
        default=20,
        help="checks for the new pod's Ready condition (default 20, upstream 20)",
    )
    k8s.add_argument(
        "--health-attempts",
        type=_positive_int,
        default=20,
        help="gRPC health checks of the new agent (default 20)",
    )
    k8s.add_argument(
        "--api-timeout",
        type=duration_arg(),
        default=10.0,
        help="deadline of one API request, s (default 10)",
    )
    k8s.add_argument(
        "--api-retries",
        type=_non_negative_int,
        default=5,
        help="client retries of one API request on connection errors, 429 and 5xx (default 5)",
    )
    k8s.add_argument(
        "--api-retry-backoff",
        type=duration_arg(),
        default=0.5,
        help="first retry delay, doubling, s (default 0.5)",
    )
    k8s.add_argument(
        "--max-concurrent-updates",
        type=_non_negative_int,
        default=0,
        help="Lease slots: at most N nodes replace their agent at once; 0 = no Lease (default 0)",
    )
    k8s.add_argument(
        "--lease-namespace", default="", help="namespace of the Leases (default: --namespace)"
    )
    k8s.add_argument(
        "--lease-prefix",
        default="cilia-safe-agent-updater",
        help="Leases are <prefix>-0..N-1 (default cilia-safe-agent-updater)",
    )
    k8s.add_argument(
        "--lease-duration",
        type=_positive_int,
        default=60,
        help="leaseDurationSeconds; renewed every third of it (default 60)",
    )
    k8s.add_argument(
        "--lease-wait-timeout",
        type=duration_arg(),
        default=600.0,
        help="seconds to wait for a free slot (default 600)",
    )
    k8s.add_argument(
        "--no-events", action="store_true", help="do not create core/v1 Events (log lines only)"
    )
    dock = parser.add_argument_group("docker mode")
    dock.add_argument(
        "--image",
        type=_image,
        default="",
        help=f"desired agent image reference {IMAGE_FORM} (required)",
    )
    dock.add_argument(
        "--container", default="cilia-agent", help="agent container name (default cilia-agent)"
    )
    dock.add_argument(
        "--docker-url",
        type=_docker_url,
        default="",
        help=f"Engine API address: {DOCKER_URL_FORM} (default $DOCKER_HOST or the local socket)",
    )
    dock.add_argument(
        "--pull-policy",
        default="if-not-present",
        choices=["if-not-present", "always", "never"],
        help="(default if-not-present; see README)",
    )
    dock.add_argument(
        "--health-timeout",
        type=duration_arg(),
        default=60.0,
        help="seconds the new agent gets to be SERVING before rollback (default 60)",
    )
    dock.add_argument(
        "--health-interval",
        type=duration_arg(),
        default=1.0,
        help="seconds between health checks (default 1)",
    )
    dock.add_argument(
        "--stop-timeout",
        type=_non_negative_int,
        default=10,
        help="seconds the old container gets after SIGTERM (default 10)",
    )
    dock.add_argument(
        "--docker-timeout",
        type=duration_arg(),
        default=120.0,
        help="deadline of one Engine API call, s (default 120)",
    )
    dock.add_argument(
        "--redis",
        type=_redis_url,
        default="",
        help="Redis URL of the one-host-at-a-time lock, e.g. redis://127.0.0.1:6390/0 (default: no lock)",
    )
    dock.add_argument(
        "--lock-name",
        default="cilia:safe-agent-updater:lock",
        help="Redis lock key (default cilia:safe-agent-updater:lock)",
    )
    dock.add_argument(
        "--lock-ttl",
        type=duration_arg(),
        default=300.0,
        help="lock expiry if this host dies mid-update, s (default 300)",
    )
    dock.add_argument(
        "--lock-wait-timeout",
        type=duration_arg(),
        default=600.0,
        help="seconds to wait for the lock (default 600)",
    )
    dock.add_argument(
        "--interval",
        type=duration_arg(),
        default=0.0,
        help="loop: seconds between passes; 0 = one pass (default 0)",
    )
    sub = parser.add_subparsers(dest="command")
    serve = sub.add_parser("serve", help="run the updater's gRPC health server")
    add_model_flags(serve, ServeConfig)  # flags, help, defaults from config.ServeConfig
    hsh = sub.add_parser("hash", help="print (and with --write stamp) the agent generation hash")
    hsh.add_argument(
        "-f", "--file", required=True, help="rendered manifest (multi-document YAML); - = stdin"
    )
    hsh.add_argument(
        "--agent-daemonset", dest="hash_agent", default="cilia-agent", help="(default cilia-agent)"
    )
    hsh.add_argument(
        "--updater-daemonset",
        default="cilia-safe-agent-updater",
        help="(default cilia-safe-agent-updater)",
    )
    hsh.add_argument(
        "--write",
        action="store_true",
        help="print the manifest with both DaemonSets annotated instead of the hash",
    )
    return parser


async def serve(health_address: str, grace_seconds: float) -> None:
    """Serve gRPC health (SERVING) on ``health_address`` until SIGTERM or SIGINT.

    Logs ``listening`` (listener ``health``, the bound address) once health reports SERVING.

    Raises:
        cilia_common.grpcserver.BindError: the address cannot be bound.
    """
    servers: list[grpc.aio.Server] = []

    async def start() -> None:
        target = grpc_listen_target(health_address)
        server, health, ports = await grpcserver.start_server_with_ports([], [target])
        servers.append(server)
        await grpcserver.set_serving(health, [])
        bound = grpcserver.bound_port(target, ports[target]) if target in ports else target
        announce_listening(log, "health", bound)
        log.info("serving", extra={"version": __version__})

    async def stop() -> None:
        if servers:
            log.info("shutting down", extra={"grace_seconds": grace_seconds})
            await servers[0].stop(grace_seconds)

    await run_until_signal(start, stop)


def _hash_command(args: argparse.Namespace) -> int:
    import yaml

    from cilia_safe_agent_updater.generation import stamp

    try:
        text = sys.stdin.read() if args.file == "-" else open(args.file, encoding="utf-8").read()  # noqa: SIM115
        docs = [d for d in yaml.safe_load_all(text) if d is not None]
        digest = stamp(docs, args.hash_agent, args.updater_daemonset)
    except (OSError, yaml.YAMLError, ValueError, KeyError, TypeError) as exc:
        print(f"{COMPONENT}: --file {args.file}: {exc}", file=sys.stderr)
        return int(Exit.USAGE)
    if args.write:
        sys.stdout.write(yaml.safe_dump_all(docs, sort_keys=False))
    else:
        print(digest)
    return int(Exit.OK)


def _settings(cls: type[_Settings], args: argparse.Namespace, **given: Any) -> _Settings:
    """Build the mode's settings dataclass ``cls`` from the parsed flags.

    Each field takes the flag of the same name (``args.<field>``), except the fields passed
    in ``given`` (renamed or inverted flags, e.g. ``check_images=not args.no_image_check``).

    Raises:
        AttributeError: a field has neither a flag of its name nor a value in ``given``.
    """
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if f.name not in given}
    return cls(**values, **given)


def _run_kubernetes(args: argparse.Namespace) -> Exit:
    from cilia_safe_agent_updater import kube

    if not args.node_name:
        raise UpdaterError(Exit.USAGE, "--node-name (or NODE_NAME) is required in kubernetes mode")
    settings = _settings(
        kube.KubeSettings, args, check_images=not args.no_image_check, events=not args.no_events
    )
    api = kube.KubeAPI(
        kube.api_client(
            args.kubeconfig or None, retries=args.api_retries, backoff=args.api_retry_backoff
        ),
        args.api_timeout,
    )
    try:
        return kube.run(settings, api, Reporter())
    except kube.API_ERRORS as exc:
        raise UpdaterError(Exit.API_UNAVAILABLE, f"Kubernetes API: {exc}") from exc


def _run_docker(args: argparse.Namespace) -> Exit:
    import docker.errors

    from cilia_safe_agent_updater import dockermode

    if not args.image:
        raise UpdaterError(Exit.USAGE, "--image is required in docker mode")
    settings = _settings(dockermode.DockerSettings, args, redis_url=args.redis)
    client = dockermode.docker_client(settings)
    rejected: set[str] = set()  # loop mode: image ids already rolled back are not retried
    while True:
        try:
            code = dockermode.run(settings, Reporter(), client, rejected)
        except docker.errors.DockerException as exc:
            code_error = UpdaterError(Exit.API_UNAVAILABLE, f"Docker engine: {exc}")
            if args.interval <= 0:
                raise code_error from exc
            log.error(_scrubbed(code_error, args), extra={"exit_code": int(code_error.code)})
        except UpdaterError as exc:
            if args.interval <= 0:
                raise
            log.error(_scrubbed(exc, args), extra={"exit_code": int(exc.code)})
        else:
            if args.interval <= 0:
                return code
        time.sleep(args.interval)


def _scrubbed(exc: BaseException, args: argparse.Namespace) -> str:
    """``str(exc)`` without the passwords of ``--redis`` / ``--docker-url`` (see redact.py)."""
    return scrub(str(exc), getattr(args, "redis", ""), getattr(args, "docker_url", ""))


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``cilia-safe-agent-updater`` console script; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "serve":
        try:
            config = config_from_args(ServeConfig, args)
        except FlagError as exc:
            print(f"{COMPONENT} serve: {exc}", file=sys.stderr)
            return EXIT_USAGE
        setup_logging(COMPONENT, config.log_level)
        try:
            asyncio.run(serve(config.health_listen_address, config.shutdown_grace_period))
        except grpcserver.BindError as exc:
            print(f"{COMPONENT}: {exc}", file=sys.stderr)
            return 2
        return 0
    setup_logging(COMPONENT, args.log_level)
    if args.command == "hash":
        return _hash_command(args)
    if args.mode is None:
        parser.error("give --mode kubernetes|docker, or a sub-command (serve, hash)")
    try:
        code = _run_kubernetes(args) if args.mode == "kubernetes" else _run_docker(args)
    except UpdaterError as exc:
        message = _scrubbed(exc, args)
        log.error(message, extra={"exit_code": int(exc.code), "exit_name": exc.code.name})
        print(f"{COMPONENT}: {message}", file=sys.stderr)
        return int(exc.code)
    log.info("done", extra={"exit_code": int(code)})
    return int(code)


if __name__ == "__main__":
    sys.exit(main())
