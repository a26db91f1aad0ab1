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
from cilia_agent.endpoint.errors import InvalidRequest
from cilia_agent.endpoint.params import AddParams, validate_add


def test_defaults_match_the_brief() -> None:
    c = Config(node_name="n1")
    assert c.operator == "127.0.0.1:4250"
    assert c.state_dir == pathlib.Path("/var/run/cilia/state")
    assert c.socket == pathlib.Path("/var/run/cilia/cilia.sock")
    assert c.cni_conf_dir == pathlib.Path("/etc/cni/net.d")
    assert c.cni_conf_name == "05-cilia.conflist"
    assert (c.cni_log_file, c.mtu, c.host_device_name) == ("", 0, "cilia_host")  # 0 = detect
    assert (c.ipv4_node, c.k8s_api_server, c.k8s_kubeconfig_path) == ("auto", "", "")
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
        ("mtu", 67),
        ("operator", "k8s:kube-system"),
        ("operator", "k8s:Kube_System/cilia-operator"),
        ("operator", "k8s:/cilia-operator"),
        ("ipv4_node", "eth0"),
        ("ipv4_node", "2001:db8::1"),
        ("operator_discovery_interval", 0),
        ("host_device_name", "much_too_long_name"),
        ("ipam_multi_pool_pre_allocation", "default=x"),
        ("install_iptables_rules", "maybe"),
        ("log_level", "loud"),
        ("operator", "nohost"),
        ("cni_conf_name", "x.json"),
        ("prometheus_serve_addr", "9962"),
        ("hubble_event_buffer_capacity", 4096),
        ("hubble_event_buffer_capacity", 0),
        ("hubble_event_buffer_capacity", 65536),
        ("bpf_events_ringbuf_pages", 48),
        ("enable_policy", "sometimes"),
        ("enable_bpf", "perhaps"),
        ("hubble_listen_address", "4244"),
        ("endpoint_policy_wait_timeout", 0),
    ],
)
def test_invalid_values_name_the_field(field: str, value: object) -> None:
    with pytest.raises(ValidationError) as err:
        Config.model_validate({"node_name": "n", field: value})
    assert err.value.errors()[0]["loc"][0] == field


def test_datapath_and_hubble_defaults() -> None:
    c = Config(node_name="n1", socket="/run/x/cilia.sock")
    assert c.enable_bpf is True and c.enable_policy == "default"
    assert c.bpf_pin_dir == pathlib.Path("/sys/fs/bpf/cilia")
    assert (c.bpf_policy_map_max, c.bpf_ct_global_max, c.bpf_ipcache_map_max) == (
        65536,
        262144,
        512000,
    )
    assert (c.bpf_events_ringbuf_pages, c.hubble_event_buffer_capacity) == (64, 4095)
    assert c.hubble_event_queue_size == 0 and c.endpoint_policy_wait_timeout == 10
    assert c.hubble_socket_path() == pathlib.Path("/run/x/hubble.sock")
    assert c.hubble_listen() == "0.0.0.0:4244" and c.hubble_port() == 4244
    off = Config(node_name="n1", hubble_listen_address="")
    assert off.hubble_listen() is None and off.hubble_port() == 0


def test_bad_hubble_capacity_is_refused_by_serve(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--hubble-event-buffer-capacity", "4096"]) == 2
    err = capsys.readouterr().err
    assert "--hubble-event-buffer-capacity" in err and "2^n-1" in err


def test_bpf_commands_without_pinned_maps_exit_1(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["bpf", "policy", "list", "--bpf-root", str(tmp_path)]) == 1
    assert main(["bpf", "ipcache", "list", "--bpf-pin-dir", str(tmp_path)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and all("cannot open pinned map" in line for line in err)


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
        (AddParams("c", "eth%d", "/x"), "ifname"),  # a kernel name template, not a name
        (AddParams("c", "\u00e9" * 8, "/x"), "ifname"),  # 8 characters but 16 bytes
        (AddParams("c", "eth0", "rel"), "netns"),
        (AddParams("c", "eth0", "/x", pool="Bad_Pool"), "pool"),
        (AddParams("c", "eth0", "/x", mtu=70000), "mtu"),
    ],
)
def test_add_validation_names_the_bad_field(params: AddParams, field: str) -> None:
    with pytest.raises(InvalidRequest) as err:
        validate_add(params)
    assert err.value.field == field


def test_ipam_mode_defaults_to_multi_pool_and_refuses_unknown_modes(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert Config().ipam == "multi-pool"
    assert Config(ipam="cluster-pool").ipam == "cluster-pool"
    assert main(["serve", "--ipam", "crd"]) == 2
    assert "--ipam:" in capsys.readouterr().err


def test_cni_flags_defaults_and_parsing(tmp_path: pathlib.Path) -> None:
    c = Config(node_name="n1")
    assert c.cni_del_queue_dir == pathlib.Path("/var/run/cilia/del-queue")
    assert (c.cni_exclusive, c.cni_uninstall, c.cni_del_queue_replay_interval) == (
        False,
        False,
        5.0,
    )
    c = Config.model_validate(
        {"cni_exclusive": "true", "cni_uninstall": "yes", "cni_del_queue_dir": "rel/q"}
    )
    assert c.cni_exclusive and c.cni_uninstall
    assert c.cni_del_queue_dir.is_absolute() and c.cni_del_queue_dir.name == "q"
    with pytest.raises(ValidationError) as err:
        Config(cni_del_queue_replay_interval=0)
    assert "cni_del_queue_replay_interval" in str(err.value)
    assert main(["serve", "--cni-exclusive", "maybe"]) == 2
    assert Config(node_name="n1").cni_chaining_mode == "none"
    assert Config.model_validate({"cni_chaining_mode": "portmap"}).cni_chaining_mode == "portmap"
    assert main(["serve", "--cni-chaining-mode", "flannel"]) == 2


@pytest.mark.parametrize(
    "flag",
    ["--state-dir", "--socket", "--cni-conf-dir", "--cni-del-queue-dir", "--bpf-dir",
     "--bpf-pin-dir", "--hubble-socket", "--cgroup-root"],
)  # fmt: skip
def test_an_empty_path_flag_is_a_usage_error_not_the_working_directory(
    flag: str, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    """``--cgroup-root ""`` mounted a cgroup2 over the working directory and ``--state-dir ""``
    wrote node.json into it: "" is refused before anything starts (``--cni-log-file ""`` stays
    "no log")."""
    cwd, not_a_dir = tmp_path / "cwd", tmp_path / "file"
    cwd.mkdir()
    not_a_dir.write_text("")
    monkeypatch.chdir(cwd)
    # were "" accepted, the start would stop early on this state dir (no BPF, no listeners)
    guard = ["--state-dir", str(not_a_dir), "--enable-bpf", "false", "--prometheus-serve-addr",
             "", "--hubble-listen-address", ""]  # fmt: skip
    assert main(["serve", "--operator", "", *guard, flag, ""]) == 2
    assert capsys.readouterr().err == (
        f"cilia-agent: {flag}: '' is empty: give a path (it is not the working directory)\n"
    )
    assert list(cwd.iterdir()) == []
    assert Config.model_validate({"cni_log_file": ""}).cni_log_file == ""


def test_relative_path_flags_are_resolved_against_the_cwd_and_logged(
    tmp_path: pathlib.Path,
) -> None:
    """Every path flag of ``serve``, given relative, through the real parser and main():
    the agent logs the absolute path it uses for each (start-up then fails on purpose:
    ``--state-dir`` names a regular file, so nothing is served)."""
    import subprocess
    import sys

    (tmp_path / "state").write_text("not a directory")
    flags = {
        "--state-dir": "state",
        "--socket": "run/cilia.sock",
        "--cni-conf-dir": "net.d",
        "--cni-log-file": "cni.log",
        "--cni-del-queue-dir": "q",
        "--bpf-dir": "bpf",
        "--bpf-pin-dir": "pins",
        "--hubble-socket": "run/hubble.sock",
    }
    argv = [sys.executable, "-m", "cilia_agent", "serve", "--node-name", "rel-paths"]
    for flag, value in flags.items():
        argv += [flag, value]
    argv += ["--operator", "", "--enable-bpf", "false", "--prometheus-serve-addr", ""]
    got = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert got.returncode == 1 and "cannot create state dir" in got.stderr, got.stderr
    for flag, value in flags.items():
        assert (
            f"{flag}: relative path '{value}' resolved against the working directory "
            f"to {tmp_path / value}"
        ) in got.stderr, flag
    c = Config.model_validate({"cni_log_file": "cni.log", "cni_conf_dir": "/etc/cni/net.d"})
    assert c.cni_log_file == str(pathlib.Path.cwd() / "cni.log")
    assert c.relative_path_notes({"cni_conf_dir": "/etc/cni/net.d", "cni_log_file": ""}) == []


@pytest.mark.parametrize(
    "argv",
    [["status", "--socket", ""], ["endpoint", "list", "--socket", " "],
     ["bpf", "ipcache", "list", "--bpf-root", ""], ["service", "list", "--bpf-pin-dir", ""]],
)  # fmt: skip
def test_an_empty_path_flag_of_a_client_command_is_a_usage_error(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    """``status --socket ""`` dialled ``unix:<cwd>``: the client commands refuse "" too."""
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    assert "is empty: give a path (it is not the working directory)" in capsys.readouterr().err
