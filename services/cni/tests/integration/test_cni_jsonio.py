"""cilia_cni.jsonio against ``json``, and the string checks that replaced ``re``: same
values, same errors, and an ADD path that imports neither ``json`` nor ``re``.

The comparisons run in a fresh interpreter (``python -I``): CPython 3.11's JSON scanner
raises ``JSONDecodeError`` only when ``json.decoder`` is imported already, so a test
process that has imported ``json`` (pytest has) would hide a wrong error path.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

from hypothesis import given, settings
from hypothesis import strategies as st

from cilia_cni.invocation import is_name
from cilia_cni.netconf import _has_surrogate, _has_surrogate_escape

_FRESH = r"""
import sys
from cilia_cni import jsonio

def reject(name):
    raise ValueError(name + " is not valid JSON")

out = []
for text in sys.argv[1:]:
    try:
        out.append(["ok", jsonio.loads(text, reject)])
    except (ValueError, RecursionError) as exc:
        out.append(["err", type(exc).__name__, str(exc)])
    out[-1].append(sorted(m for m in ("json", "re") if m in sys.modules))
import json  # only now: the cases are done
print(json.dumps(out))
"""

#: Valid first (the child must not import json for them), then every error json reports.
VALID = [
    '{"cniVersion": "1.0.0", "name": "n", "x": [1, 2.5, -0.0, 1e400, true, null, "\\u00e9"]}',
    ' \t\n{"a": {}}\r\n',
    '"\\ud83d\\ude00"',
]
INVALID = [
    "{",
    '{"a":',
    "{}x",
    "1 2",
    "",
    "   ",
    "\ufeff{}",
    "[NaN]",
    "[-Infinity]",
    '"\\x"',
    '{"a": "\x01"}',
    "[1,]",
    "[" * 100000,
]


def _expected(text: str) -> list[object]:
    def reject(name: str) -> float:
        raise ValueError(name + " is not valid JSON")

    try:
        return ["ok", json.loads(text, parse_constant=reject)]
    except (ValueError, RecursionError) as exc:
        return ["err", type(exc).__name__, str(exc)]


def test_loads_matches_json_in_a_fresh_interpreter() -> None:
    res = subprocess.run(
        [sys.executable, "-I", "-c", _FRESH, *VALID, *INVALID],
        capture_output=True,
        text=True,
        check=True,
    )
    got = json.loads(res.stdout)
    for text, row in zip(VALID + INVALID, got, strict=True):
        assert row[:-1] == _expected(text), (text[:30], row)
    for row in got[: len(VALID)]:
        assert row[-1] == [], row  # valid input: neither json nor re imported
    assert "re" in got[-1][-1]  # the error path does import json (and so re): it ran


def test_valid_stdin_path_imports_neither_json_nor_re() -> None:
    code = (
        "import sys\n"
        "from cilia_cni import netconf, jsonio\n"
        'netconf.decode(b\'{"cniVersion": "1.0.0", "name": "a", "l": ["\\\\u00e9"]}\')\n'
        "jsonio.dumps({'a': [1, 2.5, None, True, 'x', b'y']}, default=str)\n"
        "print(sorted(m for m in ('json', 're', 'enum') if m in sys.modules))\n"
    )
    res = subprocess.run(
        [sys.executable, "-I", "-c", code], capture_output=True, text=True, check=True
    )
    assert res.stdout.strip() == "[]", res


VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=True)
    | st.text(alphabet=st.characters(codec="utf-8"), max_size=8),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner, max_size=4)
    ),
    max_leaves=12,
)


@settings(max_examples=300, deadline=None)
@given(VALUES)
def test_dumps_equals_json_dumps(value: object) -> None:
    from cilia_cni import jsonio

    assert jsonio.dumps(value) == json.dumps(value)
    marker = jsonio.dumps({"v": value, "o": b"x"}, default=lambda _: "B")
    assert marker == json.dumps({"v": value, "o": b"x"}, default=lambda _: "B")


def test_dumps_errors_are_jsons() -> None:
    from cilia_cni import jsonio

    loop: list[object] = []
    loop.append(loop)
    for value in (loop, {"x": object()}):
        try:
            json.dumps(value)
        except (TypeError, ValueError) as exc:
            expected = (type(exc), str(exc))
        try:
            jsonio.dumps(value)
        except (TypeError, ValueError) as exc:
            assert (type(exc), str(exc)) == expected
        else:
            raise AssertionError(f"jsonio.dumps accepted {value!r}")


_NAME = re.compile(r"[a-zA-Z0-9][a-zA-Z0-9_.\-]*")
_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
_SURROGATE = re.compile("[\ud800-\udfff]")
_ALPHABET = [*"aZ09_.-\\udDfF8x \n\u00e9\u0660", "\ud800", "\U0001f600"]


@settings(max_examples=3000, deadline=None)
@given(st.text(alphabet=st.sampled_from(_ALPHABET), max_size=12))
def test_string_checks_equal_the_regular_expressions_they_replaced(text: str) -> None:
    assert is_name(text) == bool(_NAME.fullmatch(text))
    assert _has_surrogate_escape(text) == bool(_ESCAPE.search(text))
    assert _has_surrogate(text) == bool(_SURROGATE.search(text))
