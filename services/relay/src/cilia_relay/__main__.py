"""Command line of ``cilia-relay``: argument parsing only.

``cilia-relay --version`` prints ``cilia-relay <version>``.
``cilia-relay serve`` runs the gRPC health server on ``--health-listen-address``
(upstream hubble-relay flag of the same name, default ``:4222``) until SIGTERM/SIGINT.
The Observer API on ``--listen-address`` (upstream default ``:4245``) comes in a
later issue; the flag is not offered until it is served.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from collections.abc import Sequence

from cilia_common import grpcserver
from cilia_common.logs import setup_logging
from cilia_relay import __version__

COMPONENT = "cilia-relay"
DEFAULT_HEALTH_LISTEN_ADDRESS = ":4222"
DEFAULT_SHUTDOWN_GRACE_SECONDS = 5.0

log = logging.getLogger("cilia_relay")


def build_parser() -> argparse.ArgumentParser:
    """Return the argument parser (``--version`` and the ``serve`` sub-command)."""
    parser = argparse.ArgumentParser(prog=COMPONENT, description="Cilia Hubble relay")
    parser.add_argument("--version", action="version", version=f"{COMPONENT} {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the relay (health server only in this release)")
    serve.add_argument(
        "--health-listen-address",
        default=DEFAULT_HEALTH_LISTEN_ADDRESS,
        help="gRPC health address host:port, :port (all interfaces) or unix:/path "
        f"(default {DEFAULT_HEALTH_LISTEN_ADDRESS!r}, as upstream hubble-relay)",
    )
    serve.add_argument(
        "--shutdown-grace-period",
        type=float,
        default=DEFAULT_SHUTDOWN_GRACE_SECONDS,
        help="seconds in-flight RPCs get to finish on SIGTERM "
        f"(default {DEFAULT_SHUTDOWN_GRACE_SECONDS})",
    )
    serve.add_argument(
        "--log-level",
        default="info",
        choices=["debug", "info", "warning", "error"],
        help="log level (default info)",
    )
    return parser


def grpc_address(address: str) -> str:
    """Translate a Go-style ``:PORT`` (all interfaces) into gRPC's ``[::]:PORT``.

    Other forms (``host:port``, ``unix:/path``) are returned unchanged.
    """
    return f"[::]{address}" if address.startswith(":") else address


async def serve(health_address: str, grace_seconds: float) -> None:
    """Serve gRPC health (SERVING) on ``health_address`` until SIGTERM or SIGINT.

    Logs ``listening`` with the address once health reports SERVING.

    Raises:
        cilia_common.grpcserver.BindError: the address cannot be bound.
    """
    server, health = await grpcserver.start_server([], [grpc_address(health_address)])
    await grpcserver.set_serving(health, [])
    log.info("listening", extra={"address": health_address, "version": __version__})
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("shutting down", extra={"grace_seconds": grace_seconds})
    await server.stop(grace_seconds)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``cilia-relay`` console script; returns the exit status."""
    args = build_parser().parse_args(argv)
    setup_logging(COMPONENT, args.log_level)
    try:
        asyncio.run(serve(args.health_listen_address, args.shutdown_grace_period))
    except grpcserver.BindError as exc:
        print(f"{COMPONENT}: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
