"""What replaced the plugin's slow imports, against what it replaced: cilia_cni.jsonio
against ``json``, the string checks against the regular expressions (``re``), the address
checks of an ADD result against ``ipaddress``: same values, same errors, and a hot path
that imports none of them.

The comparisons run in a fresh interpreter (``python -I``): CPython 3.11's JSON scanner
raises ``JSONDecodeError`` only when ``json.decoder`` is imported already, so a test
process that has imported ``json`` (pytest has) would hide a wrong error path.
"""

from __future__ import annotations

import ipaddress
import json
import re
import subprocess
import sys

from hypothesis import given, settings
from hypothesis import strategies as st

from cilia_cni.errors import InternalError
from cilia_cni.invocation import is_name
from cilia_cni.netconf import _has_surrogate, _has_surrogate_escape
from cilia_cni.result import _check_address, _check_cidr

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


@settings(max_examples=1000, deadline=None)
@given(st.text(alphabet=st.sampled_from(_ALPHABET), max_size=12))
def test_string_checks_equal_the_regular_expressions_they_replaced(text: str) -> None:
    assert is_name(text) == bool(_NAME.fullmatch(text))
    assert _has_surrogate_escape(text) == bool(_ESCAPE.search(text))
    assert _has_surrogate(text) == bool(_SURROGATE.search(text))


_ADDRESS_ALPHABET = [*"0123456789abcdefABCDEF:./%x ", "\u0661", "\x00"]


def _ipaddress_outcome(parse: object, value: str) -> object:
    try:
        return getattr(parse(value), "version", None)  # type: ignore[operator]
    except ValueError:
        return "invalid"


def _result_outcome(check: object, value: str, *args: object) -> object:
    try:
        return check(value, "field", *args)  # type: ignore[operator]
    except InternalError as exc:
        assert repr(value) in str(exc)
        return "invalid"


@settings(max_examples=500, deadline=None)
@given(
    st.one_of(
        st.text(alphabet=st.sampled_from(_ADDRESS_ALPHABET), max_size=48),
        st.ip_addresses().map(str),
        st.tuples(st.ip_addresses(), st.integers(0, 130)).map(lambda t: f"{t[0]}/{t[1]}"),
        st.ip_addresses().map(lambda a: f"{a}/{a.max_prefixlen}"),
        st.sampled_from(
            [
                "10.0.0.0/8",
                "10.0.0.1/8",
                "1.2.3.4/255.255.0.0",
                "fe80::1%eth0",
                "1.2.3.4/024",
                "::/0",
                "1.2.3.4/33",
                "01.2.3.4",
                "1.2.3.4/",
                "1.2.3.4/2/3",
            ]
        ),
    )
)
def test_address_checks_agree_with_ipaddress(value: str) -> None:
    assert _result_outcome(_check_cidr, value, False) == _ipaddress_outcome(
        ipaddress.ip_interface, value
    )
    assert _result_outcome(_check_cidr, value, True) == _ipaddress_outcome(
        ipaddress.ip_network, value
    )
    ok = _ipaddress_outcome(ipaddress.ip_address, value) != "invalid"
    assert (_result_outcome(_check_address, value) != "invalid") == ok


def test_address_checks_of_an_add_result_import_no_ipaddress() -> None:
    code = (
        "import sys\n"
        "from cilia_cni.result import _check_address, _check_cidr\n"
        "assert _check_cidr('10.0.1.7/24', 'f', False) == 4\n"
        "assert _check_cidr('fd00::/64', 'f', True) == 6\n"
        "_check_address('fe80::1', 'f')\n"
        "print('ipaddress' in sys.modules)\n"
    )
    res = subprocess.run(
        [sys.executable, "-I", "-c", code], capture_output=True, text=True, check=True
    )
    assert res.stdout.strip() == "False", res
