"""``cilia-agent``: argument parsing only (serve, status, endpoint list, bpf policy|ipcache|ct
list, bpf ct flush, service list, init <step>)."""

from __future__ import annotations

import argparse
import logging
import os
import pathlib
import sys
from collections.abc import Sequence

from cilia_agent import __version__
from cilia_agent.config import Config
from cilia_common.flags import EXIT_USAGE, FlagError, add_model_flags, config_from_args, given_flags

DEFAULT_SOCKET = "/var/run/cilia/cilia.sock"
DEFAULT_PIN_DIR = "/sys/fs/bpf/cilia"


def _path(value: str) -> str:
    """argparse type of the client commands' path flags: "" would be the working directory
    (``--socket ""`` dialled it), so it is a usage error, as it is for ``serve``."""
    if value.strip() == "":
        raise argparse.ArgumentTypeError("is empty: give a path (it is not the working directory)")
    return value


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="cilia-agent", description="Cilia node agent (endpoints, node IPAM, pod plumbing)."
    )
    parser.add_argument("--version", action="version", version=f"cilia-agent {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run the agent")
    add_model_flags(serve, Config)  # every flag, help, default and range from config.Config

    client = argparse.ArgumentParser(add_help=False)
    client.add_argument(
        "--socket",
        type=_path,
        default=DEFAULT_SOCKET,
        help=f"agent socket (default {DEFAULT_SOCKET})",
    )
    client.add_argument(
        "--timeout", type=float, default=5.0, help="seconds to wait for the agent (default 5)"
    )
    status_parser = sub.add_parser("status", parents=[client], help="show agent status")
    status_parser.add_argument("-o", "--output", choices=["table", "json"], default="table")
    endpoint = sub.add_parser("endpoint", help="endpoint commands")
    esub = endpoint.add_subparsers(dest="endpoint_command", required=True)
    pins = argparse.ArgumentParser(add_help=False)
    pins.add_argument(
        "--bpf-pin-dir",
        "--bpf-root",
        type=_path,
        default=DEFAULT_PIN_DIR,
        help=f"pin directory of the datapath's maps (default {DEFAULT_PIN_DIR})",
    )
    pins.add_argument("-o", "--output", choices=["table", "json"], default="table")
    esub.add_parser("list", parents=[client, pins], help="list endpoints")
    bpf = sub.add_parser("bpf", help="read the datapath's pinned maps (root)")
    bsub = bpf.add_subparsers(dest="bpf_map", required=True)
    for name, text in (
        ("policy", "policy map entries"),
        ("ipcache", "ipcache entries"),
        ("ct", "conntrack entries"),
    ):
        mp = bsub.add_parser(name, help=text)
        msub = mp.add_subparsers(dest="bpf_command", required=True)
        msub.add_parser("list", parents=[pins], help=f"list {text}")
        if name == "ct":
            msub.add_parser("flush", parents=[pins], help="delete every conntrack entry")
    service = sub.add_parser("service", help="load-balancer commands (root)")
    ssub = service.add_subparsers(dest="service_command", required=True)
    ssub.add_parser("list", parents=[pins], help="list Service frontends and their backends")
    from cilia_agent.preflight import cli as init_cli

    init_cli.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``cilia-agent`` console script; returns the exit code."""
    parser = _build_parser()
    args = parser.parse_args(argv)
    if args.command == "serve":
        from cilia_agent import app
        from cilia_common.logs import setup_logging

        try:
            config = config_from_args(Config, args)
        except FlagError as exc:
            print(f"cilia-agent: {exc}", file=sys.stderr)
            return EXIT_USAGE
        from cilia_agent.hubble.metrics import MetricsConfigError, parse_metrics

        try:  # the grammar lives with the handlers (hubble/metrics), a layer above config
            parse_metrics(config.hubble_metrics)
        except MetricsConfigError as exc:
            print(f"cilia-agent: --hubble-metrics: {exc}", file=sys.stderr)
            return EXIT_USAGE
        from cilia_agent.controlplane.kubeapi import KubeConfigError
        from cilia_agent.datapath import DatapathError
        from cilia_agent.datapath.loader import BpfUnavailable
        from cilia_agent.endpoint import StateError
        from cilia_common.grpcserver import BindError
        from cilia_common.tls import TLSFileError

        setup_logging("cilia-agent", config.log_level)
        for note in config.relative_path_notes(given_flags(args)):
            logging.getLogger("cilia_agent").warning(note)
        if config.hubble_tls is not None:  # before any side effect (datapath, cgroup links)
            from cilia_common.tls import CertificateReloader

            try:
                CertificateReloader(config.hubble_tls)
            except TLSFileError as exc:
                print(f"cilia-agent: cannot start: Hubble TLS: {exc}", file=sys.stderr)
                return 1
        if config.operator.startswith("k8s:"):  # where the API server is: before any change
            from cilia_agent.controlplane.kubeapi import KubeConfigError, resolve_access

            try:
                resolve_access(config.k8s_kubeconfig_path, config.k8s_api_server)
            except KubeConfigError as exc:
                print(f"cilia-agent: cannot start: --operator {config.operator}: {exc}",
                      file=sys.stderr)  # fmt: skip
                return 1
        from cilia_agent.preflight import PreflightError, startup_checks

        try:  # the init steps' checks, fast path: before any side effect of the agent
            checks = startup_checks(config, os.uname().release)
        except PreflightError as exc:
            print(f"cilia-agent: cannot start: {exc}", file=sys.stderr)
            return exc.code
        for line in checks.lines:
            logging.getLogger("cilia_agent").info("start-up check: %s", line)
        if checks.iptables_backend:
            config = config.model_copy(update={"iptables_backend": checks.iptables_backend})
        try:
            app.run(config)
        except BpfUnavailable as exc:
            hint = " (hosts without BPF: --enable-bpf=false)" if exc.kernel else ""
            print(f"cilia-agent: cannot start: {exc}{hint}", file=sys.stderr)
            return 1
        except (
            BindError,
            DatapathError,
            StateError,
            OSError,
            TLSFileError,
            KubeConfigError,
        ) as exc:
            print(f"cilia-agent: cannot start: {exc}", file=sys.stderr)
            return 1
        return 0
    if args.command == "init":
        from cilia_agent.preflight import cli as init_cli

        return init_cli.run(args)
    from cilia_agent import cli

    if args.command == "bpf":
        from cilia_agent.datapath.bpffs import PinnedMapError

        pin_dir = pathlib.Path(args.bpf_pin_dir)
        try:
            if args.bpf_map == "policy":
                return cli.bpf_policy_list(pin_dir, args.output)
            if args.bpf_map == "ct":
                if args.bpf_command == "flush":
                    return cli.bpf_ct_flush(pin_dir)
                return cli.bpf_ct_list(pin_dir, args.output)
            return cli.bpf_ipcache_list(pin_dir, args.output)
        except PinnedMapError as exc:
            print(f"cilia-agent: {exc}", file=sys.stderr)
            return 1
    if args.command == "service":
        from cilia_agent.datapath import DatapathError as MapError

        try:
            return cli.service_list(pathlib.Path(args.bpf_pin_dir), args.output)
        except MapError as exc:
            print(f"cilia-agent: {exc}", file=sys.stderr)
            return 1
    socket = pathlib.Path(args.socket)
    try:
        if args.command == "status":
            return cli.status(socket, args.timeout, output=args.output)
        return cli.endpoint_list(
            socket, args.timeout, args.output, pin_dir=pathlib.Path(args.bpf_pin_dir)
        )
    except cli.AgentUnavailable as exc:
        print(f"cilia-agent: {exc}", file=sys.stderr)
        return cli.EXIT_AGENT_UNAVAILABLE


if __name__ == "__main__":
    sys.exit(main())
