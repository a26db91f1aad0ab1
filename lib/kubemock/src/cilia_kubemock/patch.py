"""The three PATCH flavours the official clients send.

- ``application/merge-patch+json``: RFC 7386 JSON merge patch (``null`` deletes a key,
  lists are replaced).
- ``application/strategic-merge-patch+json``: the simple cases: objects merge like
  merge-patch; a list of objects whose every item (old and new) has a ``name`` (e.g.
  containers) or ``type`` (e.g. conditions) key is merged item by item on that key;
  any other list is replaced. ``$patch`` directives are not supported (400).
- ``application/json-patch+json``: RFC 6902 (add, remove, replace, test, copy, move).

Source: the Kubernetes API documentation on PATCH (semantics, not code).
"""

from __future__ import annotations

import copy
from typing import Any


class PatchError(ValueError):
    """A patch that cannot be applied (answered with 422 or 400)."""


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386: return ``target`` merged with ``patch`` (inputs unchanged)."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = copy.deepcopy(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = merge_patch(out.get(key), value)
    return out


def _merge_key(old: list[Any], new: list[Any]) -> str | None:
    items = old + new
    if not items or not all(isinstance(i, dict) for i in items):
        return None
    for key in ("name", "type", "containerPort", "ip"):
        if all(key in i for i in items):
            return key
    return None


def strategic_merge_patch(target: Any, patch: Any) -> Any:
    """Strategic merge patch, simple cases (see module docstring).

    Raises:
        PatchError: a ``$patch`` / ``$retainKeys`` directive was used.
    """
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = copy.deepcopy(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if key.startswith("$"):
            raise PatchError(f"strategic merge directive {key!r} is not supported by the mock")
        if value is None:
            out.pop(key, None)
        elif isinstance(value, list) and isinstance(out.get(key), list):
            mkey = _merge_key(out[key], value)
            if mkey is None:
                out[key] = copy.deepcopy(value)
            else:
                merged = list(out[key])
                for item in value:
                    for i, old in enumerate(merged):
                        if old[mkey] == item[mkey]:
                            merged[i] = strategic_merge_patch(old, item)
                            break
                    else:
                        merged.append(copy.deepcopy(item))
                out[key] = merged
        else:
            out[key] = strategic_merge_patch(out.get(key), value)
    return out


def _pointer(path: str) -> list[str]:
    if path == "":
        return []
    if not path.startswith("/"):
        raise PatchError(f"json patch path {path!r} must start with '/'")
    return [p.replace("~1", "/").replace("~0", "~") for p in path[1:].split("/")]


def _parent(doc: Any, parts: list[str], path: str) -> Any:
    cur = doc
    for part in parts[:-1]:
        try:
            cur = cur[int(part)] if isinstance(cur, list) else cur[part]
        except (KeyError, IndexError, ValueError, TypeError):
            raise PatchError(f"json patch path {path!r} does not exist") from None
    return cur


def _get(doc: Any, path: str) -> Any:
    parts = _pointer(path)
    if not parts:
        return doc
    parent = _parent(doc, parts, path)
    try:
        return parent[int(parts[-1])] if isinstance(parent, list) else parent[parts[-1]]
    except (KeyError, IndexError, ValueError, TypeError):
        raise PatchError(f"json patch path {path!r} does not exist") from None


def _remove(doc: Any, path: str) -> Any:
    parts = _pointer(path)
    parent = _parent(doc, parts, path)
    try:
        if isinstance(parent, list):
            return parent.pop(int(parts[-1]))
        return parent.pop(parts[-1])
    except (KeyError, IndexError, ValueError, TypeError):
        raise PatchError(f"json patch path {path!r} does not exist") from None


def _add(doc: Any, path: str, value: Any) -> Any:
    parts = _pointer(path)
    if not parts:
        return value
    parent = _parent(doc, parts, path)
    last = parts[-1]
    if isinstance(parent, list):
        idx = len(parent) if last == "-" else int(last)
        if idx > len(parent):
            raise PatchError(f"json patch path {path!r}: index out of range")
        parent.insert(idx, value)
    elif isinstance(parent, dict):
        parent[last] = value
    else:
        raise PatchError(f"json patch path {path!r} does not exist")
    return doc


def json_patch(target: Any, ops: Any) -> Any:
    """RFC 6902: apply ``ops`` (a list) to a copy of ``target``.

    Raises:
        PatchError: malformed operation, missing path, or a failed ``test``.
    """
    if not isinstance(ops, list):
        raise PatchError("json patch body must be a list of operations")
    doc = copy.deepcopy(target)
    for op in ops:
        if not isinstance(op, dict) or "op" not in op or "path" not in op:
            raise PatchError(f"json patch operation {op!r} needs 'op' and 'path'")
        name, path = op["op"], op["path"]
        if name == "add":
            doc = _add(doc, path, copy.deepcopy(op.get("value")))
        elif name == "remove":
            _remove(doc, path)
        elif name == "replace":
            _get(doc, path)
            parts = _pointer(path)
            if not parts:
                doc = copy.deepcopy(op.get("value"))
            else:
                parent = _parent(doc, parts, path)
                key: Any = int(parts[-1]) if isinstance(parent, list) else parts[-1]
                parent[key] = copy.deepcopy(op.get("value"))
        elif name == "test":
            if _get(doc, path) != op.get("value"):
                raise PatchError(f"json patch test failed at {path!r}")
        elif name in ("copy", "move"):
            value = copy.deepcopy(_get(doc, op.get("from", "")))
            if name == "move":
                _remove(doc, op["from"])
            doc = _add(doc, path, value)
        else:
            raise PatchError(f"json patch op {name!r} is not supported")
    return doc
