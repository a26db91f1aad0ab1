"""The sh + Python launcher (launcher/cilia-cni) as installed: next to its venv's python3,
reached through symlinks (with and without `readlink` on PATH), and copied away from its
venv (a broken install: spec error JSON, code 50, never rc 127 with empty stdout).

The launcher under test is the repository's source file, placed in this venv's bin/ under a
unique name (an installed copy could be stale in an editable install)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator

import pytest
from cni_testlib import EXEC_TIMEOUT_SECONDS, CniRun, assert_cni_error

SOURCE = os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, "launcher", "cilia-cni")
VERSION_ENV = {"CNI_COMMAND": "VERSION"}


@pytest.fixture
def launcher() -> Iterator[str]:
    """The source launcher in this venv's bin/ (next to python3), removed afterwards."""
    path = os.path.join(os.path.dirname(sys.executable), f"cilia-cni-t{uuid.uuid4().hex[:8]}")
    shutil.copyfile(SOURCE, path)
    os.chmod(path, 0o755)
    yield path
    os.unlink(path)


def _exec(path: str, path_env: str) -> CniRun:
    proc = subprocess.run(
        [path],
        input=b"",
        env={"PATH": path_env, **VERSION_ENV},
        capture_output=True,
        timeout=EXEC_TIMEOUT_SECONDS,
        check=False,
    )
    return CniRun(proc.returncode, proc.stdout.decode(), proc.stderr.decode("utf-8", "replace"))


def _only(tmp: str, *tools: str) -> str:
    """A PATH directory holding only ``tools`` (symlinks to the host's)."""
    directory = os.path.join(tmp, "path")
    os.makedirs(directory, exist_ok=True)
    for tool in tools:
        found = shutil.which(tool)
        assert found, tool
        os.symlink(found, os.path.join(directory, tool))
    return directory


def test_launcher_next_to_its_python_answers_version(launcher: str) -> None:
    run = _exec(launcher, os.environ.get("PATH", "/usr/bin:/bin"))
    assert run.returncode == 0, run
    assert "1.1.0" in run.json["supportedVersions"]


@pytest.mark.parametrize(
    "tools", [("readlink",), ("ls",)], ids=["with-readlink", "without-readlink"]
)
def test_symlink_chain_to_the_launcher_works_with_or_without_readlink(
    launcher: str, short_tmp: str, tools: tuple[str, ...]
) -> None:
    """/opt/cni/bin/cilia-cni -> (relative) link -> <venv>/bin/cilia-cni: python3 is
    found next to the real file; without readlink the launcher reads `ls -ld`."""
    first = os.path.join(short_tmp, "bin", "cilia-cni")
    middle = os.path.join(short_tmp, "lib", "cilia-cni")
    os.makedirs(os.path.dirname(first))
    os.makedirs(os.path.dirname(middle))
    os.symlink(launcher, middle)
    os.symlink(os.path.join(os.pardir, "lib", "cilia-cni"), first)
    run = _exec(first, _only(short_tmp, *tools))
    assert run.returncode == 0, run
    assert "1.1.0" in run.json["supportedVersions"]


@pytest.mark.parametrize("path_env", ["/usr/bin:/bin", "/nonexistent"])
def test_a_copy_away_from_its_venv_prints_code_50_naming_the_install_way(
    launcher: str, short_tmp: str, path_env: str
) -> None:
    """A copy in /opt/cni/bin has no python3 beside it: spec error JSON on stdout, exit 1
    (was: rc 127, "exec: /opt/cni/bin/python3: not found", empty stdout)."""
    copy = os.path.join(short_tmp, "cilia-cni")
    shutil.copy2(launcher, copy)
    run = _exec(copy, path_env)
    assert run.returncode == 1, run
    err = assert_cni_error(run, 50, "cilia-cni-install", "symlink", "never a copy", short_tmp)
    assert err["cniVersion"] == "1.1.0"
    assert run.stderr == ""


def test_a_copy_in_a_directory_with_a_quote_still_prints_valid_json(
    launcher: str, short_tmp: str
) -> None:
    directory = os.path.join(short_tmp, 'we"ird\\dir')
    os.makedirs(directory)
    copy = os.path.join(directory, "cilia-cni")
    shutil.copy2(launcher, copy)
    run = _exec(copy, "/usr/bin:/bin")
    assert_cni_error(run, 50, "cilia-cni-install")
