"""Repository-wide pytest policy.

With ``CILIA_REQUIRE_PRIVILEGED=1`` (set by ``.ci/run``; CI runs as root on a
kernel with BPF), a test marked ``privileged`` that skips is reported as a
failure: in CI a skip would hide a missing dependency (libbpf, bpffs, iproute2)
behind a green run. Outside CI, privileged tests skip with their reason.
"""

from __future__ import annotations

import os
from collections.abc import Generator

import pytest


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, None]:
    outcome = yield
    report = outcome.get_result()
    if (
        report.skipped
        and os.environ.get("CILIA_REQUIRE_PRIVILEGED") == "1"
        and item.get_closest_marker("privileged") is not None
    ):
        report.outcome = "failed"
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else report.longrepr
        report.longrepr = f"privileged test skipped in CI (CILIA_REQUIRE_PRIVILEGED=1): {reason}"
