"""The agent ↔ operator link over mutual TLS, as a user runs it.

A private :class:`cilia_testkit.stack.Stack` with ``tls=True``: ``cilia-operator certs
generate`` writes the CA, the operator's server pair, one client pair per agent
(``CN=system:node:<node>, O=system:nodes``) and an admin pair; the operator serves with
``--tls-cert-file/--tls-key-file/--tls-client-ca-files``, the agents dial it with
``--tls-operator-*`` and ``cilia-operator get/apply`` use the admin pair. Then the
certificates are renewed on disk under a new CA and the operator restarted: the agents
reconnect with the renewed files (no agent restart); the old files would no longer verify.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
from collections.abc import Iterator

import pytest

from cilia_testkit import VENV_BIN
from cilia_testkit.host import wait_for
from cilia_testkit.stack import Stack, StackError

REGISTER_SECONDS = 30.0


@pytest.fixture(scope="module")
def tls_stack() -> Iterator[Stack]:
    if os.geteuid() != 0 or shutil.which("redis-server") is None:
        pytest.skip("e2e needs root and redis-server (scripts/setup.sh)")
    stack = Stack("mtls", agents=2, relay=False, hubble_tcp=False, tls=True)
    try:
        stack.start()
    except StackError as exc:
        stack.stop()
        pytest.fail(f"the mTLS stack did not start:\n{exc}")
    try:
        yield stack
    finally:
        stack.stop()


def _nodes(stack: Stack) -> set[str]:
    """Names of the CiliumNodes, read with the admin's certificate."""
    out = stack.operator_cli("get", "ciliumnodes")
    assert out.returncode == 0, out.stderr
    return {item["metadata"]["name"] for item in json.loads(out.stdout)["items"]}


def _log(stack: Stack, index: int) -> str:
    agent = stack.agents[index]
    return pathlib.Path(agent.process.log).read_text(errors="replace")


def test_agents_register_and_get_their_cidrs_over_mutual_tls(tls_stack: Stack) -> None:
    names = {a.node_name for a in tls_stack.agents}
    assert wait_for(lambda: _nodes(tls_stack) == names, REGISTER_SECONDS), tls_stack.logs()
    operator_log = pathlib.Path(tls_stack.operator.log).read_text()
    assert "gRPC listener uses mutual TLS" in operator_log
    assert "plaintext" not in operator_log
    for index in range(2):
        assert "registered with operator" in _log(tls_stack, index)
        assert "PERMISSION_DENIED" not in _log(tls_stack, index)


def test_plaintext_and_non_admin_clients_are_refused(
    tls_stack: Stack, tmp_path: pathlib.Path
) -> None:
    plain = subprocess.run(
        [str(VENV_BIN / "cilia-operator"), "get", "ciliumnodes", "--server",
         tls_stack.operator_address, "--timeout", "5"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert plain.returncode == 2 and "cannot reach operator" in plain.stderr
    node = tls_stack.agents[0].node_name
    manifest = tmp_path / "pool.yaml"
    manifest.write_text(
        "apiVersion: cilium.io/v2alpha1\nkind: CiliumPodIPPool\nmetadata: {name: blue}\n"
        "spec: {ipv4: {cidrs: [10.239.0.0/16], maskSize: 24}}\n"
    )
    as_node = subprocess.run(
        [str(VENV_BIN / "cilia-operator"), "apply", "-f", str(manifest), "--server",
         tls_stack.operator_address, *tls_stack.client_tls_args(f"node-{node}")],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert as_node.returncode == 2 and "PERMISSION_DENIED" in as_node.stderr
    got = tls_stack.operator_cli("get", "ciliumpodippools")
    assert "blue" not in got.stdout


def test_agents_reconnect_with_renewed_certificates_after_rotation(tls_stack: Stack) -> None:
    pids = [a.pid for a in tls_stack.agents]
    before = [_log(tls_stack, i).count("registered with operator") for i in range(2)]
    # renew every pair under a new CA: a certificate from before no longer verifies, so an
    # agent registers again only if it dials with the renewed files
    for name in ("ca.crt", "ca.key"):
        (tls_stack.tls_dir / name).unlink()
    tls_stack.issue_certs()
    tls_stack.restart("operator")  # drops the agents' connections
    for index in range(2):
        assert wait_for(
            lambda i=index: _log(tls_stack, i).count("registered with operator") > before[i],
            REGISTER_SECONDS,
        ), tls_stack.logs()
        assert "TLS client files reloaded" in _log(tls_stack, index)
    assert [a.pid for a in tls_stack.agents] == pids
