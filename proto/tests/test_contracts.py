"""Contract checks for ``proto/``: ``buf lint`` and the v1 breaking-change gate.

``proto/released/cilia-v1.binpb`` is the buf image of the v1 contracts as released
(see ``proto/README.md``). Every change to a ``v1`` package must pass
``buf breaking`` against it; a breaking change goes into a new ``v2`` package.

buf comes from ``scripts/setup.sh`` (``.venv/buf/node_modules/.bin/buf``) or
``$CILIA_BUF``. A missing buf FAILS these tests: the gate must never be silently off.
"""

from __future__ import annotations

import os
import pathlib
import re
import shutil
import subprocess

import pytest

PROTO = pathlib.Path(__file__).resolve().parents[1]
ROOT = PROTO.parent
RELEASED = PROTO / "released" / "cilia-v1.binpb"
BUF_TIMEOUT_SECONDS = 120


@pytest.fixture(scope="module")
def buf() -> str:
    """Path of the buf binary; fails (never skips) when it is not installed."""
    path = os.environ.get("CILIA_BUF") or str(
        ROOT / ".venv" / "buf" / "node_modules" / ".bin" / "buf"
    )
    if not os.access(path, os.X_OK):
        pytest.fail(
            f"buf not found at {path}: run scripts/setup.sh (installs @bufbuild/buf from npm) "
            "or set CILIA_BUF; the proto lint/breaking gate cannot be skipped"
        )
    return path


def _run(buf: str, *args: str, cwd: pathlib.Path = ROOT) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [buf, *args], cwd=cwd, capture_output=True, text=True, timeout=BUF_TIMEOUT_SECONDS
    )


def _copy_module(dst: pathlib.Path) -> pathlib.Path:
    """Copy the buf module (buf.yaml and the .proto sources) to ``dst``; return it."""
    shutil.copy(PROTO / "buf.yaml", dst / "buf.yaml")
    for src in PROTO.glob("cilia/**/*.proto"):
        target = dst / src.relative_to(PROTO)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(src, target)
    return dst


def test_buf_lint_passes_on_all_contracts(buf: str) -> None:
    out = _run(buf, "lint", "proto")
    assert out.returncode == 0, out.stdout + out.stderr


def test_released_v1_image_is_committed_and_holds_both_v1_packages(
    buf: str, tmp_path: pathlib.Path
) -> None:
    assert RELEASED.is_file(), f"{RELEASED} missing: see proto/README.md 'Releasing'"
    out = _run(buf, "ls-files", str(RELEASED))
    assert out.returncode == 0, out.stdout + out.stderr
    files = set(out.stdout.split())
    assert {"cilia/agent/v1/agent.proto", "cilia/controlplane/v1/controlplane.proto"} <= files


def test_current_contracts_are_not_breaking_against_released_v1(buf: str) -> None:
    out = _run(buf, "breaking", "proto", "--against", str(RELEASED.relative_to(ROOT)))
    assert out.returncode == 0, out.stdout + out.stderr


def test_changing_a_v1_field_number_is_reported_as_breaking(
    buf: str, tmp_path: pathlib.Path
) -> None:
    module = _copy_module(tmp_path)
    proto = module / "cilia" / "agent" / "v1" / "agent.proto"
    text = proto.read_text()
    changed = re.sub(r"(message AddRequest \{.*?string ifname = )2;", r"\g<1>12;", text, flags=re.S)
    assert changed != text
    proto.write_text(changed)
    out = _run(buf, "breaking", str(module), "--against", str(RELEASED))
    assert out.returncode != 0, "buf breaking accepted a renumbered v1 field"
    assert 'field "2" with name "ifname" on message "AddRequest"' in out.stdout, out.stdout


def test_changing_a_v1_field_type_is_reported_as_breaking(buf: str, tmp_path: pathlib.Path) -> None:
    module = _copy_module(tmp_path)
    proto = module / "cilia" / "controlplane" / "v1" / "controlplane.proto"
    text = proto.read_text()
    changed = re.sub(
        r"(message PoolDemand \{.*?)uint32 needed_ipv4 = 2;",
        r"\g<1>string needed_ipv4 = 2;",
        text,
        flags=re.S,
    )
    assert changed != text
    proto.write_text(changed)
    out = _run(buf, "breaking", str(module), "--against", str(RELEASED))
    assert out.returncode != 0, "buf breaking accepted a changed v1 field type"
    assert '"needed_ipv4"' in out.stdout and "PoolDemand" in out.stdout, out.stdout
