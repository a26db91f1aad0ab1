"""The relay's TLS flags: pairs given whole, CA before client pair, no contradiction."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from cilia_relay.config import Config


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"tls_client_cert_file": "c.crt"}, "give both or none"),
        ({"tls_client_cert_file": "c.crt", "tls_client_key_file": "c.key"},
         "needs --tls-hubble-server-ca-files"),
        ({"tls_relay_server_key_file": "s.key"}, "give both or none"),
        ({"tls_relay_client_ca_files": ["ca.crt"]}, "needs --tls-relay-server-cert-file"),
        ({"disable_server_tls": True, "tls_relay_server_cert_file": "s.crt",
          "tls_relay_server_key_file": "s.key"}, "contradicts"),
    ],
)  # fmt: skip
def test_inconsistent_tls_flags_are_refused(fields: dict[str, object], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        Config(**fields)  # type: ignore[arg-type]


def test_client_tls_is_used_unless_disabled_and_ca_files_split_on_commas() -> None:
    cfg = Config(
        tls_hubble_server_ca_files=["a.crt,b.crt"],
        tls_client_cert_file="c.crt",
        tls_client_key_file="c.key",
    )
    assert cfg.client_tls is not None and cfg.client_tls.ca_files == ("a.crt", "b.crt")
    off = Config(tls_hubble_server_ca_files=["a.crt"], disable_client_tls=True)
    assert off.client_tls is None
    assert Config().server_tls is None


def test_serve_refuses_a_missing_agent_ca_file_at_start(capsys: pytest.CaptureFixture[str]) -> None:
    from cilia_relay.__main__ import main

    code = main(["serve", "--tls-hubble-server-ca-files", "/nonexistent/ca.crt",
                 "--listen-address", "127.0.0.1:0", "--health-listen-address", "127.0.0.1:0"])  # fmt: skip
    assert code == 1
    assert "cannot start: TLS to agents: /nonexistent/ca.crt" in capsys.readouterr().err
