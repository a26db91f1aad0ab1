"""Validation errors shared by manifests, flags and the gRPC boundary."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pydantic import ValidationError


@dataclass(frozen=True)
class FieldError:
    """One reason a document is invalid.

    Attributes:
        path: JSON-style field path, e.g. ``spec.ipv4.cidrs[0]`` ("" = whole document).
        reason: what is wrong, in words a person can act on.
    """

    path: str
    reason: str

    def __str__(self) -> str:
        return f"{self.path}: {self.reason}" if self.path else self.reason


class InvalidResource(ValueError):
    """A resource document failed validation; ``errors`` lists every problem found."""

    def __init__(self, errors: Sequence[FieldError]) -> None:
        self.errors = list(errors)
        super().__init__("; ".join(str(e) for e in self.errors))


def field_path(loc: Sequence[int | str]) -> str:
    """Render a pydantic ``loc`` tuple as ``spec.ipv4.cidrs[0]``."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out


def from_pydantic(exc: ValidationError) -> InvalidResource:
    """Convert a pydantic error into :class:`InvalidResource` with field paths."""
    errors = []
    for err in exc.errors(include_url=False):
        loc = [p for p in err["loc"] if not (isinstance(p, str) and p.startswith("function-"))]
        reason = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            # as Kubernetes' strict field validation (and policy/validation.py) says it
            reason = "unknown field"
        errors.append(FieldError(field_path(loc), reason))
    return InvalidResource(errors)
