"""One duration grammar for every Cilia command line.

Go's ``time.ParseDuration`` grammar, as upstream's duration flags take it (``300ms``,
``1.5s``, ``2m30s``, ``1h``; units ``ns us µs ms s m h``; ``0`` without a unit), restricted
to non-negative values, plus -- unless the caller asks for Go's strictness -- a bare
non-negative number meaning seconds (``0.5``, ``10``), which several existing flags accept.

Source: Go ``time.ParseDuration`` (sign, ``[0-9]*(\\.[0-9]*)?`` + unit, repeated; a bare
``0`` is the only number without a unit).
"""

from __future__ import annotations

import argparse
import math
import re
from collections.abc import Callable

__all__ = ["duration_arg", "format_seconds", "go_duration_arg", "parse_duration"]

_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|μs|ms|s|m|h)")
_UNIT_SECONDS = {
    "ns": 1e-9,
    "us": 1e-6,
    "µs": 1e-6,  # U+00B5 micro sign
    "μs": 1e-6,  # U+03BC Greek mu, which Go accepts too
    "ms": 1e-3,
    "s": 1.0,
    "m": 60.0,
    "h": 3600.0,
}
_NUMBER = re.compile(r"(\d+(?:\.\d*)?|\.\d+)")


def parse_duration(text: str, *, flag: str = "", bare_seconds: bool = True) -> float:
    """``text`` as a non-negative number of seconds.

    Args:
        text: a Go duration (``"300ms"``, ``"1.5s"``, ``"2m30s"``, ``"1h"``, ``"0"``) or,
            with ``bare_seconds``, a plain non-negative number of seconds (``"0.5"``).
            Surrounding whitespace is ignored.
        flag: the flag the value came from (``"--dial-timeout"``), put first in errors.
        bare_seconds: accept a plain number as seconds. False gives Go's grammar exactly
            (only ``"0"`` may lack a unit), as upstream hubble-relay's flags.

    Returns:
        seconds, a finite float >= 0.

    Raises:
        ValueError: ``"--flag: '1d' is not a duration (e.g. 15m, 30s, 500ms, 1h30m)"`` --
            empty, an unknown unit, a sign, spaces inside, or not finite.
    """
    prefix = f"{flag}: " if flag else ""
    value = text.strip()
    if value.startswith("-") and value != "-":
        raise ValueError(f"{prefix}{text!r} is negative: a duration must be >= 0")
    seconds: float | None = None
    if value == "0" or (bare_seconds and _NUMBER.fullmatch(value)):
        seconds = float(value)
    else:
        pos, total = 0, 0.0
        for match in _PART.finditer(value):
            if match.start() != pos:
                break
            total += float(match.group(1)) * _UNIT_SECONDS[match.group(2)]
            pos = match.end()
        if value and pos == len(value):
            seconds = total
    if seconds is None or not math.isfinite(seconds):
        example = "e.g. 15m, 30s, 500ms, 1h30m" + (" or seconds" if bare_seconds else "")
        raise ValueError(f"{prefix}{text!r} is not a duration ({example})")
    return seconds


def duration_arg(*, bare_seconds: bool = True, positive: bool = False) -> Callable[[str], float]:
    """An argparse ``type=`` for a duration flag of a hand-written parser (flags generated
    from a config model get the same through :mod:`cilia_common.flags`): the value as seconds
    by :func:`parse_duration`.

    Args:
        bare_seconds: accept a plain number as seconds (``"10"``, ``"0.5"``).
        positive: refuse 0 as well (a timeout that must be able to pass).

    Returns:
        the converter; it raises ``argparse.ArgumentTypeError`` with the grammar's message
        (argparse prints it after the flag's name and exits 2).
    """

    def convert(text: str) -> float:
        try:
            seconds = parse_duration(text, bare_seconds=bare_seconds)
        except ValueError as exc:
            why = str(exc)
            if positive and text.strip().startswith("-"):
                why = f"{text!r} is negative: it must be a duration > 0"
            raise argparse.ArgumentTypeError(why) from None
        if positive and seconds <= 0:
            raise argparse.ArgumentTypeError(f"{text!r} must be a duration > 0")
        return seconds

    convert.__name__ = "duration"  # argparse names the type in "invalid duration value"
    return convert


def go_duration_arg(text: str) -> str:
    """An argparse ``type=`` for a value passed on as a Go duration string (an annotation,
    another program's flag): checked with Go's grammar exactly (:func:`parse_duration` with
    ``bare_seconds=False``) and returned as given.

    Raises:
        argparse.ArgumentTypeError: not a Go duration.
    """
    try:
        parse_duration(text, bare_seconds=False)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def format_seconds(seconds: float) -> str:
    """``seconds`` as the shortest Go-style duration that parses back to it: ``900.0`` ->
    ``"15m"``, ``5.0`` -> ``"5s"``, ``0.5`` -> ``"500ms"``, ``0`` -> ``"0s"``, ``5400`` ->
    ``"1h30m"``. Used to print defaults in help text. Raises ValueError when negative."""
    if seconds < 0 or not math.isfinite(seconds):
        raise ValueError(f"{seconds!r} is not a non-negative finite number of seconds")
    if seconds == 0:
        return "0s"
    if seconds < 1:
        ms = seconds * 1000
        return f"{ms:g}ms" if ms >= 1 else f"{seconds * 1e6:g}us"
    parts = []
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        parts.append(f"{int(hours)}h")
    if minutes:
        parts.append(f"{int(minutes)}m")
    if secs:
        parts.append(f"{secs:g}s")
    return "".join(parts)
