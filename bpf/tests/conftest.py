"""Fixtures for the datapath packet tests (root + BPF; skipped with the reason otherwise)."""

from __future__ import annotations

import os
import pathlib
from collections.abc import Iterator

import harness
import pytest


def _unsupported() -> str | None:
    if os.geteuid() != 0:
        return "BPF_PROG_TEST_RUN needs root"
    if not pathlib.Path("/sys/fs/bpf").is_dir():
        return "bpffs is not mounted at /sys/fs/bpf"
    try:
        import bcc  # noqa: F401
    except ImportError:
        return "bcc (Debian python3-bpfcc) is not importable; run scripts/setup.sh"
    return None


@pytest.fixture
def dp() -> Iterator[harness.Datapath]:
    reason = _unsupported()
    if reason:
        pytest.skip(reason)
    datapath = harness.load()
    try:
        yield datapath
    finally:
        harness.unload(datapath)
