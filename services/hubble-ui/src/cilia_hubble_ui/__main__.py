"""Command line of ``cilia-hubble-ui``: argument parsing only.

* ``cilia-hubble-ui --version`` prints ``cilia-hubble-ui <version>``.
* ``cilia-hubble-ui serve [flags]`` serves the service map (:mod:`cilia_hubble_ui.app`);
  flags and defaults are the fields of :class:`cilia_hubble_ui.config.Config`.

Bad flags exit 2 with one line on stderr; a start that cannot succeed (address in use, TLS
file unusable, the page's vendored files missing) exits 1 with one line on stderr.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import NoReturn

from cilia_common.flags import EXIT_USAGE, FlagError, add_model_flags, config_from_args
from cilia_hubble_ui import __version__
from cilia_hubble_ui.config import Config

COMPONENT = "cilia-hubble-ui"


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line: ``cilia-hubble-ui <cmd>: error: ...``."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    """Return the argument parser (``--version``, ``serve``)."""
    parser = _Parser(prog=COMPONENT, description="Cilia Hubble UI: a live service map")
    parser.add_argument("--version", action="version", version=f"{COMPONENT} {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    serve = sub.add_parser("serve", help="serve the service map page")
    add_model_flags(serve, Config)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``cilia-hubble-ui`` console script; returns the exit status."""
    from cilia_common.grpcserver import BindError as MetricsBindError
    from cilia_common.logs import setup_logging
    from cilia_common.tls import TLSFileError
    from cilia_hubble_ui import app
    from cilia_hubble_ui.web import MissingAsset

    args = build_parser().parse_args(argv)
    try:
        config = config_from_args(Config, args)
    except FlagError as exc:
        print(f"{COMPONENT} serve: {exc}", file=sys.stderr)
        return EXIT_USAGE
    setup_logging(COMPONENT, config.log_level)
    try:
        app.run(config)
    except (app.BindError, MetricsBindError) as exc:
        print(f"{COMPONENT}: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except (TLSFileError, MissingAsset) as exc:
        print(f"{COMPONENT}: cannot start: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
