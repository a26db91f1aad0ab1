"""``--operator k8s:NAMESPACE/SERVICE`` without an API server: the EndpointSlice reading,
the gRPC target, and where the API server is taken from (``controlplane/kubeapi``)."""

from __future__ import annotations

import base64
import json
import pathlib

import pytest

from cilia_agent.config import Config
from cilia_agent.controlplane.discovery import (
    parse_operator_service,
    ready_addresses,
    target_of,
)
from cilia_agent.controlplane.kubeapi import (
    KubeConfigError,
    from_kubeconfig,
    in_cluster,
    resolve_access,
    server_url,
)


def _slice(port: int, *endpoints: dict[str, object], kind: str = "IPv4") -> dict[str, object]:
    return {"addressType": kind, "ports": [{"name": "grpc", "port": port}],
            "endpoints": list(endpoints)}  # fmt: skip


def test_ready_addresses_take_ready_ipv4_endpoints_on_the_grpc_port_sorted() -> None:
    slices = [
        _slice(4250, {"addresses": ["10.0.0.12"]},  # ready unset = ready (EndpointSlice API)
               {"addresses": ["10.0.0.2"], "conditions": {"ready": True}},
               {"addresses": ["10.0.0.3"], "conditions": {"ready": False}}),
        _slice(4250, {"addresses": ["fd00::1"]}, kind="IPv6"),
        {"addressType": "IPv4", "ports": [{"name": "metrics", "port": 9963}],
         "endpoints": [{"addresses": ["10.0.0.4"]}]},
    ]  # fmt: skip
    assert ready_addresses(slices) == ["10.0.0.2:4250", "10.0.0.12:4250"]
    assert target_of(["10.0.0.2:4250", "10.0.0.12:4250"]) == "ipv4:10.0.0.2:4250,10.0.0.12:4250"


def test_operator_flag_forms() -> None:
    assert parse_operator_service("k8s:kube-system/cilia-operator") == (
        "kube-system", "cilia-operator")  # fmt: skip
    assert parse_operator_service("10.0.0.1:4250") is None
    assert Config(operator="k8s:cilia-system/cilia-operator").operator.startswith("k8s:")
    with pytest.raises(ValueError, match="k8s:NAMESPACE/SERVICE"):
        parse_operator_service("k8s:cilia-system")


def test_in_cluster_takes_the_env_and_the_service_account_files(tmp_path: pathlib.Path) -> None:
    (tmp_path / "token").write_text("tok\n")
    (tmp_path / "ca.crt").write_text("ca")
    env = {"KUBERNETES_SERVICE_HOST": "192.0.2.1", "KUBERNETES_SERVICE_PORT": "6443"}
    access = in_cluster(env, tmp_path)
    assert access is not None
    assert (access.server, access.ca_file, access.bearer()) == (
        "https://192.0.2.1:6443", str(tmp_path / "ca.crt"), "tok")  # fmt: skip
    assert in_cluster({}, tmp_path) is None
    v6 = in_cluster({"KUBERNETES_SERVICE_HOST": "fd00::1"}, tmp_path)
    assert v6 is not None and v6.server == "https://[fd00::1]:443"
    with pytest.raises(KubeConfigError, match="KUBERNETES_SERVICE_PORT"):
        in_cluster({"KUBERNETES_SERVICE_HOST": "h", "KUBERNETES_SERVICE_PORT": "x"}, tmp_path)


def test_k8s_api_server_replaces_the_server_and_nothing_at_all_is_one_clear_error(
    tmp_path: pathlib.Path,
) -> None:
    env = {"KUBERNETES_SERVICE_HOST": "10.96.0.1", "KUBERNETES_SERVICE_PORT": "443"}
    (tmp_path / "token").write_text("tok")
    access = resolve_access("", "127.0.0.1:6445", env=env, sa_dir=tmp_path)
    assert access.server == "https://127.0.0.1:6445" and access.bearer() == "tok"
    assert server_url("http://localhost:8080/") == "http://localhost:8080"
    with pytest.raises(KubeConfigError, match="k8sServiceHost"):
        resolve_access("", "", env={}, sa_dir=tmp_path)
    with pytest.raises(KubeConfigError, match="--k8s-api-server"):
        server_url("ftp://x")


def test_a_kubeconfig_gives_server_ca_and_credentials(tmp_path: pathlib.Path) -> None:
    doc = {
        "apiVersion": "v1", "kind": "Config", "current-context": "c",
        "contexts": [{"name": "c", "context": {"cluster": "k", "user": "u"}}],
        "clusters": [{"name": "k", "cluster": {
            "server": "https://192.0.2.5:6443/",
            "certificate-authority-data": base64.b64encode(b"PEM").decode()}}],
        "users": [{"name": "u", "user": {"tokenFile": "tok"}}],
    }  # fmt: skip
    path = tmp_path / "kc"
    path.write_text(json.dumps(doc))
    (tmp_path / "tok").write_text("secret")
    access = from_kubeconfig(str(path))
    assert access.server == "https://192.0.2.5:6443"
    assert pathlib.Path(access.ca_file).read_bytes() == b"PEM"
    assert access.bearer() == "secret"
    path.write_text("current-context: missing\n")
    with pytest.raises(KubeConfigError, match="no context named 'missing'"):
        from_kubeconfig(str(path))


def test_serve_with_k8s_operator_and_no_api_server_refuses_before_any_change(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path
) -> None:
    from cilia_agent.__main__ import main

    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    state = tmp_path / "state"
    code = main(["serve", "--operator", "k8s:cilia-system/cilia-operator",
                 "--state-dir", str(state)])  # fmt: skip
    assert code == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "cilia-agent: cannot start: --operator k8s:cilia-system/cilia-operator: the API server "
        "is unknown: set KUBERNETES_SERVICE_HOST/KUBERNETES_SERVICE_PORT (the chart's "
        "k8sServiceHost/k8sServicePort), --k8s-api-server or --k8s-kubeconfig-path"
    ]
    assert not state.exists()  # nothing was set up
