"""The architecture checks: the import-linter contracts of ``.importlinter`` hold, and break.

Run by ``tox -e lint`` (where every service and lib is installed, so ``lint-imports`` can
build the import graph). Three things are shown:

1. every enforced contract (id without the ``target-`` prefix) is KEPT by today's code;
2. the contracts really fail on a forbidden import: a copy of ``.importlinter`` is checked
   against a synthetic set of packages named like ours where one service imports another and
   the CNI plugin imports grpcio, an operator domain imports its servicers, the shared
   reserved identities table imports the agent's datapath, the agent's IPAM imports the endpoint
   layer above it, the test kit (``lib/``) imports a service and agent code imports the agent's
   test support; ``lint-imports`` exits 1 and reports those contracts BROKEN;
3. each ``target-`` contract (a shape that code is being moved into) is checked and its
   broken imports are shown; it is an expected failure until the move lands, and fails the
   run (strict xfail) once it is KEPT, so the prefix is dropped and the contract becomes
   enforced. (None is pending now: the agent's layers of issue 10 are enforced.)

``lint-imports`` is run as a child process, as a developer runs it, with ``--no-cache``.
"""

from __future__ import annotations

import configparser
import pathlib
import shutil
import subprocess
import sys
import textwrap

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
CONFIG = ROOT / ".importlinter"
TARGET_PREFIX = "target-"


def contract_ids() -> list[str]:
    """Every contract id of ``.importlinter`` (section ``importlinter:contract:<id>``)."""
    parser = configparser.ConfigParser()
    parser.read(CONFIG)
    prefix = "importlinter:contract:"
    return [s.removeprefix(prefix) for s in parser.sections() if s.startswith(prefix)]


ENFORCED = [c for c in contract_ids() if not c.startswith(TARGET_PREFIX)]
TARGETS = [c for c in contract_ids() if c.startswith(TARGET_PREFIX)]


def lint_imports(
    *contracts: str, cwd: pathlib.Path = ROOT, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Run ``lint-imports`` (next to this interpreter) limited to ``contracts``."""
    exe = pathlib.Path(sys.executable).with_name("lint-imports")
    if not exe.exists():
        pytest.fail(f"{exe} is missing: run this test through `tox -e lint`")
    args = [str(exe), "--no-cache", "--no-logo", str(cwd / ".importlinter")]
    for contract in contracts:
        args += ["--contract", contract]
    return subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


def test_config_has_the_enforced_contracts() -> None:
    for contract in ("services-independent", "operator-layers", "agent-layers"):
        assert contract in ENFORCED, contract


def test_every_enforced_contract_is_kept_by_the_repository() -> None:
    result = lint_imports(*ENFORCED)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"Contracts: {len(ENFORCED)} kept, 0 broken." in result.stdout, result.stdout


def test_target_contracts_are_still_broken() -> None:
    """A ``target-`` contract that is KEPT must become enforced (drop its prefix)."""
    for contract in TARGETS:
        result = lint_imports(contract)
        assert result.returncode != 0, f"{contract} is KEPT now: drop the {TARGET_PREFIX!r} prefix"


def _write(path: pathlib.Path, text: str = "") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))


# Modules every layer contract of .importlinter names (layers must exist), per package.
_LAYOUT = {
    "cilia_operator": [
        "__main__", "app", "cli", "controlplane/__init__", "config", "manifests",
        "identity/__init__", "endpoint/__init__", "ipam/__init__", "kinds", "metrics",
        "policy/__init__", "service/__init__", "leader", "store/__init__", "store/redis",
        "store/kubernetes", "tasks", "errors", "addresses",
    ],
    "cilia_agent": [
        "testing/__init__", "__main__", "cli", "app", "api", "status", "enforcement", "endpoint/__init__",
        "hubble/__init__", "policy/__init__", "ipcache/__init__", "node/__init__", "k8s/__init__",
        "loadbalancer/__init__", "conntrack/__init__", "masquerade/__init__",
        "identity/__init__", "identity/labels", "ipam/__init__",
        "cni/__init__", "controlplane/__init__", "preflight/__init__", "datapath/__init__",
        "metrics", "config", "config_hubble", "config_masquerade", "config_policy",
    ],
    "cilia_cni": [
        "__main__", "server", "plugin", "agent", "delqueue", "netconf", "result", "log", "h2grpc",
        "invocation", "wire", "hpack", "errors", "jsonio",
    ],
    "cilia_relay": [
        "__main__", "app", "cli/__init__", "observer", "merge", "peers", "config", "h2server/__init__",
    ],
    "cilia_hubble_ui": [
        "__main__", "app", "web", "live", "relay", "graph", "filters", "config", "metrics",
    ],
    "cilia_safe_agent_updater": ["__main__"],
    "cilia_common": ["grpcserver", "reserved_identities"],
    "cilia_testkit": ["kubeapi", "stack"],
}  # fmt: skip


def _synthetic_tree(root: pathlib.Path, forbidden: dict[str, str]) -> None:
    """Packages shaped like ours, importing nothing but ``forbidden`` (module → import line)."""
    for package, modules in _LAYOUT.items():
        _write(root / package / "__init__.py")
        for module in modules:
            _write(root / package / f"{module}.py", forbidden.get(f"{package}.{module}", ""))


def test_a_forbidden_import_breaks_the_contracts(tmp_path: pathlib.Path) -> None:
    shutil.copy(CONFIG, tmp_path / ".importlinter")
    _synthetic_tree(tmp_path, {})
    env = {"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"}
    clean = lint_imports(*ENFORCED, cwd=tmp_path, env=env)
    assert clean.returncode == 0, clean.stdout + clean.stderr

    _synthetic_tree(
        tmp_path,
        {
            # a service importing another one
            "cilia_relay.observer": "import cilia_agent.hubble\n",
            # the CNI plugin importing grpcio
            "cilia_cni.agent": "import grpc\n",
            # an operator domain importing its servicers (upward)
            "cilia_operator.ipam/__init__": "from cilia_operator import controlplane\n",
            # the shared reserved identities table importing the agent's datapath
            "cilia_common.reserved_identities": "import cilia_agent.datapath\n",
            # the agent's IPAM importing the endpoint layer above it
            "cilia_agent.ipam/__init__": "import cilia_agent.endpoint\n",
            # the test kit (lib/) importing a service
            "cilia_testkit.stack": "from cilia_operator import app\n",
            # agent code importing its own test support (the top layer)
            "cilia_agent.endpoint/__init__": "from cilia_agent.testing import bpf\n",
        },
    )
    broken = lint_imports(*ENFORCED, cwd=tmp_path, env=env)
    assert broken.returncode == 1, broken.stdout + broken.stderr
    report = broken.stdout
    assert "Contracts: " in report and "6 broken." in report, report
    assert "services never import each other" in report and "BROKEN" in report, report
    assert "cilia_relay.observer -> cilia_agent.hubble" in report, report
    assert "cilia_cni.agent -> grpc" in report, report
    assert "cilia_operator.ipam -> cilia_operator.controlplane" in report, report
    assert "cilia_common.reserved_identities -> cilia_agent.datapath" in report, report
    assert "cilia_agent.ipam -> cilia_agent.endpoint" in report, report
    assert "cilia_testkit.stack -> cilia_operator.app" in report, report
    assert "cilia_agent.endpoint -> cilia_agent.testing" in report, report
