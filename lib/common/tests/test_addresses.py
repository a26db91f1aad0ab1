"""The one address grammar: host:port, [v6]:port, :port, unix:/path."""

from __future__ import annotations

import pytest
from pydantic import BaseModel, ValidationError

from cilia_common.addresses import (
    Address,
    TCPAddress,
    dial_target,
    grpc_listen_target,
    is_address,
    split_host_port,
)


@pytest.mark.parametrize(
    ("text", "parts"),
    [
        ("127.0.0.1:4250", ("127.0.0.1", 4250)),
        (":9963", ("", 9963)),
        ("[::1]:0", ("::1", 0)),
        ("node-1.example:65535", ("node-1.example", 65535)),
    ],
)
def test_host_and_port_are_split(text: str, parts: tuple[str, int]) -> None:
    assert split_host_port(text) == parts
    assert is_address(text) and is_address(text, unix=False)


@pytest.mark.parametrize("text", ["", "localhost", "9962", "h:port", "h:65536", "h:-1"])
def test_malformed_tcp_addresses_are_refused_naming_the_flag(text: str) -> None:
    with pytest.raises(ValueError, match=r"^--listen: .* is not \[HOST\]:PORT$"):
        split_host_port(text, flag="--listen")
    assert not is_address(text)


def test_unix_sockets_need_a_path_and_may_be_refused() -> None:
    assert is_address("unix:/run/cilia.sock")
    assert not is_address("unix:")
    assert not is_address("unix:/run/cilia.sock", unix=False)


def test_go_all_interfaces_form_becomes_a_grpc_target() -> None:
    assert grpc_listen_target(":4245") == "[::]:4245"
    assert grpc_listen_target("127.0.0.1:0") == "127.0.0.1:0"
    assert grpc_listen_target("unix:/x.sock") == "unix:/x.sock"
    assert dial_target(":4245") == "localhost:4245"
    assert dial_target("unix:/x.sock") == "unix:/x.sock"


class _Config(BaseModel):
    listen: Address = ":4245"
    metrics: TCPAddress = ""


def test_pydantic_types_validate_and_name_the_field() -> None:
    assert _Config(listen="unix:/run/r.sock", metrics="127.0.0.1:0").metrics == "127.0.0.1:0"
    with pytest.raises(ValidationError) as err:
        _Config(listen="nowhere")
    assert err.value.errors()[0]["loc"] == ("listen",)
    assert "is not host:port, :port or unix:/path" in str(err.value)
    with pytest.raises(ValidationError) as err:
        _Config(metrics="unix:/m.sock")
    assert err.value.errors()[0]["loc"] == ("metrics",)
