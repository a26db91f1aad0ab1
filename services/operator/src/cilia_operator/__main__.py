"""``cilia-operator``: argument parsing only (see app.py for the wiring, cli.py for clients).

cilia-operator serve [--store URL|kubernetes [--kubeconfig PATH]] [--listen ADDR] [--prometheus-serve-addr ADDR]
                     [--auto-create-cilium-pod-ip-pools SPEC] [--ipam-default-ip-pool NAME]
                     [--log-level LEVEL] [store/shutdown tuning flags]
                     [identity GC / identity range / watch stream flags]
                     [--enable-leader-election [--leader-election-* flags]]
                     [--ipam cluster-pool|multi-pool] [--cluster-pool-ipv4-cidr CIDR]
                     [--cluster-pool-ipv4-mask-size N]
                     [--enable-cluster-pool-to-multi-pool-migration]
                     [--service-cluster-ip-range CIDR]
cilia-operator apply -f FILE [--server ADDR] [--dry-run]
cilia-operator get KIND [NAME] [-n NAMESPACE | -A] [-o json|yaml] [--server ADDR]
cilia-operator delete KIND NAME [-n NAMESPACE] [--server ADDR]
cilia-operator ipam plan --cidr CIDR --mask-size N [--allow-first-ip] [--allow-last-ip]
                         [--pool NAME] [--service-cluster-ip-range CIDR] [--server ADDR | --offline]
cilia-operator ipam status [-o text|json] [--server ADDR]
cilia-operator --version
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import sys
from collections.abc import Sequence

from pydantic import ValidationError

from . import __version__

DEFAULT_SERVER = "127.0.0.1:4250"


def build_parser() -> argparse.ArgumentParser:
    """The full command-line parser (every flag with its documented default)."""
    parser = argparse.ArgumentParser(
        prog="cilia-operator", description="Cilia operator: cluster state and multi-pool IPAM."
    )
    parser.add_argument("--version", action="version", version=f"cilia-operator {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    serve = sub.add_parser("serve", help="run the operator")
    d = "(default: %(default)s)"
    serve.add_argument("--store", default="redis://127.0.0.1:6379/0",
                       help=f"store: redis://HOST:PORT/DB, or 'kubernetes' (CRDs via the API "
                       f"server, see --kubeconfig) {d}")  # fmt: skip
    serve.add_argument("--listen", default="127.0.0.1:4250",
                       help=f"gRPC listen address HOST:PORT or unix:PATH {d}")  # fmt: skip
    serve.add_argument("--prometheus-serve-addr", default=":9963",
                       help=f"metrics listen address [HOST]:PORT, '' disables {d}")  # fmt: skip
    serve.add_argument(
        "--auto-create-cilium-pod-ip-pools", action="append", default=[], metavar="SPEC",
        help="pools to create at start-up unless they exist: "
        "'<pool>=ipv4-cidrs:<c>[,<c>...];ipv4-mask-size:<n>[;allow-first-ip:<b>]"
        "[;allow-last-ip:<b>]'; several pools separated by spaces or by repeating the flag "
        "(default: none)",
    )  # fmt: skip
    serve.add_argument("--ipam-default-ip-pool", default="default",
                       help=f"pool agents allocate from by default {d}")  # fmt: skip
    serve.add_argument("--log-level", default="info",
                       choices=["debug", "info", "warning", "error"], help=d)  # fmt: skip
    serve.add_argument("--store-key-prefix", default="cilia/",
                       help=f"prefix of every Redis key {d}")  # fmt: skip
    serve.add_argument("--store-event-history", type=int, default=10000,
                       help=f"change events kept per kind for watches; a watcher further behind "
                       f"relists {d}")  # fmt: skip
    serve.add_argument("--store-watch-block-timeout", type=float, default=5.0,
                       help=f"seconds one blocking stream read waits {d}")  # fmt: skip
    serve.add_argument("--store-watch-batch-size", type=int, default=500,
                       help=f"max events read per watch round trip {d}")  # fmt: skip
    serve.add_argument("--store-connect-timeout", type=float, default=5.0,
                       help=f"seconds to connect to the store {d}")  # fmt: skip
    serve.add_argument("--store-request-timeout", type=float, default=10.0,
                       help=f"seconds to wait for a store reply {d}")  # fmt: skip
    serve.add_argument("--store-retry-interval", type=float, default=1.0,
                       help=f"seconds between retries after a store error {d}")  # fmt: skip
    serve.add_argument("--store-conflict-retries", type=int, default=5,
                       help=f"attempts of a write that hits a resourceVersion conflict {d}")  # fmt: skip
    serve.add_argument("--shutdown-grace-period", type=float, default=5.0,
                       help=f"seconds in-flight RPCs get on SIGTERM {d}")  # fmt: skip
    serve.add_argument("--identity-gc-interval", type=_duration, default="15m",
                       help=f"identity GC period (Go duration or seconds); 0 disables {d}")  # fmt: skip
    serve.add_argument("--identity-heartbeat-timeout", type=_duration, default="30m",
                       help=f"how long an identity nothing references lives on {d}")  # fmt: skip
    serve.add_argument("--identity-gc-rate-interval", type=_duration, default="1m",
                       help=f"window of --identity-gc-rate-limit {d}")  # fmt: skip
    serve.add_argument("--identity-gc-rate-limit", type=int, default=2500,
                       help=f"max identities deleted per --identity-gc-rate-interval {d}")  # fmt: skip
    serve.add_argument("--identity-max-id", type=int, default=65535,
                       help=f"largest cluster identity (allocation starts at 256) {d}")  # fmt: skip
    serve.add_argument("--watch-list-chunk-size", type=int, default=1000,
                       help=f"max events per message of a watch stream's initial listing {d}")  # fmt: skip
    serve.add_argument("--watch-buffer-size", type=int, default=1000,
                       help=f"changes buffered per watch stream before its store watch "
                       f"waits (it relists if it falls behind --store-event-history) {d}")  # fmt: skip
    serve.add_argument("--ipam", choices=["cluster-pool", "multi-pool"], default="multi-pool",
                       help=f"IPAM mode (upstream operator flag `ipam`; upstream's default is "
                       f"cluster-pool) {d}")  # fmt: skip
    serve.add_argument("--cluster-pool-ipv4-cidr", action="append", default=[], metavar="CIDR",
                       help="cluster-pool mode: CIDRs node blocks are carved from; repeat the "
                       "flag or separate with commas (default: none; required with "
                       "--ipam cluster-pool)")  # fmt: skip
    serve.add_argument("--cluster-pool-ipv4-mask-size", type=int, default=24,
                       help=f"cluster-pool mode: prefix length of each node's block {d}")  # fmt: skip
    serve.add_argument("--enable-cluster-pool-to-multi-pool-migration", action="store_true",
                       help="adopt every node's spec.ipam.podCIDRs into the default pool's "
                       "allocations before allocating (one-way; needs --ipam multi-pool) "
                       "(default: off)")  # fmt: skip
    serve.add_argument("--service-cluster-ip-range", action="append", default=None,
                       metavar="CIDR",
                       help="service CIDRs no pool may overlap; repeat or comma-separate "
                       "(default: 10.96.0.0/12, kube-apiserver's default)")  # fmt: skip
    serve.add_argument("--kubeconfig", default="",
                       help="--store kubernetes: kubeconfig file; '' = in-cluster config, else "
                       "$KUBECONFIG / ~/.kube/config (default: '')")  # fmt: skip
    serve.add_argument("--store-watch-timeout", type=int, default=300,
                       help=f"--store kubernetes: seconds one watch request lasts before it is "
                       f"reopened from the last seen resourceVersion {d}")  # fmt: skip
    serve.add_argument("--enable-leader-election", action="store_true",
                       help="run the leader-only controllers (IPAM allocation, migration, "
                       "identity GC) only while holding the leader lock: a Redis key or a "
                       "coordination.k8s.io Lease (default: off = always leader)")  # fmt: skip
    serve.add_argument("--leader-election-lease-duration", type=_duration, default="15s",
                       help=f"how long a leader's lock outlives its last renewal {d}")  # fmt: skip
    serve.add_argument("--leader-election-renew-deadline", type=_duration, default="10s",
                       help=f"the leader steps down when it could not renew for this long {d}")  # fmt: skip
    serve.add_argument("--leader-election-retry-period", type=_duration, default="2s",
                       help=f"interval of acquire/renew attempts {d}")  # fmt: skip
    serve.add_argument("--leader-election-lease-name", default="cilia-operator-resource-lock",
                       help=f"Lease name (kubernetes) / Redis key suffix {d}")  # fmt: skip
    serve.add_argument("--leader-election-lease-namespace", default="kube-system",
                       help=f"namespace of the Lease (--store kubernetes) {d}")  # fmt: skip
    serve.add_argument("--leader-election-id", default="",
                       help="this replica's identity in the lock (default: $POD_NAME or "
                       "hostname, plus a random suffix)")  # fmt: skip

    def client(p: argparse.ArgumentParser) -> None:
        p.add_argument("--server", default=DEFAULT_SERVER, help=f"operator address {d}")
        p.add_argument("--timeout", type=_positive_seconds, default=10.0,
                       help=f"seconds per request, > 0 {d}")  # fmt: skip

    apply = sub.add_parser("apply", help="create or update resources from a manifest")
    apply.add_argument(
        "-f", "--filename", required=True, help="manifest file (YAML/JSON), - = stdin"
    )
    apply.add_argument("--dry-run", action="store_true", help="validate and report only")
    client(apply)

    kinds = ("ciliumpodippools|cpip, ciliumnodes|cn, ciliumnetworkpolicies|cnp, "
             "networkpolicies|netpol, ciliumidentities|ciliumid, ciliumendpoints|cep")  # fmt: skip
    get = sub.add_parser("get", help="print resources as JSON or YAML")
    get.add_argument("kind", metavar="KIND", help=kinds)
    get.add_argument("name", metavar="NAME", nargs="?")
    get.add_argument("-n", "--namespace", default="default",
                     help=f"namespace of namespaced kinds {d}")  # fmt: skip
    get.add_argument("-A", "--all-namespaces", action="store_true",
                     help="list namespaced kinds in every namespace")  # fmt: skip
    get.add_argument("-o", "--output", choices=["json", "yaml"], default="json", help=d)
    client(get)

    delete = sub.add_parser("delete", help="delete one resource")
    delete.add_argument("kind", metavar="KIND", help=kinds)
    delete.add_argument("name", metavar="NAME")
    delete.add_argument("-n", "--namespace", default="default",
                        help=f"namespace of namespaced kinds {d}")  # fmt: skip
    client(delete)

    ipam = sub.add_parser("ipam", help="IPAM planning and status")
    ipam_sub = ipam.add_subparsers(dest="ipam_command", required=True, metavar="SUBCOMMAND")
    plan = ipam_sub.add_parser(
        "plan", help="blocks and pod IPs a pool CIDR gives; checked against the live cluster"
    )
    plan.add_argument("--cidr", action="append", required=True,
                      help="pool CIDR (repeat for several)")  # fmt: skip
    plan.add_argument("--mask-size", type=int, required=True, help="per-node block prefix")
    plan.add_argument("--allow-first-ip", action="store_true",
                      help="the first address of each block is usable (default: reserved)")  # fmt: skip
    plan.add_argument("--allow-last-ip", action="store_true",
                      help="the last address of each block is usable (default: reserved)")  # fmt: skip
    plan.add_argument("--pool", default="",
                      help="pool name the plan is for (an update of it is not an overlap) "
                      "(default: a new pool)")  # fmt: skip
    plan.add_argument("--service-cluster-ip-range", action="append", default=None,
                      help="extra service CIDR no pool CIDR may overlap (repeat, or a comma "
                      "list, for several) "
                      "(default: the live operator's --service-cluster-ip-range; offline "
                      "10.96.0.0/12)")  # fmt: skip
    plan.add_argument("--offline", action="store_true",
                      help="do not contact the operator (default: check against it when "
                      "reachable)")  # fmt: skip
    client(plan)
    status = ipam_sub.add_parser("status", help="pools, draining CIDRs, nodes, migration")
    status.add_argument("-o", "--output", choices=["text", "json"], default="text", help=d)
    client(status)
    return parser


def _positive_seconds(value: str) -> float:
    """argparse type: a finite number of seconds > 0."""
    try:
        seconds = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a number of seconds") from None
    if not math.isfinite(seconds) or seconds <= 0:
        raise argparse.ArgumentTypeError(f"{value!r} must be a finite number of seconds > 0")
    return seconds


def _duration(value: str) -> float:
    from cilia_common.durations import parse_duration

    try:
        return parse_duration(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _serve(args: argparse.Namespace) -> int:
    from cilia_common.logs import setup_logging

    from .app import StartupError, run
    from .config import Config

    try:
        config = Config(
            store=args.store,
            listen=args.listen,
            prometheus_serve_addr=args.prometheus_serve_addr,
            auto_create_cilium_pod_ip_pools=args.auto_create_cilium_pod_ip_pools,
            ipam_default_ip_pool=args.ipam_default_ip_pool,
            log_level=args.log_level,
            store_key_prefix=args.store_key_prefix,
            store_event_history=args.store_event_history,
            store_watch_block_timeout=args.store_watch_block_timeout,
            store_watch_batch_size=args.store_watch_batch_size,
            store_connect_timeout=args.store_connect_timeout,
            store_request_timeout=args.store_request_timeout,
            store_retry_interval=args.store_retry_interval,
            store_conflict_retries=args.store_conflict_retries,
            shutdown_grace_period=args.shutdown_grace_period,
            identity_gc_interval=args.identity_gc_interval,
            identity_heartbeat_timeout=args.identity_heartbeat_timeout,
            identity_gc_rate_interval=args.identity_gc_rate_interval,
            identity_gc_rate_limit=args.identity_gc_rate_limit,
            identity_max_id=args.identity_max_id,
            watch_list_chunk_size=args.watch_list_chunk_size,
            watch_buffer_size=args.watch_buffer_size,
            ipam=args.ipam,
            cluster_pool_ipv4_cidr=args.cluster_pool_ipv4_cidr,
            cluster_pool_ipv4_mask_size=args.cluster_pool_ipv4_mask_size,
            enable_cluster_pool_to_multi_pool_migration=(
                args.enable_cluster_pool_to_multi_pool_migration
            ),
            kubeconfig=args.kubeconfig,
            store_watch_timeout=args.store_watch_timeout,
            enable_leader_election=args.enable_leader_election,
            leader_election_lease_duration=args.leader_election_lease_duration,
            leader_election_renew_deadline=args.leader_election_renew_deadline,
            leader_election_retry_period=args.leader_election_retry_period,
            leader_election_lease_name=args.leader_election_lease_name,
            leader_election_lease_namespace=args.leader_election_lease_namespace,
            leader_election_id=args.leader_election_id,
            **(
                {"service_cluster_ip_range": args.service_cluster_ip_range}
                if args.service_cluster_ip_range is not None
                else {}
            ),
        )
    except ValidationError as exc:
        err = exc.errors(include_url=False)[0]
        where = "--" + str(err["loc"][0]).replace("_", "-") if err["loc"] else ""
        msg = err["msg"].removeprefix("Value error, ")
        print(f"cilia-operator: {msg if msg.startswith('--') else f'{where}: {msg}'}",
              file=sys.stderr)  # fmt: skip
        return 2
    setup_logging("cilia-operator", config.log_level)
    try:
        return asyncio.run(run(config))
    except StartupError as exc:
        print(f"cilia-operator: {exc}", file=sys.stderr)
        return 2


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``cilia-operator`` console script; returns the exit status."""
    args = build_parser().parse_args(argv)
    if args.command == "serve":
        return _serve(args)
    from . import cli

    try:
        if args.command == "apply":
            cli.apply(args.filename, args.server, args.dry_run, args.timeout, sys.stdout)
        elif args.command == "ipam" and args.ipam_command == "plan":
            problems = cli.ipam_plan(
                args.cidr, args.mask_size, args.allow_first_ip, args.allow_last_ip,
                None if args.offline else args.server, args.timeout, sys.stdout, pool=args.pool,
                service_cidrs=(
                    tuple(args.service_cluster_ip_range) if args.service_cluster_ip_range else None
                ),
            )  # fmt: skip
            sys.stdout.flush()  # a closed pipe fails here, inside the handler below
            return 1 if problems else 0
        elif args.command == "ipam":
            cli.ipam_status(args.server, args.timeout, sys.stdout, output=args.output)
        elif args.command == "get":
            namespace = None if args.all_namespaces else args.namespace
            cli.get(args.kind, args.name, args.output, args.server, args.timeout, sys.stdout,
                    namespace=namespace)  # fmt: skip
        else:
            cli.delete(args.kind, args.name, args.server, args.timeout, sys.stdout,
                       namespace=args.namespace)  # fmt: skip
        sys.stdout.flush()
    except cli.CommandError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return cli.EXIT_ERROR
    except BrokenPipeError:
        # the reader (``| head``) went away: exit quietly, stdout is useless now
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
