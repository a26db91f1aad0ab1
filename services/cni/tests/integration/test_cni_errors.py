"""Error paths that are decided before (or without) the agent: spec error JSON on stdout,
non-zero exit, the offending variable or field named, nothing on stderr."""

from __future__ import annotations

import json
import os
import socket
import subprocess
from typing import Any

import pytest
from cni_testlib import (
    EXEC_TIMEOUT_SECONDS,
    CniRun,
    assert_cni_error,
    cni_binary,
    cni_env,
    exec_cni,
    netconf,
)

from cilia_testkit import skips


def test_missing_cni_command_fails_with_code_4() -> None:
    run = exec_cni({}, b"")
    assert_cni_error(run, 4, "CNI_COMMAND")
    assert run.stderr == ""


@pytest.mark.parametrize("command", ["add", "check", "FROB"])
def test_unsupported_cni_command_fails_with_code_4_listing_supported_ones(
    command: str, absent_socket: str
) -> None:
    run = exec_cni(cni_env(command), netconf(absent_socket))
    assert_cni_error(run, 4, "CNI_COMMAND", "ADD, DEL, CHECK, VERSION, STATUS, GC")


@pytest.mark.parametrize("command", ["ADD", "DEL", "CHECK"])
@pytest.mark.parametrize("variable", ["CNI_CONTAINERID", "CNI_IFNAME"])
def test_missing_required_variable_fails_with_code_4_naming_it(
    command: str, variable: str, absent_socket: str
) -> None:
    env = cni_env(command)
    del env[variable]
    assert_cni_error(exec_cni(env, netconf(absent_socket)), 4, variable)


@pytest.mark.parametrize("command", ["ADD", "CHECK"])
def test_add_and_check_without_netns_fail_with_code_4(command: str, absent_socket: str) -> None:
    env = cni_env(command)
    del env["CNI_NETNS"]
    assert_cni_error(exec_cni(env, netconf(absent_socket)), 4, "CNI_NETNS")


def test_gc_without_cni_path_fails_with_code_4(absent_socket: str) -> None:
    env = {"CNI_COMMAND": "GC"}
    assert_cni_error(exec_cni(env, netconf(absent_socket, version="1.1.0")), 4, "CNI_PATH")


@pytest.mark.parametrize(
    ("variable", "value"),
    [
        ("CNI_CONTAINERID", "-starts-with-dash"),
        ("CNI_CONTAINERID", "has space"),
        ("CNI_IFNAME", "a-very-long-ifname0"),
        ("CNI_IFNAME", "eth/0"),
        ("CNI_IFNAME", ".."),
        # the kernel makes "eth%d" a template and names the link eth0, eth1, ...: the agent
        # then found no "eth%d" and failed with an internal error (code 999)
        ("CNI_IFNAME", "eth%d"),
        ("CNI_NETNS", "relative/netns"),
    ],
)
def test_malformed_variable_fails_with_code_4_naming_it(
    variable: str, value: str, absent_socket: str
) -> None:
    run = exec_cni(cni_env("ADD", **{variable: value}), netconf(absent_socket))
    assert_cni_error(run, 4, variable)


@pytest.mark.parametrize("command", ["ADD", "CHECK", "DEL"])
def test_a_5000_char_container_id_fails_with_code_4_quoting_only_its_start(
    command: str, absent_socket: str
) -> None:
    run = exec_cni(cni_env(command, CNI_CONTAINERID="a" * 5000), netconf(absent_socket))
    err = assert_cni_error(run, 4, "CNI_CONTAINERID", "5000 characters", "longer than 255")
    assert "a" * 100 not in err["msg"] + err["details"]
    # 255 is accepted as far as the environment goes (the absent agent socket fails next).
    ok = exec_cni(cni_env("ADD", CNI_CONTAINERID="a" * 255), netconf(absent_socket))
    assert ok.json["code"] != 4, ok


@pytest.mark.parametrize("cni_args", ["K8S_POD_NAME", "A=B;", "=x", "A=B=C", "A=1;;B=2"])
def test_malformed_cni_args_fails_with_code_4(cni_args: str, absent_socket: str) -> None:
    run = exec_cni(cni_env("ADD", CNI_ARGS=cni_args), netconf(absent_socket))
    assert_cni_error(run, 4, "CNI_ARGS")


@pytest.mark.parametrize(
    "stdin",
    [b"", b"{", b'{"cniVersion": "1.0.0",}', b"\xff\xfe{}", b"NaN", b"[]", b'"cilia"', b"[" * 5000],
)
def test_undecodable_stdin_fails_with_code_6(stdin: bytes) -> None:
    assert_cni_error(exec_cni(cni_env("ADD"), stdin), 6, "stdin")


def test_missing_cni_version_fails_with_code_7(absent_socket: str) -> None:
    conf = netconf(absent_socket)
    del conf["cniVersion"]
    assert_cni_error(exec_cni(cni_env("ADD"), conf), 7, "`cniVersion`")


@pytest.mark.parametrize("command", ["ADD", "DEL", "CHECK", "GC", "STATUS"])
@pytest.mark.parametrize("version", ["0.2.0", "0.1.0", "1.2.0", "1.0"])
def test_unsupported_cni_version_fails_with_code_1(
    command: str, version: str, absent_socket: str
) -> None:
    run = exec_cni(cni_env(command), netconf(absent_socket, version=version))
    assert_cni_error(run, 1, version, "0.3.0, 0.3.1, 0.4.0, 1.0.0, 1.1.0")


@pytest.mark.parametrize(
    ("command", "version"),
    [("CHECK", "0.3.0"), ("CHECK", "0.3.1"), ("GC", "1.0.0"), ("GC", "0.4.0"), ("STATUS", "1.0.0")],
)
def test_command_newer_than_the_config_version_fails_with_code_1(
    command: str, version: str, absent_socket: str
) -> None:
    run = exec_cni(cni_env(command), netconf(absent_socket, version=version))
    assert_cni_error(run, 1, command, "does not allow")


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"name": None}, "`name`"),
        ({"name": ""}, "`name`"),
        ({"name": "-bad"}, "`name`"),
        ({"name": 7}, "`name`"),
        ({"type": None}, "`type`"),
        ({"type": "bridge"}, "`type`"),
        ({"agent-socket": "relative.sock"}, "`agent-socket`"),
        ({"agent-socket": 5}, "`agent-socket`"),
        ({"agent-socket": "/" + "s" * 120}, "`agent-socket`"),
        ({"agent-timeout-seconds": 0}, "`agent-timeout-seconds`"),
        ({"agent-timeout-seconds": -1}, "`agent-timeout-seconds`"),
        ({"agent-timeout-seconds": "30"}, "`agent-timeout-seconds`"),
        ({"agent-timeout-seconds": True}, "`agent-timeout-seconds`"),
        ({"agent-timeout-seconds": 1e9}, "`agent-timeout-seconds`"),
        ({"agent-del-timeout-seconds": 0}, "`agent-del-timeout-seconds`"),
        ({"log-file": "relative.log"}, "`log-file`"),
        ({"mtu": 20}, "`mtu`"),
        ({"args": []}, "`args`"),
        ({"args": {"cni": "x"}}, "`args.cni`"),
        ({"args": {"cni": {"labels": {"app": "web"}}}}, "`args.cni.labels`"),
        ({"args": {"cni": {"labels": ["app=web"]}}}, "`args.cni.labels[0]`"),
        ({"args": {"cni": {"labels": [{"value": "web"}]}}}, "`args.cni.labels[0].key`"),
        ({"args": {"cni": {"labels": [{"key": "app", "value": 1}]}}}, "`args.cni.labels[0].value`"),
        (
            {"args": {"cni": {"labels": [{"key": "a", "value": "1"}, {"key": "a", "value": "2"}]}}},
            "`args.cni.labels[1].key`",
        ),
        ({"prevResult": []}, "`prevResult`"),
        ({"prevResult": {"ips": [{"address": 5}]}}, "`prevResult.ips[0].address`"),
        ({"prevResult": {"ips": [{"address": "10.0.0.1/32", "interface": 3}]}}, "interface"),
        ({"prevResult": {"interfaces": "eth0"}}, "`prevResult.interfaces`"),
        ({"args": {"cni": {"annotations": []}}}, "`args.cni.annotations`"),
        ({"args": {"cni": {"annotations": {"a": 1}}}}, "`args.cni.annotations.a`"),
        ({"runtimeConfig": {"io.kubernetes.cri.pod-annotations": "x"}}, "pod-annotations"),
        ({"del-queue-dir": "relative"}, "`del-queue-dir`"),
        ({"del-queue-max": 0}, "`del-queue-max`"),
        ({"del-queue-max": "256"}, "`del-queue-max`"),
        ({"agent-max-response-bytes": 1023}, "`agent-max-response-bytes`"),
        ({"agent-max-response-bytes": 4.5}, "`agent-max-response-bytes`"),
    ],
)
def test_invalid_network_config_fails_with_code_7_naming_the_field(
    change: dict[str, Any], field: str, absent_socket: str
) -> None:
    conf = netconf(absent_socket)
    for key, value in change.items():
        if value is None:
            del conf[key]
        else:
            conf[key] = value
    run = exec_cni(cni_env("ADD"), conf)
    err = assert_cni_error(run, 7, field)
    assert err["cniVersion"] == "1.0.0"


def test_error_json_is_in_the_netconf_version(absent_socket: str) -> None:
    conf = netconf(absent_socket, version="1.1.0")
    del conf["name"]
    assert assert_cni_error(exec_cni(cni_env("ADD"), conf), 7)["cniVersion"] == "1.1.0"


def test_add_fails_with_code_11_when_agent_socket_is_absent(absent_socket: str) -> None:
    run = exec_cni(cni_env("ADD"), netconf(absent_socket))
    assert_cni_error(run, 11, absent_socket, "does not exist", "cilia-agent")
    assert run.stderr == ""


def test_add_with_default_socket_names_the_default_path_when_agent_is_absent() -> None:
    if os.path.exists("/var/run/cilia/cilia.sock"):
        skips.host_in_use("an agent socket exists at the default path on this host")
    conf = netconf("unused")
    del conf["agent-socket"]
    run = exec_cni(cni_env("ADD"), conf)
    assert_cni_error(run, 11, "/var/run/cilia/cilia.sock", "start or check cilia-agent")


def test_add_fails_with_code_11_when_nothing_listens_on_the_socket(short_tmp: str) -> None:
    path = os.path.join(short_tmp, "dead.sock")
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(path)  # bound but never listening: connections are refused
        run = exec_cni(cni_env("ADD"), netconf(path))
    err = assert_cni_error(run, 11, path, "cilia-agent")
    assert "UNAVAILABLE" in err["details"]
    assert run.stderr == ""


def test_add_fails_with_code_11_when_socket_path_is_not_a_socket(short_tmp: str) -> None:
    path = os.path.join(short_tmp, "plain-file")
    with open(path, "w"):
        pass
    assert_cni_error(exec_cni(cni_env("ADD"), netconf(path)), 11, "not a unix socket")


def test_check_without_prev_result_fails_with_code_7(absent_socket: str) -> None:
    run = exec_cni(cni_env("CHECK"), netconf(absent_socket, version="1.0.0"))
    assert_cni_error(run, 7, "`prevResult`")


def test_status_fails_with_code_50_when_agent_socket_is_absent(absent_socket: str) -> None:
    run = exec_cni({"CNI_COMMAND": "STATUS"}, netconf(absent_socket, version="1.1.0"))
    assert_cni_error(run, 50, absent_socket)


@pytest.mark.parametrize(
    ("attachments", "field"),
    [
        ({"a": 1}, "`cni.dev/attachments`"),
        ([{"containerID": "c1"}], "`cni.dev/attachments[0].ifname`"),
        (["c1"], "`cni.dev/attachments[0]`"),
    ],
)
def test_gc_with_malformed_attachments_fails_with_code_7(
    attachments: Any, field: str, absent_socket: str
) -> None:
    conf = netconf(absent_socket, version="1.1.0", **{"cni.dev/attachments": attachments})
    run = exec_cni({"CNI_COMMAND": "GC", "CNI_PATH": "/opt/cni/bin"}, conf)
    assert_cni_error(run, 7, field)


def test_gc_prefers_valid_attachments_and_names_it_when_malformed(absent_socket: str) -> None:
    conf = netconf(
        absent_socket,
        version="1.1.0",
        **{"cni.dev/valid-attachments": [{"containerID": "c1"}], "cni.dev/attachments": []},
    )
    run = exec_cni({"CNI_COMMAND": "GC", "CNI_PATH": "/opt/cni/bin"}, conf)
    assert_cni_error(run, 7, "`cni.dev/valid-attachments[0].ifname`")


def test_gc_without_any_keep_list_key_fails_with_code_7_naming_both(absent_socket: str) -> None:
    """Neither key: refused before the agent is even looked for (an absent key must never
    read as "keep nothing")."""
    run = exec_cni(
        {"CNI_COMMAND": "GC", "CNI_PATH": "/opt/cni/bin"}, netconf(absent_socket, version="1.1.0")
    )
    assert_cni_error(run, 7, "`cni.dev/valid-attachments`", "`cni.dev/attachments`")


@pytest.mark.parametrize("command", ["ADD", "DEL", "VERSION"])
def test_stdin_that_is_a_directory_is_code_5(command: str) -> None:
    """``cilia-cni < /``: CPython cannot even start with such a stdin; the launcher hands
    the plugin a closed stdin and says why, so the runtime still gets the spec error."""
    fd = os.open("/", os.O_RDONLY | os.O_DIRECTORY)
    try:
        proc = subprocess.run(
            [cni_binary()],
            stdin=fd,
            env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), **cni_env(command)},
            capture_output=True,
            timeout=EXEC_TIMEOUT_SECONDS,
            check=False,
        )
    finally:
        os.close(fd)
    run = CniRun(proc.returncode, proc.stdout.decode(), proc.stderr.decode())
    assert run.returncode == 1, run
    assert_cni_error(run, 5, "stdin is a directory")
    assert run.stderr == ""


def test_launcher_ignores_the_runtimes_python_variables(absent_socket: str) -> None:
    """python3 -I: PYTHONPATH/PYTHONSTARTUP/PYTHONHOME in the runtime's environment never
    reach the plugin (a PYTHONPATH shadowing `json` would break every command)."""
    env = cni_env("ADD", PYTHONPATH="/nonexistent", PYTHONHOME="/nonexistent")
    run = exec_cni(env, netconf(absent_socket))
    assert_cni_error(run, 11, absent_socket)


@pytest.mark.parametrize("command", ["ADD", "VERSION"])
def test_endless_stdin_is_code_6_naming_the_limit(command: str) -> None:
    """``cilia-cni < /dev/zero`` reads MAX_STDIN_BYTES + 1 bytes and stops (before: read
    until memory ran out)."""
    from cilia_cni.plugin import MAX_STDIN_BYTES

    with open("/dev/zero", "rb") as zero:
        proc = subprocess.run(
            [cni_binary()],
            stdin=zero,
            env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), **cni_env(command)},
            capture_output=True,
            timeout=EXEC_TIMEOUT_SECONDS,
            check=False,
        )
    run = CniRun(proc.returncode, proc.stdout.decode(), proc.stderr.decode())
    assert_cni_error(run, 6, str(MAX_STDIN_BYTES), "MAX_STDIN_BYTES")
    assert run.stderr == ""


def test_stdin_of_exactly_the_limit_is_read_and_decoded(absent_socket: str) -> None:
    """The limit itself is allowed: a netconf padded with spaces to MAX_STDIN_BYTES reaches
    the next check (the absent agent socket, 11)."""
    from cilia_cni.plugin import MAX_STDIN_BYTES

    data = json.dumps(netconf(absent_socket)).encode()
    run = exec_cni(cni_env("ADD"), data + b" " * (MAX_STDIN_BYTES - len(data)))
    assert_cni_error(run, 11, absent_socket)
    over = exec_cni(cni_env("ADD"), data + b" " * (MAX_STDIN_BYTES + 1 - len(data)))
    assert_cni_error(over, 6, "MAX_STDIN_BYTES")


LONE = "\ud800"


@pytest.mark.parametrize("command", ["ADD", "DEL"])
@pytest.mark.parametrize(
    ("extra", "field"),
    [
        (
            {"args": {"cni": {"labels": [{"key": "a" + LONE, "value": "v"}]}}},
            "args.cni.labels[0].key",
        ),
        (
            {"args": {"cni": {"labels": [{"key": "app", "value": LONE}]}}},
            "args.cni.labels[0].value",
        ),
        ({"args": {"cni": {"annotations": {"k": LONE}}}}, "args.cni.annotations.k"),
        (
            {"runtimeConfig": {"io.kubernetes.cri.pod-annotations": {"k": "x" + LONE}}},
            "runtimeConfig.io.kubernetes.cri.pod-annotations.k",
        ),
        ({"runtimeConfig": {"other": [LONE]}}, "runtimeConfig.other[0]"),
        ({"agent-socket": "/tmp/" + LONE}, "agent-socket"),
        ({"log-file": "/tmp/cilia-cni-t-" + LONE}, "log-file"),
        ({"del-queue-dir": "/tmp/" + LONE}, "del-queue-dir"),
        ({"cni.dev/valid-attachments": [{"containerID": LONE, "ifname": "e"}]}, "containerID"),
        ({"x" + LONE: 1}, "(top level)"),
    ],
)
def test_lone_surrogate_escape_anywhere_is_code_6_naming_the_field(
    command: str, extra: dict[str, Any], field: str, absent_socket: str
) -> None:
    """``"\\ud800"`` decodes to a str no UTF-8 encode accepts (protobuf, the log, paths):
    refused once at decode time (before: 999 "UnicodeEncodeError: surrogates not allowed")."""
    data = json.dumps(netconf(absent_socket, **extra))  # ensure_ascii: "\ud800" escapes
    assert "\\ud800" in data
    run = exec_cni(cni_env(command), data.encode())
    assert_cni_error(run, 6, field, "not valid Unicode")
    assert run.stderr == ""
    assert not os.path.exists("/tmp/cilia-cni-t-" + LONE)


def test_a_valid_surrogate_pair_escape_is_accepted(absent_socket: str) -> None:
    """``"\\ud83d\\ude00"`` is one character (U+1F600): it reaches the next check."""
    conf = netconf(absent_socket, args={"cni": {"labels": [{"key": "app", "value": "\U0001f600"}]}})
    run = exec_cni(cni_env("ADD"), json.dumps(conf).encode())
    assert_cni_error(run, 11, absent_socket)


def test_log_file_that_is_a_fifo_without_reader_never_hangs(
    absent_socket: str, short_tmp: str
) -> None:
    """Before: open(2) of the FIFO blocked until the exec timeout. Now the log fails at once
    (reported on stderr, as any unwritable log-file) and the operation goes on: 11."""
    fifo = os.path.join(short_tmp, "log.fifo")
    os.mkfifo(fifo)
    run = exec_cni(cni_env("ADD"), netconf(absent_socket, **{"log-file": fifo}), timeout=30)
    assert_cni_error(run, 11, absent_socket)
    assert "cannot write log-file" in run.stderr and fifo in run.stderr
