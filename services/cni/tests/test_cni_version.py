"""VERSION, exec'd as a runtime would (CNI spec: only CNI_COMMAND, stdin {"cniVersion"})."""

from __future__ import annotations

import pytest
from cni_testlib import assert_cni_error, exec_cni


@pytest.mark.parametrize("version", ["1.0.0", "1.1.0"])
def test_version_lists_supported_versions_in_the_requested_version(version: str) -> None:
    run = exec_cni({"CNI_COMMAND": "VERSION"}, {"cniVersion": version})
    assert run.returncode == 0, run
    assert run.json == {"cniVersion": version, "supportedVersions": ["1.0.0", "1.1.0"]}
    assert run.stderr == ""


def test_version_with_empty_stdin_answers_in_the_newest_version() -> None:
    run = exec_cni({"CNI_COMMAND": "VERSION"}, b"")
    assert run.returncode == 0, run
    assert run.json == {"cniVersion": "1.1.0", "supportedVersions": ["1.0.0", "1.1.0"]}


@pytest.mark.parametrize("version", ["0.4.0", "0.3.1", "2.0.0", "1.0"])
def test_version_with_unsupported_cni_version_fails_with_code_1(version: str) -> None:
    run = exec_cni({"CNI_COMMAND": "VERSION"}, {"cniVersion": version})
    err = assert_cni_error(run, 1, version, "1.0.0, 1.1.0")
    assert err["cniVersion"] == "1.1.0"


def test_version_with_undecodable_stdin_fails_with_code_6() -> None:
    assert_cni_error(exec_cni({"CNI_COMMAND": "VERSION"}, b"{cniVersion"), 6, "not valid JSON")
