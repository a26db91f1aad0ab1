"""Fixtures of the relay integration tests: a short socket directory per test."""

from __future__ import annotations

import pathlib
import shutil
import tempfile
from collections.abc import Iterator

import pytest


@pytest.fixture
def sockdir() -> Iterator[pathlib.Path]:
    """A fresh directory for unix sockets with a short path (sun_path is 108 bytes)."""
    path = pathlib.Path(tempfile.mkdtemp(prefix="crelay-", dir="/tmp"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)
