"""``cilia-relay observe``: stream flows from a relay (or an agent) like ``hubble observe``.

Builds a ``GetFlowsRequest`` (whitelist from :mod:`cilia_relay.cli.filters`,
``number`` = ``--last`` or 20 when neither ``--last`` nor ``--follow`` is given, as
hubble), calls ``observer.Observer/GetFlows`` on ``--server`` and prints each
response with :mod:`cilia_relay.cli.printer`.

Exit status: 0 when the stream ends (or on Ctrl-C / a closed pipe), 1 when the
server cannot be reached or the call fails (one line on stderr); bad flags are
refused by the caller with status 2.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TextIO

import grpc

from cilia.hubble.observer import observer_pb2, observer_pb2_grpc
from cilia_relay.cli import printer
from cilia_relay.cli.filters import build_whitelist
from cilia_relay.config import dial_target

DEFAULT_SERVER = "localhost:4245"
DEFAULT_LAST = 20
"""Flows asked for when neither --last nor --follow is given (hubble's default)."""
DEFAULT_TIMEOUT_SECONDS = 5.0

EXIT_OK = 0
EXIT_FAILED = 1


class ServerUnavailable(RuntimeError):
    """The server could not be reached (no connection within the timeout or UNAVAILABLE)."""


class ObserveFailed(RuntimeError):
    """The server answered GetFlows with an error status other than UNAVAILABLE."""


@dataclass(frozen=True)
class ObserveOptions:
    """What ``observe`` was asked for.

    Attributes:
        server: relay/agent address (``host:port``, ``:port`` or ``unix:/path``).
        filters: ``[(flag, value), ...]`` filter flags in command-line order.
        last: ``--last`` (0 = not given).
        follow: ``--follow``.
        output: ``compact`` or ``json``.
        timeout: seconds to wait for the connection.
    """

    server: str = DEFAULT_SERVER
    filters: Sequence[tuple[str, str]] = ()
    last: int = 0
    follow: bool = False
    output: str = "compact"
    timeout: float = DEFAULT_TIMEOUT_SECONDS


def build_request(options: ObserveOptions) -> observer_pb2.GetFlowsRequest:
    """The GetFlowsRequest for ``options``.

    Raises:
        cilia_relay.cli.filters.FilterError: a filter flag is invalid.
    """
    number = options.last
    if number == 0 and not options.follow:
        number = DEFAULT_LAST
    return observer_pb2.GetFlowsRequest(
        number=number, follow=options.follow, whitelist=build_whitelist(options.filters)
    )


def _write(response: observer_pb2.GetFlowsResponse, output: str, out: TextIO, err: TextIO) -> None:
    kind = response.WhichOneof("response_types")
    if kind == "flow":
        out.write(
            (
                printer.format_json(response)
                if output == "json"
                else printer.format_compact(response.flow)
            )
            + "\n"
        )
    elif kind == "node_status":
        line = printer.format_node_status(response)
        if line is not None:
            err.write((printer.format_json(response) if output == "json" else line) + "\n")
            err.flush()
    elif kind == "lost_events":
        if output == "json":
            out.write(printer.format_json(response) + "\n")
        else:
            err.write(printer.format_lost(response) + "\n")


def observe(options: ObserveOptions, out: TextIO, err: TextIO) -> int:
    """Run one GetFlows call and print it; returns the exit status.

    Raises:
        ServerUnavailable: no connection to ``options.server`` within ``options.timeout``,
            or the server reported UNAVAILABLE.
        ObserveFailed: the call ended with another error status.
        cilia_relay.cli.filters.FilterError: a filter flag is invalid.
    """
    request = build_request(options)
    with grpc.insecure_channel(dial_target(options.server)) as channel:
        try:
            grpc.channel_ready_future(channel).result(timeout=options.timeout)
        except grpc.FutureTimeoutError as exc:
            raise ServerUnavailable(
                f"cannot connect to {options.server} within {options.timeout:g}s "
                "(is cilia-relay serve running there?)"
            ) from exc
        stub = observer_pb2_grpc.ObserverStub(channel)  # type: ignore[no-untyped-call]
        stream = stub.GetFlows(request)
        try:
            for response in stream:
                _write(response, options.output, out, err)
                if options.follow:
                    out.flush()
        except grpc.RpcError as exc:
            code = exc.code() if hasattr(exc, "code") else None
            details = exc.details() if hasattr(exc, "details") else str(exc)
            if code == grpc.StatusCode.UNAVAILABLE:
                raise ServerUnavailable(f"{options.server} unavailable: {details}") from exc
            name = code.name if code is not None else "UNKNOWN"
            raise ObserveFailed(f"GetFlows on {options.server} failed: {name}: {details}") from exc
        finally:
            stream.cancel()
    out.flush()
    return EXIT_OK


def run(options: ObserveOptions) -> int:
    """``observe`` with the boundary's error handling: one line on stderr, exit 1."""
    try:
        return observe(options, sys.stdout, sys.stderr)
    except (ServerUnavailable, ObserveFailed) as exc:
        print(f"cilia-relay observe: {exc}", file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt:
        return EXIT_OK
    except BrokenPipeError:
        # The reader went away (`| head`): not an error for a streaming command.
        return EXIT_OK
