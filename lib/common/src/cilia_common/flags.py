"""Command-line flags generated from a service's pydantic config model.

A flag is written once, as a field of the model: its name (``store_event_history`` ->
``--store-event-history``), help (``Field(description=...)``), default (the field's) and
range (``Field(ge=1, le=65535)``, a ``Literal``). :func:`add_model_flags` adds one argparse
option per field; :func:`config_from_args` builds the model from the flags that were given
(the others keep the model's defaults). Upstream's cells do the same with a ``Config``
struct and its ``Flags()`` method.

Every error has one format, ``--flag: reason`` on one line, and exit status 2:

* a value that is not of the field's type (``--mtu abc``, ``--dial-timeout soon``) stops
  argparse at once: ``<prog>: --mtu: 'abc' is not an integer`` and ``SystemExit(2)``;
* a value the model refuses (range, validators, and a bool flag's word that is not a
  boolean, which the model's own bool parsing judges) raises :class:`FlagError` from
  :func:`config_from_args`; the caller prints ``<prog>: <error>`` and exits 2.

Field options beyond pydantic's go in the annotation: ``Annotated[pathlib.Path,
Flag(aliases=("--bpf-root",))]``. Durations use :data:`Duration` (Go grammar or bare
seconds) or :data:`GoDuration` (Go grammar only): the model holds seconds (float), the help
prints the default as a duration (``15m``).
"""

from __future__ import annotations

import argparse
import enum
import functools
import math
import pathlib
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, TypeVar

import annotated_types
from pydantic import BaseModel, BeforeValidator, ValidationError
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from .durations import format_seconds, parse_duration

__all__ = [
    "EXIT_USAGE",
    "Duration",
    "Flag",
    "FlagError",
    "GoDuration",
    "add_model_flags",
    "config_from_args",
    "flag_name",
    "given_flags",
    "parse_bool",
    "split_list",
]

EXIT_USAGE = 2
"""Exit status of every flag error."""

_GIVEN = "_cilia_flags_given"

M = TypeVar("M", bound=BaseModel)


class FlagError(ValueError):
    """A flag value the config model refused; ``str()`` is ``"--flag: reason"``.

    Attributes:
        flag: ``"--store-event-history"``, or "" when the model refused a combination
            (the message then names the flags itself).
    """

    def __init__(self, flag: str, reason: str) -> None:
        self.flag = flag
        self.reason = reason
        super().__init__(f"{flag}: {reason}" if flag else reason)


@dataclass(frozen=True)
class Flag:
    """Flag options of one config field, put in its annotation's metadata.

    Attributes:
        aliases: more option strings (``("--bpf-root",)``).
        metavar: the value's placeholder in help.
        default_text: the default as help shows it, when the value itself does not say it
            (``"hostname"`` for a default computed at start).
        hidden: no flag for this field (set only from code or tests).
    """

    aliases: tuple[str, ...] = ()
    metavar: str | None = None
    default_text: str | None = None
    hidden: bool = False


@dataclass(frozen=True)
class _DurationFlag:
    bare_seconds: bool


def _seconds(bare_seconds: bool) -> Callable[[Any], Any]:
    def convert(value: Any) -> Any:
        if isinstance(value, str):
            return parse_duration(value, bare_seconds=bare_seconds)
        return value

    return convert


Duration = Annotated[float, BeforeValidator(_seconds(True)), _DurationFlag(bare_seconds=True)]
"""Seconds (float) given as a Go duration (``15m``, ``500ms``) or a bare number (``0.5``)."""

GoDuration = Annotated[float, BeforeValidator(_seconds(False)), _DurationFlag(bare_seconds=False)]
"""Seconds (float) given as a Go duration only (``1s``; a bare number other than ``0`` is
refused, as Go's ``time.ParseDuration``)."""

_TRUE = frozenset({"true", "t", "1", "yes", "y", "on"})
_FALSE = frozenset({"false", "f", "0", "no", "n", "off"})


def parse_bool(text: str) -> bool:
    """``true|false`` (also ``1|0``, ``yes|no``, ``t|f``, ``on|off``; any case) as a bool.

    Raises:
        ValueError: ``"'maybe' is not a boolean (use true or false)"``.
    """
    lowered = text.strip().lower()
    if lowered in _TRUE:
        return True
    if lowered in _FALSE:
        return False
    raise ValueError(f"{text!r} is not a boolean (use true or false)")


def flag_name(field: str) -> str:
    """``"store_event_history"`` -> ``"--store-event-history"``."""
    return "--" + field.replace("_", "-")


@dataclass(frozen=True)
class _Kind:
    """What the command line gives for one field: how to convert one value, whether the
    flag repeats (a list), whether it may be given without a value (a bool)."""

    convert: Callable[[str], Any]
    repeat: bool = False
    switch: bool = False
    choices: tuple[str, ...] = ()
    duration: bool = False


def _to_int(text: str) -> int:
    try:
        return int(text.strip(), 10)
    except ValueError:
        raise ValueError(f"{text!r} is not an integer") from None


def _to_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"{text!r} is not a number") from None
    if not math.isfinite(value):
        raise ValueError(f"{text!r} is not a finite number")
    return value


def _duration(bare_seconds: bool, text: str) -> float:
    return parse_duration(text, bare_seconds=bare_seconds)


def _unwrap(annotation: Any) -> tuple[Any, list[Any]]:
    """Strip ``Annotated`` and ``X | None`` from a field annotation; returns the inner type
    and the metadata collected on the way."""
    metadata: list[Any] = []
    while True:
        origin = typing.get_origin(annotation)
        if origin is Annotated:
            annotation, *extra = typing.get_args(annotation)
            metadata.extend(extra)
        elif origin in (typing.Union, types.UnionType):
            args = [a for a in typing.get_args(annotation) if a is not type(None)]
            if len(args) != 1:
                return str, metadata
            annotation = args[0]
        else:
            return annotation, metadata


def _kind(info: FieldInfo) -> _Kind:
    inner, metadata = _unwrap(info.annotation)
    metadata += list(info.metadata)
    for item in metadata:
        if isinstance(item, _DurationFlag):
            return _Kind(functools.partial(_duration, item.bare_seconds), duration=True)
    origin = typing.get_origin(inner)
    if origin is typing.Literal:
        choices = tuple(str(c) for c in typing.get_args(inner))
        return _Kind(str, choices=choices)
    if origin in (list, tuple, set, frozenset, Sequence):
        return _Kind(str, repeat=True)
    if inner is bool:
        return _Kind(parse_bool, switch=True)
    if inner is int:
        return _Kind(_to_int)
    if inner is float:
        return _Kind(_to_float)
    if isinstance(inner, type) and issubclass(inner, enum.Enum):
        return _Kind(str, choices=tuple(str(m.value) for m in inner))
    return _Kind(str)  # str, pathlib.Path, dicts parsed by a before-validator, ...


def _flag_options(info: FieldInfo) -> Flag:
    _, metadata = _unwrap(info.annotation)
    for item in [*metadata, *info.metadata]:
        if isinstance(item, Flag):
            return item
    return Flag()


def _range_text(info: FieldInfo) -> str:
    low = high = ""
    for item in info.metadata:
        if isinstance(item, annotated_types.Ge):
            low = f">= {item.ge}"
        elif isinstance(item, annotated_types.Gt):
            low = f"> {item.gt}"
        elif isinstance(item, annotated_types.Le):
            high = f"<= {item.le}"
        elif isinstance(item, annotated_types.Lt):
            high = f"< {item.lt}"
    if low.startswith(">=") and high.startswith("<="):
        return f"{low[3:]}..{high[3:]}"
    return ", ".join(p for p in (low, high) if p)


def _show(value: Any, kind: _Kind) -> str:
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "true" if value else "false"
    if kind.duration and isinstance(value, int | float):
        return format_seconds(float(value))
    if isinstance(value, enum.Enum):
        return str(value.value)
    if isinstance(value, Mapping):
        return ",".join(f"{k}={v}" for k, v in value.items()) or "none"
    if isinstance(value, list | tuple | set | frozenset):
        return ",".join(str(v) for v in value) or "none"
    if isinstance(value, pathlib.PurePath):
        return str(value)
    if value == "":
        return "''"
    return str(value)


def _default(info: FieldInfo) -> Any:
    """The field's default value, calling a default factory; PydanticUndefined if none."""
    if info.default is not PydanticUndefined:
        return info.default
    if info.default_factory is not None:
        return info.default_factory()  # type: ignore[call-arg]
    return PydanticUndefined


def _help(info: FieldInfo, kind: _Kind, options: Flag) -> str:
    text = (info.description or "").strip()
    notes = []
    rng = _range_text(info)
    if rng:
        notes.append(rng)
    if options.default_text is not None:
        notes.append(f"default: {options.default_text}")
    else:
        default = _default(info)
        if default is PydanticUndefined:
            notes.append("required")
        else:
            notes.append(f"default: {_show(default, kind)}")
    help_text = f"{text} ({'; '.join(notes)})" if text else f"({'; '.join(notes)})"
    return help_text.replace("%", "%%")


class _ModelFlagAction(argparse.Action):
    """Converts and stores one value of a model flag; records it as given. A conversion
    error ends the parse with ``<prog>: --flag: reason`` and exit status 2."""

    def __init__(self, *args: Any, kind: _Kind, field: str, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.kind = kind
        self.field = field

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        raw = "true" if values is None else str(values)  # a bare switch: --flag
        try:
            value: Any = self.kind.convert(raw)
        except ValueError as exc:
            if not self.kind.switch:
                parser.exit(EXIT_USAGE, f"{parser.prog}: {flag_name(self.field)}: {exc}\n")
            value = raw  # not a boolean word: the model refuses it (FlagError), as any value
        given: dict[str, Any] = getattr(namespace, _GIVEN, None) or {}
        if self.kind.repeat:
            items = list(getattr(namespace, self.dest)) if self.field in given else []
            items.append(value)
            value = items
            raws = [*given.get(self.field, []), raw]
            given = {**given, self.field: raws}
        else:
            given = {**given, self.field: raw}
        setattr(namespace, _GIVEN, given)
        setattr(namespace, self.dest, value)


def add_model_flags(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    model: type[BaseModel],
    *,
    exclude: Sequence[str] = (),
) -> None:
    """Add one ``--field-name`` option per field of ``model`` to ``parser``.

    The namespace gets, for each field, the converted value when the flag is given and the
    model's default otherwise (None for a default computed at start). Lists repeat the flag
    (``--cidr A --cidr B``); bools take ``--flag``, ``--flag=false`` or ``--flag false``;
    durations are parsed to seconds. Help: the field's description, then its range and
    default (``(1..65535; default: 65535)``).

    Args:
        parser: the (sub-)parser or argument group.
        model: the pydantic config model.
        exclude: field names without a flag.
    """
    for name, info in model.model_fields.items():
        options = _flag_options(info)
        if name in exclude or options.hidden:
            continue
        kind = _kind(info)
        default = _default(info)
        if default is PydanticUndefined or info.default_factory is not None:
            default = None
        metavar = options.metavar
        if metavar is None and kind.choices:
            metavar = "{" + ",".join(kind.choices) + "}"
        if metavar is None and kind.switch:
            metavar = "BOOL"
        if metavar is None and kind.duration:
            metavar = "DURATION"
        if metavar is None and kind.convert is _to_int:
            metavar = "N"
        parser.add_argument(
            flag_name(name),
            *options.aliases,
            dest=name,
            action=_ModelFlagAction,
            kind=kind,
            field=name,
            nargs="?" if kind.switch else None,
            default=default,
            metavar=metavar,
            help=_help(info, kind, options),
        )


def given_flags(namespace: argparse.Namespace) -> dict[str, Any]:
    """The raw text of every model flag given on the command line, by field name (a list
    of texts for a repeated flag); flags left at their default are absent."""
    return dict(getattr(namespace, _GIVEN, None) or {})


def _error(exc: ValidationError) -> FlagError:
    first = exc.errors(include_url=False)[0]
    message = str(first["msg"]).removeprefix("Value error, ").removeprefix("Assertion failed, ")
    loc = [str(p) for p in first["loc"]]
    if message.startswith("--") or not loc:
        return FlagError("", message)
    return FlagError(flag_name(loc[0]), message)


def config_from_args(model: type[M], namespace: argparse.Namespace, **overrides: Any) -> M:
    """Build ``model`` from the flags given in ``namespace`` (parsed by a parser that
    :func:`add_model_flags` filled); flags not given keep the model's defaults.

    Args:
        model: the config model.
        namespace: the parse result.
        overrides: values set from elsewhere (another flag, the environment), by field.

    Returns:
        the validated model.

    Raises:
        FlagError: the model refused a value: ``"--flag: reason"`` (the reason as the
            model's validator wrote it; a validator's message that already starts with
            ``--`` names its flags itself and is used alone).
    """
    fields = model.model_fields
    values = {name: getattr(namespace, name) for name in given_flags(namespace) if name in fields}
    values.update(overrides)
    try:
        return model.model_validate(values)
    except ValidationError as exc:
        raise _error(exc) from None


def validation_error(exc: ValidationError) -> FlagError:
    """``exc`` (from constructing a config model) as a :class:`FlagError` naming the flag
    of its first error."""
    return _error(exc)


def split_list(values: list[str]) -> list[str]:
    """A repeatable flag's values with comma-separated items split out, blanks dropped
    (``["a.crt,b.crt", " c.crt"]`` -> ``["a.crt", "b.crt", "c.crt"]``): what every
    ``--…-ca-files`` flag accepts."""
    return [p.strip() for item in values for p in item.split(",") if p.strip()]


def require_all_or_none(flags: Mapping[str, object], why: str = "") -> None:
    """Check that flags which only work together (a certificate and its key, ...) are all
    given or all left empty.

    Args:
        flags: flag name (``--tls-cert-file``) -> its value; empty values (``""``, ``[]``,
            ``None``) count as not given. Order is kept in the message.
        why: optional reason appended in parentheses, e.g. ``"mutual TLS"``.

    Raises:
        ValueError: some but not all were given; the message names every flag of the group,
            e.g. ``--a and --b: give both or none``.
    """
    given = [bool(value) for value in flags.values()]
    if not any(given) or all(given):
        return
    names = list(flags)
    listed = ", ".join(names[:-1]) + " and " + names[-1]
    count = {2: "both", 3: "all three", 4: "all four"}.get(len(names), f"all {len(names)}")
    reason = f" ({why})" if why else ""
    raise ValueError(f"{listed}: give {count}{reason} or none")
