"""The agent's ``--tls-operator-*`` flags: all three or none, and a certificate made for
another node is reported at start."""

from __future__ import annotations

import logging
import pathlib

import pydantic
import pytest

from cilia_agent.config import Config
from cilia_agent.controlplane.operator import warn_foreign_certificate
from cilia_common.tls import generate_bundle


def _flags(directory: pathlib.Path, node: str) -> dict[str, object]:
    bundle = generate_bundle(directory, server_hosts=["127.0.0.1"], nodes=[node], days=1)
    cert, key = bundle.clients[f"node-{node}"]
    return {
        "tls_operator_server_ca_files": [bundle.ca_cert],
        "tls_operator_client_cert_file": cert,
        "tls_operator_client_key_file": key,
    }


def test_tls_flags_come_together() -> None:
    with pytest.raises(pydantic.ValidationError, match="give all three"):
        Config(node_name="n1", tls_operator_client_cert_file="x.crt")
    assert Config(node_name="n1").operator_tls is None


def test_certificate_of_another_node_is_logged_as_an_error(
    tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture
) -> None:
    flags = _flags(tmp_path, "n1")
    own = Config(node_name="n1", **flags)  # type: ignore[arg-type]
    assert own.operator_tls is not None and own.operator_tls.ca_files == tuple(
        flags["tls_operator_server_ca_files"]  # type: ignore[call-overload]
    )
    with caplog.at_level(logging.ERROR):
        warn_foreign_certificate(own)
        assert not caplog.records
        warn_foreign_certificate(Config(node_name="n2", **flags))  # type: ignore[arg-type]
    assert [r.getMessage() for r in caplog.records] == [
        "operator client certificate is not this node's: the operator will refuse this "
        "agent's writes (PERMISSION_DENIED)"
    ]
