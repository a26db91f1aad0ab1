"""Fixtures for the datapath packet tests (root + BPF; skipped with the reason otherwise)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from cilia_agent.testing import bpf as harness
from cilia_testkit import skips


@pytest.fixture
def dp() -> Iterator[harness.Datapath]:
    skips.require_bpf("BPF_PROG_TEST_RUN")
    datapath = harness.load()
    try:
        yield datapath
    finally:
        harness.unload(datapath)
