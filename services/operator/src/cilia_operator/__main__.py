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
                     [--tls-cert-file F --tls-key-file F --tls-client-ca-files F | --disable-tls]
                     [--grpc-health-listen ADDR]
cilia-operator apply -f FILE [--server ADDR] [--dry-run]
cilia-operator get KIND [NAME] [-n NAMESPACE | -A] [-o json|yaml] [--server ADDR]
cilia-operator delete KIND NAME [-n NAMESPACE] [--server ADDR]
cilia-operator delete -f FILE | KIND -l SELECTOR [-n NAMESPACE] [--server ADDR]
cilia-operator ipam plan --cidr CIDR --mask-size N [--allow-first-ip] [--allow-last-ip]
                         [--pool NAME] [--service-cluster-ip-range CIDR] [--server ADDR | --offline]
cilia-operator ipam status [-o text|json] [--server ADDR]
cilia-operator servicecidr migrate --to CIDR [--dry-run] [--alias-grace-period DURATION]
                                   [--wait-timeout SECONDS] [--server ADDR]
cilia-operator servicecidr migrate --kubernetes --to CIDR [--dry-run] [--apiserver-updated]
                                   [--alias-grace-period DURATION] [--node-network CIDR]
                                   [--k8s-kubeconfig-path PATH] [--settle S] [--lease-duration S]
cilia-operator servicecidr status [-o text|json] [--server ADDR]
cilia-operator servicecidr status --kubernetes [--k8s-kubeconfig-path PATH]
cilia-operator certs generate --dir DIR [--nodes N1,N2] [--hosts ADDR,...] [--admins NAMES]
                              [--days N]
cilia-operator --version

Client commands take --tls-operator-server-ca-files, --tls-operator-client-cert-file,
--tls-operator-client-key-file [--tls-operator-server-name] for an operator with mutual TLS.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Sequence

from cilia_common.durations import duration_arg, go_duration_arg
from cilia_common.flags import (
    EXIT_USAGE,
    FlagError,
    add_model_flags,
    config_from_args,
    require_all_or_none,
)
from cilia_common.tls import ClientTLS

from . import __version__
from .config import Config

DEFAULT_SERVER = "127.0.0.1:4250"


def build_parser() -> argparse.ArgumentParser:
    """The full command-line parser (every flag with its documented default)."""
    parser = argparse.ArgumentParser(
        prog="cilia-operator", description="Cilia operator: cluster state and multi-pool IPAM."
    )
    parser.add_argument("--version", action="version", version=f"cilia-operator {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    serve = sub.add_parser("serve", help="run the operator")
    add_model_flags(serve, Config)  # every flag, help, default and range from config.Config

    d = "(default: %(default)s)"

    def client(p: argparse.ArgumentParser) -> None:
        p.add_argument("--server", default=DEFAULT_SERVER, help=f"operator address {d}")
        p.add_argument("--timeout", type=duration_arg(positive=True), default=10.0,
                       help=f"seconds per request, > 0 {d}")  # fmt: skip
        add_client_tls_flags(p)

    apply = sub.add_parser("apply", help="create or update resources from a manifest")
    apply.add_argument(
        "-f", "--filename", required=True, help="manifest file (YAML/JSON), - = stdin"
    )
    apply.add_argument("--dry-run", action="store_true", help="validate and report only")
    client(apply)

    kinds = ("ciliumpodippools|cpip, ciliumnodes|cn, ciliumnetworkpolicies|cnp, "
             "ciliumclusterwidenetworkpolicies|ccnp, networkpolicies|netpol, "
             "ciliumidentities|ciliumid, ciliumendpoints|cep, namespaces|ns, "
             "services|svc, endpointslices, servicecidrs, "
             "ciliaservicecidrmigrations|cscm")  # fmt: skip
    get = sub.add_parser("get", help="print resources as JSON or YAML")
    get.add_argument("kind", metavar="KIND", help=kinds)
    get.add_argument("name", metavar="NAME", nargs="?")
    get.add_argument("-n", "--namespace", default="default",
                     help=f"namespace of namespaced kinds {d}")  # fmt: skip
    get.add_argument("-A", "--all-namespaces", action="store_true",
                     help="list namespaced kinds in every namespace")  # fmt: skip
    get.add_argument("-o", "--output", choices=["json", "yaml"], default="json", help=d)
    client(get)

    delete = sub.add_parser(
        "delete",
        help="delete one resource, every object of a manifest (-f), or every object "
        "of a kind whose labels match (-l); -f and -l: all or nothing",
    )
    delete.add_argument("kind", metavar="KIND", nargs="?", default="", help=kinds)
    delete.add_argument("name", metavar="NAME", nargs="?", default="")
    delete.add_argument("-f", "--filename", default="",
                        help="manifest whose objects to delete ('-' = stdin)")  # fmt: skip
    delete.add_argument("-l", "--selector", default="",
                        help="label selector (k=v, k!=v, k, !k; ',' = and) with KIND")  # fmt: skip
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
    plan.add_argument("--ipam-default-ip-pool", default="default",
                      help="the operator's default pool (a /32 mask is refused for it "
                      "only, as apply does) (default: default)")  # fmt: skip
    plan.add_argument("--service-cluster-ip-range", action="append", default=None,
                      help="extra service CIDR no pool CIDR may overlap (repeat, or a comma "
                      "list, for several) "
                      "(default: the live operator's --service-cluster-ip-range; offline "
                      "10.96.0.0/12)")  # fmt: skip
    plan.add_argument("--offline", action="store_true",
                      help="do not contact the operator (default: check against it when "
                      "reachable)")  # fmt: skip
    client(plan)
    svc_cidr = sub.add_parser("servicecidr", help="Service ranges (networking.k8s.io ServiceCIDR)")
    svc_sub = svc_cidr.add_subparsers(dest="servicecidr_command", required=True,
                                      metavar="SUBCOMMAND")  # fmt: skip
    migrate = svc_sub.add_parser(
        "migrate",
        help="move every Service to an address in a new range while the old addresses keep "
        "working as aliases until unused (prints the plan, then each move)",
    )
    migrate.add_argument("--to", required=True, help="the new Service range (IPv4 CIDR)")
    migrate.add_argument("--dry-run", action="store_true", help="print the plan, change nothing")
    migrate.add_argument("--alias-grace-period", default=None, type=go_duration_arg,
                         help="an old ClusterIP is served until no connection used it for "
                         "this long (Go duration) (default: the operator's "
                         "--service-alias-grace-period, 1h unless set)")  # fmt: skip
    migrate.add_argument("--wait-timeout", type=duration_arg(positive=True), default=600.0,
                         help=f"seconds to follow the moves at most; the operator goes on "
                         f"after it {d}")  # fmt: skip
    migrate.add_argument("--kubernetes", action="store_true",
                         help="the cluster runs --store kubernetes: carry the migration out "
                         "through the Kubernetes API (re-creating each Service) instead of "
                         "the operator's store")  # fmt: skip
    migrate.add_argument("--k8s-kubeconfig-path", default="",
                         help="with --kubernetes: kubeconfig (default: in-cluster, else "
                         "$KUBECONFIG / ~/.kube/config)")  # fmt: skip
    migrate.add_argument("--apiserver-updated", action="store_true",
                         help="with --kubernetes: every kube-apiserver now runs with the new "
                         "--service-cluster-ip-range: re-create default/kubernetes")  # fmt: skip
    migrate.add_argument("--node-network", action="append", default=[],
                         help="with --kubernetes: a node network (CIDR) the new range may not "
                         "overlap, besides every Node's address (repeat for several)")  # fmt: skip
    migrate.add_argument("--settle", type=duration_arg(positive=True), default=1.0,
                         help="with --kubernetes: seconds given to the operator and agents to "
                         f"see a change before the next step {d}")  # fmt: skip
    migrate.add_argument("--endpoints-timeout", type=duration_arg(positive=True), default=30.0,
                         help="with --kubernetes: seconds a re-created Service's own "
                         f"EndpointSlices may take to list its endpoints {d}")  # fmt: skip
    migrate.add_argument("--lease-duration", type=duration_arg(positive=True), default=15.0,
                         help="with --kubernetes: seconds this run's Lease stays valid "
                         f"without renewal (a second run is refused meanwhile) {d}")  # fmt: skip
    client(migrate)
    svc_status = svc_sub.add_parser(
        "status", help="the migration: per Service old/new ClusterIP, alias last use, released; "
        "the ServiceCIDRs and their state",
    )  # fmt: skip
    svc_status.add_argument("-o", "--output", choices=["text", "json"], default="text", help=d)
    svc_status.add_argument(
        "--kubernetes",
        action="store_true",
        help="read the Kubernetes API (a --store kubernetes cluster)",
    )
    svc_status.add_argument("--k8s-kubeconfig-path", default="",
                            help="with --kubernetes: kubeconfig (default: in-cluster, else "
                            "$KUBECONFIG / ~/.kube/config)")  # fmt: skip
    client(svc_status)
    certs = sub.add_parser("certs", help="certificates of the control plane (mutual TLS)")
    certs_sub = certs.add_subparsers(dest="certs_command", required=True, metavar="SUBCOMMAND")
    gen = certs_sub.add_parser(
        "generate",
        help="write a CA, the operator's server certificate, one client certificate per node "
        "(CN=system:node:<node>, O=system:nodes) and admin ones (O=system:masters)",
    )
    gen.add_argument("--dir", required=True, help="output directory (ca.crt/ca.key reused)")
    gen.add_argument("--nodes", default="",
                     help="comma-separated node names (default: none; standalone mode only: in "
                     "Kubernetes agents present their kubelet's client certificate)")  # fmt: skip
    gen.add_argument("--hosts", default="127.0.0.1,localhost",
                     help=f"comma-separated addresses/names agents dial the operator at: the "
                     f"server certificate's SANs {d}")  # fmt: skip
    gen.add_argument("--admins", default="admin",
                     help=f"comma-separated admin client names {d}")  # fmt: skip
    gen.add_argument("--hubble-cluster", default=None, metavar="CLUSTER",
                     help="also write Hubble's: a server certificate per node named "
                     "<node>.<CLUSTER>.hubble-grpc.cilium.io (agents' --hubble-tls-*), the "
                     "relay's client and server pairs, hubble-ui's client pair "
                     "(default: none)")  # fmt: skip
    gen.add_argument("--days", type=_cert_days, default=365.0,
                     help=f"validity of the server and client certificates in days, at most "
                     f"{CERT_DAYS_MAX}; the CA gets ten times as long {d}")  # fmt: skip
    status = ipam_sub.add_parser("status", help="pools, draining CIDRs, nodes, migration")
    status.add_argument("-o", "--output", choices=["text", "json"], default="text", help=d)
    client(status)
    return parser


def add_client_tls_flags(p: argparse.ArgumentParser) -> None:
    """The client-side mutual-TLS flags (upstream relay's ``--tls-hubble-*`` naming)."""
    p.add_argument("--tls-operator-server-ca-files", default="", metavar="PATHS",
                   help="comma-separated PEM CA bundles the operator's certificate must chain "
                   "to; with the client certificate and key: mutual TLS (default: plaintext)")  # fmt: skip
    p.add_argument("--tls-operator-client-cert-file", default="", metavar="PATH",
                   help="PEM client certificate (an admin's, O=system:masters, to apply/delete)")  # fmt: skip
    p.add_argument("--tls-operator-client-key-file", default="", metavar="PATH",
                   help="PEM private key of the client certificate")  # fmt: skip
    p.add_argument("--tls-operator-server-name", default="", metavar="NAME",
                   help="name the operator's certificate must carry (default: the --server host)")  # fmt: skip


def _client_tls(args: argparse.Namespace) -> ClientTLS | None:
    """The ClientTLS of the flags, None without them.

    Raises:
        FlagError: some but not all of CA, certificate and key given.
    """
    cas = tuple(_split(args.tls_operator_server_ca_files))
    files = {
        "--tls-operator-server-ca-files": cas,
        "--tls-operator-client-cert-file": args.tls_operator_client_cert_file,
        "--tls-operator-client-key-file": args.tls_operator_client_key_file,
    }
    try:
        require_all_or_none(files)
    except ValueError as exc:
        raise FlagError("", str(exc)) from None
    if not cas:
        return None
    return ClientTLS(cas, args.tls_operator_client_cert_file, args.tls_operator_client_key_file,
                     args.tls_operator_server_name)  # fmt: skip


def _split(text: str) -> list[str]:
    """A comma-separated flag value as its non-empty items."""
    return [x.strip() for x in text.split(",") if x.strip()]


#: longest --days of ``certs generate``: 100 years, so the CA's ten times as long still ends
#: well before X.509's last date (9999-12-31) instead of overflowing Python's datetime
CERT_DAYS_MAX = 36500


def _cert_days(value: str) -> float:
    """argparse type: a finite number of days in (0, :data:`CERT_DAYS_MAX`]."""
    try:
        days = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a number of days") from None
    if not math.isfinite(days) or not 0 < days <= CERT_DAYS_MAX:
        raise argparse.ArgumentTypeError(
            f"{value!r} must be a number of days > 0 and <= {CERT_DAYS_MAX}"
        )
    return days


def _serve(args: argparse.Namespace) -> int:
    from cilia_common.logs import setup_logging
    from cilia_common.runtime import run_bounded

    from .app import StartupError, run

    try:
        config = config_from_args(Config, args)
    except FlagError as exc:
        print(f"cilia-operator: {exc}", file=sys.stderr)
        return EXIT_USAGE
    setup_logging("cilia-operator", config.log_level)
    try:
        # bounded end: a task that ignores its cancellation must not keep the process alive
        return run_bounded(run(config), teardown_timeout=config.shutdown_timeout)
    except StartupError as exc:
        print(f"cilia-operator: {exc}", file=sys.stderr)
        return EXIT_USAGE


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``cilia-operator`` console script; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "serve":
        return _serve(args)
    from . import cli

    tls = None
    try:
        if args.command != "certs":
            tls = _client_tls(args)
    except FlagError as exc:
        print(f"cilia-operator: {exc}", file=sys.stderr)
        return EXIT_USAGE
    try:
        if args.command == "certs":
            cli.certs_generate(args.dir, _split(args.hosts), _split(args.nodes),
                               _split(args.admins), args.days, sys.stdout,
                               hubble_cluster=args.hubble_cluster)  # fmt: skip
        elif args.command == "apply":
            cli.apply(args.filename, args.server, args.dry_run, args.timeout, sys.stdout, tls=tls)
        elif args.command == "ipam" and args.ipam_command == "plan":
            problems = cli.ipam_plan(
                args.cidr, args.mask_size, args.allow_first_ip, args.allow_last_ip,
                None if args.offline else args.server, args.timeout, sys.stdout, pool=args.pool,
                service_cidrs=(
                    tuple(args.service_cluster_ip_range) if args.service_cluster_ip_range else None
                ), tls=tls, default_pool=args.ipam_default_ip_pool,
            )  # fmt: skip
            sys.stdout.flush()  # a closed pipe fails here, inside the handler below
            return 1 if problems else 0
        elif args.command == "servicecidr" and args.servicecidr_command == "status" and \
                args.kubernetes:  # fmt: skip
            cli.servicecidr_status_k8s(sys.stdout, kubeconfig=args.k8s_kubeconfig_path)
        elif args.command == "servicecidr" and args.kubernetes:
            cli.servicecidr_migrate_k8s(
                args.to, args.dry_run, args.alias_grace_period, sys.stdout,
                kubeconfig=args.k8s_kubeconfig_path, apiserver_updated=args.apiserver_updated,
                node_networks=tuple(args.node_network), settle=args.settle,
                endpoints_timeout=args.endpoints_timeout, lease_duration=args.lease_duration,
                wait_timeout=args.wait_timeout, request_timeout=args.timeout,
            )  # fmt: skip
        elif args.command == "servicecidr" and args.servicecidr_command == "status":
            cli.servicecidr_status(args.server, args.timeout, sys.stdout, output=args.output,
                                   tls=tls)  # fmt: skip
        elif args.command == "servicecidr":
            cli.servicecidr_migrate(args.to, args.dry_run, args.alias_grace_period, args.server,
                                    args.timeout, sys.stdout, tls=tls,
                                    wait_timeout=args.wait_timeout)  # fmt: skip
        elif args.command == "ipam":
            cli.ipam_status(args.server, args.timeout, sys.stdout, output=args.output, tls=tls)
        elif args.command == "get":
            namespace = None if args.all_namespaces else args.namespace
            cli.get(args.kind, args.name, args.output, args.server, args.timeout, sys.stdout,
                    namespace=namespace, tls=tls)  # fmt: skip
        elif args.filename or args.selector:
            if args.filename and (args.kind or args.selector):
                parser.error("delete -f FILE takes no KIND, NAME or -l")
            if args.selector and (not args.kind or args.name):
                parser.error("delete -l SELECTOR takes a KIND and no NAME")
            cli.delete_many(args.server, args.timeout, sys.stdout, filename=args.filename,
                            kind=args.kind, selector=args.selector, namespace=args.namespace,
                            tls=tls)  # fmt: skip
        else:
            if not args.kind or not args.name:
                parser.error("delete takes KIND NAME, -f FILE, or KIND -l SELECTOR")
            cli.delete(args.kind, args.name, args.server, args.timeout, sys.stdout,
                       namespace=args.namespace, tls=tls)  # fmt: skip
        sys.stdout.flush()
    except cli.CommandError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return cli.EXIT_ERROR
    except KeyboardInterrupt:
        # Ctrl-C stops this client only: what the operator was told stays told
        if args.command == "servicecidr" and args.servicecidr_command == "migrate":
            print("\ninterrupted: the operator carries on with a migration it has started; "
                  "follow it with 'cilia-operator servicecidr status'", file=sys.stderr)  # fmt: skip
        else:
            print("\ninterrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # the reader (``| head``) went away: exit quietly, stdout is useless now
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
