"""``cilia-agent init`` logic without root: versions, the iptables rule, sysctl parsing and
files, mount decisions and the messages a person reads."""

from __future__ import annotations

import argparse
import io
import pathlib
import subprocess

import pytest

from cilia_agent import preflight
from cilia_agent.__main__ import _build_parser, main
from cilia_agent.preflight import cleanup, iptables_backend, kernel, sysctl
from cilia_agent.preflight.cli import run
from cilia_agent.preflight.mounts import MountError, bind_root, ensure_mounted

MOUNTS = """\
/dev/root / ext4 rw 0 0
bpf /sys/fs/bpf bpf rw 0 0
tmpfs /run/cilia/cgroupv2 tmpfs rw 0 0
none /run/other/cgroupv2 cgroup2 rw 0 0
"""


@pytest.mark.parametrize(
    ("release", "want"),
    [("6.1.0-18-amd64", (6, 1, 0)), ("5.18", (5, 18, 0)), ("6.18.44-fc-v669", (6, 18, 44))],
)
def test_kernel_release_is_read_up_to_the_first_dash(release: str, want: tuple[int, ...]) -> None:
    assert kernel.parse_version(release) == want


def test_a_release_that_is_no_version_is_refused() -> None:
    with pytest.raises(ValueError, match="not a kernel version"):
        kernel.parse_version("linux")


def test_default_minimum_is_the_newest_feature_in_use() -> None:
    # bpf_set_retval (5.18) is optional (bpf_sock_compat.o without it): 5.10 either way
    assert kernel.required_version({"bpf", "socklb"}) == (5, 10)  # bpf_redirect_neigh
    assert kernel.required_version({"bpf"}) == (5, 10)
    assert kernel.required_version({"socklb"}) == (5, 8)  # getpeername4
    retval = next(f for f in kernel.FEATURES if f.name == "bpf_set_retval")
    assert retval.need == "optional" and retval.since == (5, 18)
    assert kernel.required_version(set()) == (0, 0)


def test_too_old_kernel_names_the_features_that_need_more_and_what_to_do() -> None:
    with pytest.raises(kernel.KernelTooOld) as exc:
        kernel.check_version("5.4.0-28-amd64", "", {"bpf", "socklb"})
    msg = str(exc.value)
    assert msg.startswith("kernel 5.4.0 is older than 5.10 (needed by map type ringbuf")
    assert "boot a kernel >= 5.10" in msg and "--bpf-lb-sock=false" in msg
    # every default feature on 5.10 (Debian 11), the socket-LB included
    assert kernel.check_version("5.10.0-28-amd64", "", {"bpf", "socklb"}) == "kernel 5.10.0 >= 5.10"
    assert "\n" not in msg
    with pytest.raises(kernel.KernelTooOld, match=r"needed by map type ringbuf \(kernel 5\.8\+"):
        kernel.check_version("4.19.0", "", {"bpf"})
    assert kernel.check_version("5.10.0", "", {"bpf"}) == "kernel 5.10.0 >= 5.10"


def test_an_explicit_minimum_wins_and_is_named_when_it_fails() -> None:
    assert kernel.check_version("5.4.0", "5.4", set()) == "kernel 5.4.0 >= 5.4.0"
    with pytest.raises(kernel.KernelTooOld, match=r"older than 6\.2\.0 \(--min-kernel-version\)"):
        kernel.check_version("6.1.0", "6.2", {"bpf"})


def test_every_feature_names_its_kernel_and_use() -> None:
    helper = next(f for f in kernel.FEATURES if f.name == "bpf_get_netns_cookie")
    assert helper.describe() == (
        "helper bpf_get_netns_cookie in cgroup_sock_addr programs (kernel 5.7+, session affinity)"
    )
    names = {f.name for f in kernel.FEATURES}
    assert {
        "sched_cls",
        "cgroup_sock_addr",
        "lpm_trie",
        "lru_hash",
        "percpu_hash",
        "ringbuf",
    } <= names


HINTED = """\
*mangle
:PREROUTING ACCEPT [0:0]
:KUBE-IPTABLES-HINT - [0:0]
COMMIT
"""
RULES = """\
*filter
:FORWARD DROP [0:0]
-A FORWARD -j DOCKER-USER
-A FORWARD -o docker0 -j DOCKER
COMMIT
"""


def test_iptables_hint_and_rule_counting_read_save_output() -> None:
    assert iptables_backend.has_hint(HINTED)
    assert not iptables_backend.has_hint(RULES)
    assert iptables_backend.count_rules(RULES) == 2


def test_the_kubelet_hint_beats_rule_counts() -> None:
    det = iptables_backend.decide({"legacy": True}, {"nft": 100, "legacy": 0}, {"nft", "legacy"})
    assert det.backend == "legacy" and "hint" in det.reason


def test_without_hint_more_rules_win_and_a_tie_is_nft() -> None:
    both: set[iptables_backend.Backend] = {"nft", "legacy"}
    assert iptables_backend.decide({}, {"nft": 1, "legacy": 5}, both).backend == "legacy"
    assert iptables_backend.decide({}, {"nft": 5, "legacy": 1}, both).backend == "nft"
    tie = iptables_backend.decide({}, {"nft": 0, "legacy": 0}, both)
    assert tie.backend == "nft" and "default" in tie.reason
    assert iptables_backend.decide({}, {}, {"legacy"}).backend == "legacy"


def test_no_iptables_at_all_says_what_to_install() -> None:
    with pytest.raises(iptables_backend.BackendError, match="install Debian's iptables"):
        iptables_backend.decide({}, {}, set())


def test_sysctl_overrides_parse_and_bad_ones_are_refused() -> None:
    s = sysctl.parse_override(" net.ipv4.conf.all.accept_local = 1 ")
    assert (s.key, s.value) == ("net.ipv4.conf.all.accept_local", "1")
    for bad in ("net.ipv4.ip_forward", "=1", "net/ipv4/ip_forward=1", "a..b=1", "x=1"):
        with pytest.raises(ValueError, match="is not key=value"):
            sysctl.parse_override(bad)


def _fake_proc(tmp: pathlib.Path) -> pathlib.Path:
    conf = tmp / "net" / "ipv4" / "conf"
    for dev in ("all", "default", "lxc1234", "lxc99", "eth0", "cilia_host"):
        (conf / dev).mkdir(parents=True)
        (conf / dev / "rp_filter").write_text("1\n")
    (tmp / "net" / "ipv4" / "ip_forward").write_text("0\n")
    return tmp


def test_sysctl_apply_expands_device_globs_and_reports_changes(tmp_path: pathlib.Path) -> None:
    root = _fake_proc(tmp_path)
    changed = sysctl.apply(sysctl.defaults("cilia_host"), root)
    assert changed == [
        "net.ipv4.ip_forward: 0 -> 1",
        "net.ipv4.conf.all.rp_filter: 1 -> 0",
        "net.ipv4.conf.lxc1234.rp_filter: 1 -> 0",
        "net.ipv4.conf.lxc99.rp_filter: 1 -> 0",
        "net.ipv4.conf.cilia_host.rp_filter: 1 -> 0",
    ]
    assert (root / "net/ipv4/conf/eth0/rp_filter").read_text().strip() == "1"
    assert sysctl.apply(sysctl.defaults("cilia_host"), root) == []  # idempotent


def test_sysctl_unknown_key_is_named(tmp_path: pathlib.Path) -> None:
    root = _fake_proc(tmp_path)
    with pytest.raises(sysctl.SysctlError, match=r"sysctl net\.ipv4\.nope does not exist"):
        sysctl.apply([sysctl.parse_override("net.ipv4.nope=1")], root)


def test_sysctl_conf_file_is_written_once(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "sysctl.d" / "99-zzz-override_cilia.conf"
    path.parent.mkdir()  # the host's /etc/sysctl.d (its missing directory: next test)
    assert sysctl.write_conf(sysctl.defaults(), path)
    text = path.read_text()
    assert "net.ipv4.conf.lxc*.rp_filter = 0\n" in text
    assert "net.ipv4.conf.all.rp_filter = 0\n" in text
    assert not sysctl.write_conf(sysctl.defaults(), path)


def test_cli_sysctl_refuses_a_conf_file_whose_directory_does_not_exist(
    tmp_path: pathlib.Path,
) -> None:
    """``--sysctl-conf-file /nonexistent/dir/x.conf`` used to create the directories; the
    directory must exist (the host's /etc/sysctl.d, mounted): nothing is created."""
    path = tmp_path / "nonexistent" / "dir" / "x.conf"
    with pytest.raises(sysctl.SysctlError, match=f"no directory {path.parent}"):
        sysctl.write_conf(sysctl.defaults(), path)
    assert not (tmp_path / "nonexistent").exists()
    err = io.StringIO()
    assert run(_args("sysctl", "--sysctl-conf-file", str(path)), io.StringIO(), err) == 1
    assert err.getvalue() == (
        f"cilia-agent init sysctl: cannot write {path}: no directory {path.parent} (mount the "
        "host's /etc/sysctl.d there, fix --sysctl-conf-file, or pass --sysctl-conf-file='')\n"
    )
    assert not (tmp_path / "nonexistent").exists()


def test_a_wrong_filesystem_at_the_mount_point_is_refused() -> None:
    with pytest.raises(MountError) as exc:
        ensure_mounted(
            pathlib.Path("/run/cilia/cgroupv2"), "cgroup2", flag="--cgroup-root", mounts=MOUNTS
        )
    assert str(exc.value) == (
        "/run/cilia/cgroupv2 is a tmpfs mount, not cgroup2; unmount it (umount "
        "/run/cilia/cgroupv2) or choose another path with --cgroup-root"
    )
    assert not ensure_mounted(
        pathlib.Path("/run/other/cgroupv2"), "cgroup2", flag="f", mounts=MOUNTS
    )
    assert not ensure_mounted(pathlib.Path("/sys/fs/bpf"), "bpf", flag="f", mounts=MOUNTS)


def test_clean_refuses_a_pin_dir_that_is_not_on_bpffs(tmp_path: pathlib.Path) -> None:
    (tmp_path / "pins").mkdir()
    (tmp_path / "pins" / "keep").write_text("x")
    with pytest.raises(cleanup.CleanError, match="not bpffs: refusing to empty it"):
        cleanup.clean_bpf(tmp_path / "pins", cleanup.Report(), mounts=MOUNTS)
    assert (tmp_path / "pins" / "keep").exists()


def test_clean_requests_come_from_flags_or_upstream_env_names() -> None:
    assert cleanup.env_requests({"CILIUM_BPF_STATE": "true"}) == (True, False)
    assert cleanup.env_requests({"CILIUM_ALL_STATE": " TRUE "}) == (False, True)
    assert cleanup.env_requests({"CILIUM_ALL_STATE": "false", "CILIUM_BPF_STATE": "1"}) == (
        False,
        False,
    )


def test_no_agent_is_seen_on_a_stale_socket_file(tmp_path: pathlib.Path) -> None:
    import socket

    path = tmp_path / "cilia.sock"
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(path))  # bound, not listening: what a dead agent leaves behind
    try:
        assert not cleanup.agent_running(path)
        s.listen(1)
        assert cleanup.agent_running(path)
    finally:
        s.close()
    assert not cleanup.agent_running(tmp_path / "absent.sock")


def _args(*argv: str) -> argparse.Namespace:
    return _build_parser().parse_args(["init", *argv])


def test_cli_failure_is_one_line_on_stderr_with_exit_1() -> None:
    out, err = io.StringIO(), io.StringIO()
    code = run(_args("check-kernel", "--min-kernel-version", "99.1", "--no-probe"), out, err)
    assert code == preflight.EXIT_FAILED == 1
    assert out.getvalue() == ""
    lines = err.getvalue().splitlines()
    assert len(lines) == 1
    assert lines[0].startswith("cilia-agent init check-kernel: kernel ")
    assert "is older than 99.1.0 (--min-kernel-version); boot a kernel >= 99.1.0" in lines[0]


def test_cli_bad_override_is_a_usage_error_before_anything_is_written() -> None:
    err = io.StringIO()
    assert run(_args("sysctl", "--sysctl-override", "ip_forward"), io.StringIO(), err) == 2
    assert err.getvalue().startswith("cilia-agent init sysctl: --sysctl-override: 'ip_forward'")


def test_cli_clean_state_refuses_an_env_request_that_is_no_boolean(
    monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path
) -> None:
    """``CILIUM_BPF_STATE=banana`` used to count as "false" silently: a usage error now,
    before anything is looked at or removed."""
    (tmp_path / "pins").mkdir()
    monkeypatch.setenv("CILIUM_BPF_STATE", "banana")
    monkeypatch.delenv("CILIUM_ALL_STATE", raising=False)
    out, err = io.StringIO(), io.StringIO()
    args = _args("clean-state", "--bpf-pin-dir", str(tmp_path / "pins"))
    assert run(args, out, err) == preflight.EXIT_USAGE
    assert out.getvalue() == ""
    assert err.getvalue() == (
        "cilia-agent init clean-state: CILIUM_BPF_STATE='banana': not a boolean (true or "
        "false) (ConfigMap keys clean-cilia-bpf-state / clean-cilia-state)\n"
    )
    assert (tmp_path / "pins").is_dir()
    with pytest.raises(cleanup.EnvError, match="CILIUM_ALL_STATE='yes please'"):
        cleanup.env_requests({"CILIUM_ALL_STATE": "yes please"})


def test_cli_clean_state_without_a_request_does_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CILIUM_BPF_STATE", raising=False)
    monkeypatch.delenv("CILIUM_ALL_STATE", raising=False)
    out = io.StringIO()
    assert run(_args("clean-state", "--bpf-pin-dir", "/nonexistent"), out, io.StringIO()) == 0
    assert "nothing requested" in out.getvalue()


def test_every_step_is_a_subcommand_and_unknown_ones_are_refused() -> None:
    for step in preflight.STEPS:
        assert _args(step).init_step == step
    with pytest.raises(SystemExit) as exc:
        main(["init", "no-such-step"])
    assert exc.value.code == 2


def test_the_socket_lb_counts_only_with_the_datapath_on() -> None:
    assert preflight.needs(True, True) == {"bpf", "socklb"}
    assert preflight.needs(True, False) == {"bpf"}
    assert preflight.needs(False, True) == set()


def test_serve_without_bpf_skips_the_bpf_checks() -> None:
    from cilia_agent.config import Config

    cfg = Config(enable_bpf=False, install_iptables_rules=False, operator="")
    assert preflight.startup_checks(cfg, "3.10.0") == preflight.StartupResult([], "")


def test_legacy_tables_are_read_from_proc_without_running_iptables(tmp_path: pathlib.Path) -> None:
    names = tmp_path / "ip_tables_names"
    assert iptables_backend._legacy_tables(names) == set()  # module not loaded
    names.write_text("mangle\nfilter\n")
    assert iptables_backend._legacy_tables(names) == {"mangle", "filter"}


@pytest.mark.parametrize(
    ("argv", "reason"),
    [
        (("mount-bpffs", "--bpffs-root", ""), "must not be empty"),
        (("mount-cgroup2", "--cgroup-root", "rel/dir"), "is relative: give an absolute path"),
        (("clean-state", "--bpf-state", "--bpf-pin-dir", ""), "must not be empty"),
        (("clean-state", "--state-dir", "x"), "is relative"),
        (("iptables-backend", "--iptables-timeout", "0"), "0 must be greater than 0"),
        (("iptables-backend", "--iptables-timeout", "-1"), "must be greater than 0"),
    ],
)
def test_empty_or_relative_paths_and_bad_timeouts_are_usage_errors(
    argv: tuple[str, ...], reason: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """An empty path must not mean the current directory (a mount over it, pins removed)."""
    with pytest.raises(SystemExit) as exc:
        _args(*argv)
    assert exc.value.code == 2
    assert reason in capsys.readouterr().err


def test_path_flags_are_normalised_so_a_mount_already_there_is_recognised() -> None:
    args = _args("mount-bpffs", "--bpffs-root", "/sys/fs/../fs/bpf/")
    assert args.bpffs_root == pathlib.Path("/sys/fs/bpf")


def test_clean_refuses_the_bpffs_mount_itself(tmp_path: pathlib.Path) -> None:
    root = tmp_path / "bpf"
    (root / "otherapp").mkdir(parents=True)
    mounts = f"bpf {root} bpf rw,relatime 0 0\n"
    with pytest.raises(cleanup.CleanError, match="is the bpffs mount itself"):
        cleanup.clean_bpf(root, cleanup.Report(), mounts=mounts)
    assert (root / "otherapp").is_dir()


@pytest.mark.parametrize(
    ("device", "code", "message"),
    [
        ("lo", 2, "cilia-agent: cannot start: devices: --devices lo: a loopback device: "
                  "NodePort traffic from other hosts never arrives on it"),
        ("doesnotexist0", 1, "cilia-agent: cannot start: devices: no interface "
                             "'doesnotexist0' on this node: check --devices"),
    ],
)  # fmt: skip
def test_serve_refuses_a_loopback_or_missing_nodeport_device_in_one_line(
    device: str, code: int, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Checked first (netlink, this netns), before the kernel is probed or anything is
    changed; before, a missing device ended the start with a nested errno tuple and ``lo``
    was accepted."""
    assert main(["serve", "--node-name", "n1", "--devices", device]) == code
    err = capsys.readouterr().err
    assert err.startswith(message) and err.count("\n") == 1, err
    assert "(19," not in err and "Errno" not in err


MOUNTINFO = """\
22 1 0:21 / / rw,relatime - overlay overlay rw
30 22 0:25 / /run rw,nosuid - tmpfs tmpfs rw
41 22 0:25 /cilia/cgroupv2 /run/cilia/cgroupv2 rw,relatime shared:5 - tmpfs tmpfs rw
42 22 0:26 / /run/other rw,relatime - tmpfs tmpfs rw
"""


def test_bind_root_names_the_directory_a_bind_mount_shows() -> None:
    assert bind_root(pathlib.Path("/run/cilia/cgroupv2"), MOUNTINFO) == "/cilia/cgroupv2"
    assert bind_root(pathlib.Path("/run/other"), MOUNTINFO) == "/"
    assert bind_root(pathlib.Path("/run/none"), MOUNTINFO) == ""


def test_a_host_path_bind_of_another_filesystem_gets_the_mount_on_top(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # the init container's own hostPath volume: /run/cilia/cgroupv2 of a host whose /run is tmpfs
    calls: list[list[str]] = []

    def fake_run(cmd: list[str], **_: object) -> subprocess.CompletedProcess[str]:
        calls.append(cmd)
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr("cilia_agent.preflight.mounts.subprocess.run", fake_run)
    monkeypatch.setattr(pathlib.Path, "mkdir", lambda *a, **k: None)
    path = pathlib.Path("/run/cilia/cgroupv2")
    assert ensure_mounted(path, "cgroup2", flag="--cgroup-root", mounts=MOUNTS, mountinfo=MOUNTINFO)
    assert calls == [["mount", "-t", "cgroup2", "none", "/run/cilia/cgroupv2"]]
    # a tmpfs mounted whole on the path is still refused
    with pytest.raises(MountError):
        ensure_mounted(
            pathlib.Path("/run/other"),
            "cgroup2",
            flag="f",
            mounts="tmpfs /run/other tmpfs rw 0 0\n",
            mountinfo=MOUNTINFO,
        )
