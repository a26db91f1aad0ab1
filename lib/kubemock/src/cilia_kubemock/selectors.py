"""Label and field selectors as the API server parses them (the common subset).

Label selectors: ``k=v``, ``k==v``, ``k!=v``, ``k``, ``!k``, ``k in (a,b)``,
``k notin (a,b)``, comma-separated (all must hold). Field selectors: ``path=v``,
``path==v``, ``path!=v`` on dotted paths such as ``metadata.name``,
``metadata.namespace``, ``spec.nodeName``, ``status.phase``.

Source: k8s.io/apimachinery/pkg/labels and pkg/fields (semantics, not code).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

Predicate = Callable[[dict[str, Any]], bool]


class SelectorError(ValueError):
    """An unparsable selector (answered with 400 BadRequest)."""


def _split_top(text: str) -> list[str]:
    parts, depth, cur = [], 0, ""
    for ch in text:
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    parts.append(cur)
    return [p.strip() for p in parts if p.strip()]


_SET = re.compile(r"^([^\s!=]+)\s+(in|notin)\s+\((.*)\)$")
_EQ = re.compile(r"^([^\s!=]+)\s*(==|=|!=)\s*([^\s]*)$")
_EXISTS = re.compile(r"^(!?)([^\s!=(),]+)$")


def label_selector(text: str) -> Predicate:
    """Compile a label selector into a predicate over an object.

    Raises:
        SelectorError: unparsable; the message quotes the offending term.
    """
    terms: list[Predicate] = []
    for term in _split_top(text or ""):
        terms.append(_label_term(term))
    return lambda obj: all(t(_labels(obj)) for t in terms)


def _labels(obj: dict[str, Any]) -> dict[str, Any]:
    return dict((obj.get("metadata") or {}).get("labels") or {})


def _label_term(term: str) -> Predicate:
    if m := _SET.match(term):
        key, op, values = m.group(1), m.group(2), {v.strip() for v in m.group(3).split(",")}
        if op == "in":
            return lambda labels: key in labels and labels[key] in values
        return lambda labels: key not in labels or labels[key] not in values
    if m := _EQ.match(term):
        key, op, value = m.group(1), m.group(2), m.group(3)
        if op == "!=":
            return lambda labels: labels.get(key) != value
        return lambda labels: labels.get(key) == value
    if m := _EXISTS.match(term):
        negate, key = m.group(1) == "!", m.group(2)
        return lambda labels: (key in labels) != negate
    raise SelectorError(f"unable to parse requirement: {term!r}")


def field_value(obj: dict[str, Any], path: str) -> str:
    """The value at dotted ``path`` as the API server compares it (missing -> ``""``)."""
    cur: Any = obj
    for part in path.split("."):
        if not isinstance(cur, dict):
            return ""
        cur = cur.get(part)
    if cur is None:
        return ""
    if isinstance(cur, bool):
        return "true" if cur else "false"
    return str(cur)


def _field_term(path: str, negate: bool, value: str) -> Predicate:
    return lambda obj: (field_value(obj, path) == value) != negate


def field_selector(text: str) -> Predicate:
    """Compile a field selector into a predicate over an object.

    Raises:
        SelectorError: unparsable term.
    """
    terms: list[Predicate] = []
    for term in _split_top(text or ""):
        m = _EQ.match(term)
        if not m:
            raise SelectorError(f"invalid field selector: {term!r}")
        terms.append(_field_term(m.group(1), m.group(2) == "!=", m.group(3)))
    return lambda obj: all(t(obj) for t in terms)
