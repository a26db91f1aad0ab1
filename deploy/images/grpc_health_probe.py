"""``cilia-grpc-health-probe``: exit 0 when a gRPC server reports SERVING (image HEALTHCHECKs).

Installed into every service image as ``/opt/cilia/bin/cilia-grpc-health-probe`` (see
``services/*/Dockerfile``); the Docker HEALTHCHECK and the compose file run it. Kubernetes
uses its native ``grpc`` probes instead.

    cilia-grpc-health-probe [ADDRESS] [--service NAME] [--timeout SECONDS]

ADDRESS is ``host:port`` or ``unix:/path``; default ``$CILIA_HEALTH_ADDRESS``. The service
name defaults to ``""`` (the server's overall status, grpc.health.v1). Exit codes: 0 SERVING,
1 any other status, 2 usage error, 3 no answer within the timeout (default 3 s).
"""

from __future__ import annotations

import argparse
import os
import sys


def main(argv: list[str] | None = None) -> int:
    """Run one ``grpc.health.v1.Health/Check``; return the exit code described above."""
    ap = argparse.ArgumentParser(prog="cilia-grpc-health-probe")
    ap.add_argument("address", nargs="?", default=os.environ.get("CILIA_HEALTH_ADDRESS", ""))
    ap.add_argument("--service", default="", help="service name to check (default: '')")
    ap.add_argument("--timeout", type=float, default=3.0, help="seconds (default 3)")
    ns = ap.parse_args(argv)
    if not ns.address:
        print(
            "cilia-grpc-health-probe: no address (argument or CILIA_HEALTH_ADDRESS)",
            file=sys.stderr,
        )
        return 2
    from cilia_common.health import check

    answer = check(ns.address, service=ns.service, timeout=ns.timeout)
    if answer.error:
        print(f"{ns.address}: {answer.error}", file=sys.stderr)
        return 3
    print(f"{ns.address}: {answer.status}")
    return 0 if answer.serving else 1


if __name__ == "__main__":
    sys.exit(main())
