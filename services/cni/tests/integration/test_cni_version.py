"""VERSION, exec'd as a runtime would (CNI spec: only CNI_COMMAND, stdin {"cniVersion"})."""

from __future__ import annotations

import pytest
from cni_testlib import assert_cni_error, exec_cni

SUPPORTED = ["0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0"]


@pytest.mark.parametrize("version", SUPPORTED)
def test_version_lists_supported_versions_in_the_requested_version(version: str) -> None:
    run = exec_cni({"CNI_COMMAND": "VERSION"}, {"cniVersion": version})
    assert run.returncode == 0, run
    assert run.json == {"cniVersion": version, "supportedVersions": SUPPORTED}
    assert run.stderr == ""


def test_version_with_empty_stdin_answers_in_the_newest_version() -> None:
    run = exec_cni({"CNI_COMMAND": "VERSION"}, b"")
    assert run.returncode == 0, run
    assert run.json == {"cniVersion": "1.1.0", "supportedVersions": SUPPORTED}


@pytest.mark.parametrize("version", ["0.2.0", "0.1.0", "2.0.0", "1.0", 7])
def test_version_with_unsupported_cni_version_still_lists_the_supported_ones(
    version: object,
) -> None:
    # libcni's skel answers VERSION without looking at the requested version; the spec
    # defines no error for it: a runtime must learn what we speak to pick a version.
    run = exec_cni({"CNI_COMMAND": "VERSION"}, {"cniVersion": version})
    assert run.returncode == 0, run
    assert run.json == {"cniVersion": "1.1.0", "supportedVersions": SUPPORTED}


def test_version_with_undecodable_stdin_fails_with_code_6() -> None:
    assert_cni_error(exec_cni({"CNI_COMMAND": "VERSION"}, b"{cniVersion"), 6, "not valid JSON")
