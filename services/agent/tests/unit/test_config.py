"""Config validation, flag parsing and CLI behaviour without an agent."""

from __future__ import annotations

import json
import pathlib

import pytest
from pydantic import ValidationError

from cilia_agent.__main__ import main
from cilia_agent.cni import conflist_document
from cilia_agent.config import Config, parse_pre_allocation
from cilia_agent.controlplane import backoff_delay
from cilia_agent.endpoint.manager import AddParams, InvalidRequest, validate_add


def test_defaults_match_the_brief() -> None:
    c = Config(node_name="n1")
    assert c.operator == "127.0.0.1:4250"
    assert c.state_dir == pathlib.Path("/var/run/cilia/state")
    assert c.socket == pathlib.Path("/var/run/cilia/cilia.sock")
    assert c.cni_conf_dir == pathlib.Path("/etc/cni/net.d")
    assert c.cni_conf_name == "05-cilia.conflist"
    assert (c.cni_log_file, c.mtu, c.host_device_name) == ("", 1500, "cilia_host")
    assert c.ipam_multi_pool_pre_allocation == {"default": 8}
    assert (c.prometheus_serve_addr, c.install_iptables_rules, c.log_level) == (
        ":9962",
        True,
        "info",
    )
    assert c.metrics_listen() == ("0.0.0.0", 9962)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("mtu", 10),
        ("host_device_name", "much_too_long_name"),
        ("ipam_multi_pool_pre_allocation", "default=x"),
        ("install_iptables_rules", "maybe"),
        ("log_level", "loud"),
        ("operator", "nohost"),
        ("cni_conf_name", "x.json"),
        ("prometheus_serve_addr", "9962"),
    ],
)
def test_invalid_values_name_the_field(field: str, value: object) -> None:
    with pytest.raises(ValidationError) as err:
        Config.model_validate({"node_name": "n", field: value})
    assert err.value.errors()[0]["loc"][0] == field


def test_pre_allocation_parses_pool_list() -> None:
    assert parse_pre_allocation("default=8, blue=0") == {"default": 8, "blue": 0}
    assert parse_pre_allocation("") == {}


def test_serve_with_bad_flag_exits_2_naming_it(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--mtu", "5"]) == 2
    assert "--mtu" in capsys.readouterr().err


def test_cli_without_running_agent_exits_2_with_one_line(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    sock = str(tmp_path / "none.sock")
    assert main(["status", "--socket", sock]) == 2
    assert main(["endpoint", "list", "--socket", sock, "-o", "json"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and all(line.startswith("cilia-agent: agent not running") for line in err)


def test_version_flag_prints_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0 and "cilia-agent 0.1.0" in capsys.readouterr().out


def test_conflist_document_shape() -> None:
    doc = conflist_document(pathlib.Path("/run/c.sock"), "/var/log/cni.log")
    assert json.loads(json.dumps(doc)) == {
        "cniVersion": "1.0.0",
        "name": "cilia",
        "plugins": [
            {"type": "cilia-cni", "agent-socket": "/run/c.sock", "log-file": "/var/log/cni.log"}
        ],
    }
    assert "log-file" not in conflist_document(pathlib.Path("/run/c.sock"))["plugins"][0]


def test_backoff_doubles_and_is_capped() -> None:
    assert [backoff_delay(i, 1, 30) for i in range(7)] == [1, 2, 4, 8, 16, 30, 30]
    assert backoff_delay(10_000, 1, 30) == 30


@pytest.mark.parametrize(
    ("params", "field"),
    [
        (AddParams("", "eth0", "/x"), "container_id"),
        (AddParams("c", "", "/x"), "ifname"),
        (AddParams("c", "a/b", "/x"), "ifname"),
        (AddParams("c", "eth0", "rel"), "netns"),
        (AddParams("c", "eth0", "/x", pool="Bad_Pool"), "pool"),
        (AddParams("c", "eth0", "/x", mtu=70000), "mtu"),
    ],
)
def test_add_validation_names_the_bad_field(params: AddParams, field: str) -> None:
    with pytest.raises(InvalidRequest) as err:
        validate_add(params)
    assert err.value.field == field
