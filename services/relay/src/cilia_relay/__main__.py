"""Command line of ``cilia-relay``: argument parsing only.

* ``cilia-relay --version`` prints ``cilia-relay <version>``.
* ``cilia-relay serve [flags]`` runs the relay (:mod:`cilia_relay.app`); flags and
  defaults are the fields of :class:`cilia_relay.config.Config`.
* ``cilia-relay observe [flags]`` streams flows like ``hubble observe``
  (:mod:`cilia_relay.cli.observe`).

Bad flags exit 2 with one line on stderr.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

from cilia_common.flags import EXIT_USAGE, FlagError, add_model_flags, config_from_args
from cilia_relay import __version__
from cilia_relay.config import Config

COMPONENT = "cilia-relay"
UINT64_MAX = 2**64 - 1  # --last: GetFlowsRequest.number (observer.proto) is a uint64


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line: ``cilia-relay <cmd>: error: ...``."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")


class _FilterAction(argparse.Action):
    """Appends ``(flag, value)`` to ``namespace.filters`` keeping command-line order."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        filters = list(getattr(namespace, "filters", None) or [])
        filters.append((self.dest.replace("_", "-"), str(values)))
        namespace.filters = filters


def build_parser() -> argparse.ArgumentParser:
    """Return the argument parser (``--version``, ``serve``, ``observe``)."""
    parser = _Parser(prog=COMPONENT, description="Cilia Hubble relay")
    parser.add_argument("--version", action="version", version=f"{COMPONENT} {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    serve = sub.add_parser("serve", help="run the relay")
    add_model_flags(serve, Config)

    observe = sub.add_parser("observe", help="observe flows (like hubble observe)")
    observe.set_defaults(filters=[])
    observe.add_argument(
        "--server", default="localhost:4245", help="relay address (default localhost:4245)"
    )
    observe.add_argument(
        "--timeout",
        default="5s",
        help="how long to wait for the connection to the server (default 5s)",
    )
    filter_help = {
        "pod": "flows from or to this pod (namespace/name, or name)",
        "from-pod": "flows from this pod",
        "to-pod": "flows to this pod",
        "verdict": "flows with this verdict (FORWARDED, DROPPED, ...)",
        "port": "flows from or to this L4 port",
        "protocol": "flows of this L4/L7 protocol (tcp, udp, icmp, ...)",
        "label": "flows from or to endpoints with this label (key=value or source:key=value)",
    }
    for flag, help_text in filter_help.items():
        observe.add_argument(
            f"--{flag}", dest=flag.replace("-", "_"), action=_FilterAction, help=help_text
        )
    observe.add_argument(
        "--last",
        type=int,
        default=0,
        help="get the last N flows of each agent (default 20 unless --follow)",
    )
    observe.add_argument("-f", "--follow", action="store_true", help="follow the flow stream")
    observe.add_argument(
        "-o", "--output", choices=["compact", "json"], default="compact", help="output format"
    )
    return parser


def _serve(args: argparse.Namespace) -> int:
    from cilia_common import grpcserver
    from cilia_common.logs import setup_logging
    from cilia_common.tls import TLSFileError
    from cilia_relay import app

    try:
        config = config_from_args(Config, args)
    except FlagError as exc:
        print(f"{COMPONENT} serve: {exc}", file=sys.stderr)
        return EXIT_USAGE
    setup_logging(COMPONENT, config.log_level)
    if config.client_tls is not None:  # read again at each dial; unusable now is an error now
        from cilia_common.tls import channel_credentials

        try:
            channel_credentials(config.client_tls)
        except TLSFileError as exc:
            print(f"{COMPONENT}: cannot start: TLS to agents: {exc}", file=sys.stderr)
            return 1
    try:
        app.run(config)
    except grpcserver.BindError as exc:
        print(f"{COMPONENT}: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except TLSFileError as exc:
        print(f"{COMPONENT}: cannot start: TLS: {exc}", file=sys.stderr)
        return 1
    return 0


def _observe(args: argparse.Namespace) -> int:
    from cilia_relay.cli import observe
    from cilia_relay.cli.filters import FilterError, build_whitelist
    from cilia_relay.config import parse_duration

    prog = f"{COMPONENT} observe"
    try:
        timeout = parse_duration(args.timeout)
        build_whitelist(args.filters)
    except (FilterError, ValueError) as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if args.last < 0:
        print(f"{prog}: error: --last must be >= 0", file=sys.stderr)
        return EXIT_USAGE
    if args.last > UINT64_MAX:  # GetFlowsRequest.number is a uint64 (protobuf would raise)
        print(f"{prog}: error: --last must be <= {UINT64_MAX}", file=sys.stderr)
        return EXIT_USAGE
    if not args.server.strip():
        print(f"{prog}: error: --server must not be empty (host:port or unix:/path)",
              file=sys.stderr)  # fmt: skip
        return EXIT_USAGE
    return observe.run(
        observe.ObserveOptions(
            server=args.server,
            filters=tuple(args.filters),
            last=args.last,
            follow=args.follow,
            output=args.output,
            timeout=timeout,
        )
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``cilia-relay`` console script; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "serve":
        return _serve(args)
    return _observe(args)


if __name__ == "__main__":
    sys.exit(main())
