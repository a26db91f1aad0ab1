"""``python -m cilia_kubemock [--host H] [--port P] [--kubeconfig PATH]``: serve until killed."""

from __future__ import annotations

import argparse
import asyncio
import pathlib

from .pytest_fixtures import write_kubeconfig
from .server import KubeMock


def main() -> None:
    """Run a mock API server in the foreground, printing its URL on stdout."""
    parser = argparse.ArgumentParser(prog="python -m cilia_kubemock")
    parser.add_argument("--host", default="127.0.0.1", help="listen address (default: %(default)s)")
    parser.add_argument("--port", type=int, default=0, help="port, 0 = free (default: %(default)s)")
    parser.add_argument("--kubeconfig", default="", help="write a kubeconfig here (default: none)")
    parser.add_argument("--pod-termination-delay", type=float, default=0.0,
                        help="seconds a deleted pod stays terminating (default: %(default)s)")  # fmt: skip
    parser.add_argument("--event-history", type=int, default=1000,
                        help="change events kept for watches (default: %(default)s)")  # fmt: skip
    args = parser.parse_args()

    async def serve() -> None:
        mock = KubeMock(
            host=args.host,
            port=args.port,
            pod_termination_delay=args.pod_termination_delay,
            event_history=args.event_history,
        )
        url = await mock.start_async()
        if args.kubeconfig:
            write_kubeconfig(url, pathlib.Path(args.kubeconfig))
        print(url, flush=True)
        await asyncio.Event().wait()

    asyncio.run(serve())


if __name__ == "__main__":
    main()
