"""The safe-agent-updater refuses a node whose kernel is below the new agent's floor before
anything replaces the agent (issue 32).

The rendered updater DaemonSet's first init container runs the NEW agent image's own
``cilia-agent init check-kernel`` (the floor the agent computes from its features, or
``minimalKernelVersion``); the kubelet runs init containers in order and stops at the first
that fails, so the update step (``safe-agent-updater``, which deletes the old agent pod)
never starts. Here the very command line of the manifest runs on this host twice: as it is
(this kernel passes) and under ``setarch --uname-2.6`` (the UNAME26 personality: the
process sees a 2.6.x kernel, far below 5.10), where it must fail with one line.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

#: The agent's console script of this environment (tox installs the agent editable).
AGENT = Path(sys.executable).with_name("cilia-agent")


def _find(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    return next(d for d in docs if d and d["kind"] == kind and d["metadata"]["name"] == name)


def _argv(container: dict[str, Any], kernel_min: str) -> list[str]:
    """The container's argv as the kubelet expands it (``$(KERNEL_MIN)`` from the env)."""
    args = [a.replace("$(KERNEL_MIN)", kernel_min) for a in container.get("args", [])]
    return [str(AGENT), *args] if "command" not in container else [*container["command"], *args]


def _run(argv: list[str], old_kernel: bool) -> subprocess.CompletedProcess[str]:
    if old_kernel:
        setarch = shutil.which("setarch")
        if setarch is None:
            pytest.fail("setarch (util-linux) is needed to present an old kernel release")
        argv = [setarch, os.uname().machine, "--uname-2.6", *argv]
    return subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)


def test_the_updater_checks_the_new_agents_floor_before_its_update_step(
    rendered: list[dict[str, Any]],
) -> None:
    updater = _find(rendered, "DaemonSet", "cilia-safe-agent-updater")["spec"]["template"]["spec"]
    agent = _find(rendered, "DaemonSet", "cilia-agent")["spec"]["template"]["spec"]
    inits = [c["name"] for c in updater["initContainers"]]
    assert inits[0] == "check-linux-kernel", inits
    assert inits.index("safe-agent-updater") > 0, inits
    check = updater["initContainers"][0]
    agent_check = next(c for c in agent["initContainers"] if c["name"] == "check-linux-kernel")
    # the new agent's image and its own check (release only: the agent's step probes)
    assert check["image"] == agent_check["image"]
    assert "command" not in check, "the agent image's entrypoint (cilia-agent) runs it"
    assert check["args"] == [*agent_check["args"], "--no-probe"]
    env = {e["name"]: e for e in check["env"]}
    ref = env["KERNEL_MIN"]["valueFrom"]["configMapKeyRef"]
    config = _find(rendered, "ConfigMap", ref["name"])["data"]
    kernel_min = config[ref["key"]]
    assert kernel_min == "", "default: the floor the agent computes from its features"

    ok = _run(_argv(check, kernel_min), old_kernel=False)
    assert ok.returncode == 0, ok.stderr
    assert ">= 5.10" in ok.stdout, ok

    old = _run(_argv(check, kernel_min), old_kernel=True)
    assert old.returncode == 1, old
    line = old.stderr.strip()
    assert "\n" not in line, line
    assert (
        line.startswith("cilia-agent init check-kernel: kernel 2.6.") and "older than 5.10" in line
    )
    assert "boot a kernel >= 5.10" in line, line

    # an explicit minimalKernelVersion above this kernel is refused the same way
    release = os.uname().release.split("-")[0].split(".")
    above = f"{int(release[0]) + 1}.0"
    refused = _run(_argv(check, above), old_kernel=False)
    assert refused.returncode == 1 and f"older than {above}.0 (--min-kernel-version)" in (
        refused.stderr
    ), refused
