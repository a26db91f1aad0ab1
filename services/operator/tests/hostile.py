"""Hostile manifests shared by the unit and integration tests of the apply limits."""

from __future__ import annotations


def alias_bomb() -> str:
    """The classic "billion laughs": 10 levels of 9 aliases, 9^9 leaves, < 1 KB."""
    lines = ['a0: &a0 ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    for i in range(1, 10):
        refs = ",".join([f"*a{i - 1}"] * 9)
        lines.append(f"a{i}: &a{i} [{refs}]")
    return "\n".join(lines) + "\n"
