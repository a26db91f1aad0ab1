"""The one metrics endpoint: binds port 0, reports the bound address, serves the registry."""

from __future__ import annotations

import socket
import urllib.request

import pytest
from prometheus_client import CollectorRegistry, Counter

from cilia_common.addresses import split_host_port
from cilia_common.grpcserver import BindError
from cilia_common.metrics import start_metrics_server


def test_port_zero_is_bound_and_scraped_over_http() -> None:
    registry = CollectorRegistry()
    adds = Counter("cilia_test_adds", "ADDs served", registry=registry)
    adds.inc(3)
    server = start_metrics_server("127.0.0.1:0", registry, flag="--prometheus-serve-addr")
    try:
        host, port = split_host_port(server.address)
        assert host == "127.0.0.1" and port == server.port and port > 0
        with urllib.request.urlopen(f"http://{server.address}/metrics", timeout=5) as reply:
            body = reply.read().decode()
        assert "cilia_test_adds_total 3.0" in body
    finally:
        server.close()
    with pytest.raises(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
        pass
    server.close()  # idempotent


def test_a_taken_port_is_a_bind_error_naming_the_flag() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(BindError) as err:
            start_metrics_server(f"127.0.0.1:{port}", CollectorRegistry(), flag="--metrics")
    assert str(err.value).startswith(f"--metrics: cannot listen on 127.0.0.1:{port}")


def test_a_malformed_address_is_a_bind_error_naming_the_flag() -> None:
    with pytest.raises(BindError, match=r"^--prometheus-serve-addr: 'localhost' is not"):
        start_metrics_server("localhost", CollectorRegistry(), flag="--prometheus-serve-addr")


def test_an_empty_host_means_all_interfaces() -> None:
    server = start_metrics_server(":0", CollectorRegistry(), flag="--m")
    try:
        assert server.address == f"0.0.0.0:{server.port}"
        with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=5) as r:
            assert r.status == 200
    finally:
        server.close()
