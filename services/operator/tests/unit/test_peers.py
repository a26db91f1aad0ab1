"""peer_ip: the caller's address from gRPC's peer string."""

from __future__ import annotations

import pytest

from cilia_operator.controlplane.peers import peer_ip


class Context:
    def __init__(self, peer: str) -> None:
        self._peer = peer

    def peer(self) -> str:
        return self._peer


@pytest.mark.parametrize(
    ("peer", "ip"),
    [
        ("ipv4:198.18.0.11:54321", "198.18.0.11"),
        ("ipv6:[fd00::1]:54321", "fd00::1"),
        ("unix:/run/cilia/operator.sock", ""),
        ("ipv4:not-an-ip:1", ""),
        ("", ""),
    ],
)
def test_peer_ip_reads_the_callers_address(peer: str, ip: str) -> None:
    assert peer_ip(Context(peer)) == ip


def test_a_context_without_peer_is_no_address() -> None:
    assert peer_ip(object()) == ""
