"""``json.loads``/``json.dumps`` for the plugin, on CPython's ``_json`` C accelerator alone.

Why: ``import json`` imports ``json.decoder`` and ``json.encoder``, which compile regular
expressions at import, so ``re``, ``enum``, ``functools`` and ``collections`` come with it:
with the two regular expressions the plugin's checks used (now string methods), about 10
of the ~30 ms CPU of a VERSION exec of the frozen plugin, paid on every pod (measured with
``python -X importtime`` and services/cni/tests/integration/measure_startup.py). ``json`` itself runs on the same C functions (``_json.make_scanner``,
``_json.make_encoder``, ``_json.encode_basestring_ascii``); this module calls them the way
``json.JSONDecoder``/``json.JSONEncoder`` do with their default settings, so results are
identical, and on any input that ``json`` would reject (or that needs a path this module
does not take) it calls ``json`` itself, so errors are ``json``'s own exceptions and
messages. ``services/cni/tests/integration/test_cni_lean_imports.py`` checks both against
``json``.
"""

from __future__ import annotations

from _json import encode_basestring_ascii, make_encoder, make_scanner

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable

#: JSON's insignificant whitespace (RFC 8259 section 2), as ``json.decoder.WHITESPACE``.
_WHITESPACE = " \t\n\r"


class _ScannerContext:
    """The attributes ``_json.make_scanner`` reads (those of a default ``JSONDecoder``
    except ``parse_constant``)."""

    __slots__ = ("parse_constant",)
    strict = True
    object_hook = None
    object_pairs_hook = None
    parse_float = float
    parse_int = int

    def __init__(self, parse_constant: Callable[[str], object]) -> None:
        self.parse_constant = parse_constant


def loads(text: str, parse_constant: Callable[[str], object]) -> object:
    """``json.loads(text, parse_constant=parse_constant)``: the same value, or the same
    exception.

    Raises:
        json.JSONDecodeError: ``text`` is not one JSON value (``json``'s message);
        RecursionError: nested too deeply; whatever ``parse_constant`` raises.
    """
    start = len(text) - len(text.lstrip(_WHITESPACE))
    if not text.startswith("\ufeff"):
        try:
            # typeshed types the context as a scanner; the C code reads only its attributes
            scan = make_scanner(_ScannerContext(parse_constant))  # type: ignore[arg-type]
            value, end = scan(text, start)
        except Exception:  # json.loads below raises json's own error for it
            # StopIteration is "Expecting value"; other errors need json.decoder imported:
            # CPython 3.11's scanner raises JSONDecodeError only when json.decoder is in
            # sys.modules already (else a SystemError), so json.loads re-runs the scan.
            pass
        else:
            if not text[end:].strip(_WHITESPACE):
                return value
    import json  # an error (or a BOM): json raises its own exception for it

    return json.loads(text, parse_constant=parse_constant)


def _no_default(value: object) -> object:
    raise TypeError(f"Object of type {value.__class__.__name__} is not JSON serializable")


def dumps(value: object, default: Callable[[object], object] | None = None) -> str:
    """``json.dumps(value, default=default)`` (ASCII, ``", "``/``": "`` separators,
    circular references checked, NaN and infinities allowed).

    Raises:
        TypeError: a value is not serialisable and ``default`` is None;
        ValueError: a circular reference; RecursionError: nested too deeply.
    """
    if isinstance(value, str):
        return encode_basestring_ascii(value)
    encode = make_encoder(
        {}, default or _no_default, encode_basestring_ascii, None, ": ", ", ", False, False, True
    )
    return "".join(encode(value, 0))
