"""``cilia-agent init`` against the real kernel: BPF probes, bpffs/cgroup2 mounts on temporary
directories, a pin dir of real pinned maps cleaned, and sysctl, iptables and device changes
inside network namespaces made here (the host's own settings are left alone)."""

from __future__ import annotations

import contextlib
import ctypes
import io
import os
import pathlib
import secrets
import socket
import subprocess
import sys
from collections.abc import Iterator

import pytest

from cilia_agent import preflight
from cilia_agent.__main__ import _build_parser
from cilia_agent.datapath.bpffs import mount_point
from cilia_agent.datapath.libbpf import PinnedMap, libbpf, obj_pin
from cilia_agent.preflight import kernel
from cilia_agent.preflight.cli import run
from cilia_testkit import skips
from cilia_testkit.netns import create_netns, delete_netns

AGENT = str(pathlib.Path(sys.executable).parent / "cilia-agent")


def _cli(
    *argv: str, netns: str = "", env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    cmd = [AGENT, *argv]
    if netns:
        cmd = ["ip", "netns", "exec", netns, *cmd]
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("CILIUM_")}
    full_env.update(env or {})
    return subprocess.run(
        cmd, capture_output=True, text=True, timeout=60, env=full_env, check=False
    )


def _sh(*cmd: str) -> str:
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    assert proc.returncode == 0, f"{' '.join(cmd)}: {proc.stderr.strip()}"
    return proc.stdout


@contextlib.contextmanager
def _unmounting(*paths: pathlib.Path) -> Iterator[None]:
    try:
        yield
    finally:
        for p in paths:
            while mount_point(p)[0] == str(p):
                subprocess.run(["umount", "-l", str(p)], check=False)


@pytest.fixture
def netns() -> Iterator[str]:
    name = f"cilia-t-init-{secrets.token_hex(3)}"
    create_netns(name)
    try:
        yield name
    finally:
        delete_netns(name)


def test_probes_find_every_feature_cilia_uses_and_see_a_missing_helper() -> None:
    skips.require(skips.root_missing("BPF probes"))
    assert kernel.missing_features({"bpf", "socklb"}) == []
    # a kprobe-only helper is really absent from tc programs (libbpf 1.1 would say present)
    override = kernel.Feature(
        "helper", "bpf_override_return", 58, kernel.PROG_SCHED_CLS, (4, 16), "test", "bpf"
    )
    assert not kernel.probe(override)
    retval = kernel.Feature(
        "helper", "bpf_set_retval", 187, kernel.PROG_SCHED_CLS, (5, 18), "test", "bpf"
    )
    assert not kernel.probe(retval)  # cgroup programs only
    assert kernel.probe(next(f for f in kernel.FEATURES if f.name == "bpf_set_retval"))


def test_mounts_are_made_verified_and_a_tmpfs_in_the_way_is_refused(tmp_path: pathlib.Path) -> None:
    bpf, cg, wrong = tmp_path / "bpf", tmp_path / "cg", tmp_path / "wrong"
    with _unmounting(bpf, cg, wrong):
        assert preflight.mount_bpffs(bpf) == f"mounted bpffs on {bpf}"
        assert mount_point(bpf) == (str(bpf), "bpf")
        assert preflight.mount_bpffs(bpf) == f"bpffs already mounted on {bpf}"
        assert preflight.mount_cgroup2(cg) == f"mounted cgroup2 on {cg}"
        assert mount_point(cg) == (str(cg), "cgroup2")
        assert preflight.mount_cgroup2(cg) == f"cgroup2 already mounted on {cg}"
        with pytest.raises(preflight.PreflightError, match="is a bpf mount, not cgroup2"):
            preflight.mount_cgroup2(bpf)

        wrong.mkdir()
        _sh("mount", "-t", "tmpfs", "tmpfs", str(wrong))
        proc = _cli("init", "mount-bpffs", "--bpffs-root", str(wrong))
        assert proc.returncode == 1, proc
        assert proc.stdout == ""
        assert proc.stderr == (
            f"cilia-agent init mount-bpffs: {wrong} is a tmpfs mount, not bpf; unmount it "
            f"(umount {wrong}) or choose another path with --bpffs-root\n"
        )
        assert mount_point(wrong) == (str(wrong), "tmpfs")  # nothing mounted over it

        # the agent's own start runs the same check first and fails before any side effect
        state = tmp_path / "state"
        proc = _cli("serve", "--operator=", f"--state-dir={state}", f"--cgroup-root={wrong}",
                    f"--socket={tmp_path / 'a.sock'}", "--prometheus-serve-addr=",
                    "--hubble-listen-address=")  # fmt: skip
        assert proc.returncode == 1, proc
        assert (
            f"cilia-agent: cannot start: mount-cgroup2: {wrong} is a tmpfs mount, not cgroup2; "
            in proc.stderr
        )
        assert not state.exists()


class _Value(ctypes.Structure):
    _fields_ = [("value", ctypes.c_uint64)]


def _real_maps(pins: pathlib.Path) -> list[str]:
    """Three real kernel maps pinned under ``pins`` (hash, LRU hash, per-CPU hash)."""
    lib = libbpf()
    lib.bpf_map_create.argtypes = [
        ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32, ctypes.c_uint32, ctypes.c_uint32,
        ctypes.c_void_p,
    ]  # fmt: skip
    lib.bpf_map_create.restype = ctypes.c_int
    names = []
    for map_type, name in ((1, "cilia_endpoints"), (9, "cilia_ct"), (5, "cilia_metrics")):
        fd = lib.bpf_map_create(map_type, name.encode(), 4, 8, 16, None)
        assert fd >= 0, os.strerror(ctypes.get_errno())
        try:
            obj_pin(fd, pins / name)
        finally:
            os.close(fd)
        names.append(name)
    return names


def test_clean_state_unpins_real_maps_but_not_while_an_agent_answers(
    tmp_path: pathlib.Path,
) -> None:
    skips.require(skips.root_missing("BPF maps"))
    bpf = tmp_path / "bpf"
    pins = bpf / "cilia"
    sock = tmp_path / "cilia.sock"
    with _unmounting(bpf):
        preflight.mount_bpffs(bpf)
        pins.mkdir()
        names = _real_maps(pins)
        with PinnedMap(pins / "cilia_ct", ctypes.c_uint32, _Value) as m:
            m.update(ctypes.c_uint32(1), _Value(7))  # a real map with an entry
            assert m.lookup(ctypes.c_uint32(1)).value == 7  # type: ignore[union-attr]
        args = ("init", "clean-state", f"--bpf-pin-dir={pins}", f"--socket={sock}")

        agent = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        agent.bind(str(sock))
        agent.listen(1)
        try:
            proc = _cli(*args, "--bpf-state")
        finally:
            agent.close()
        assert proc.returncode == preflight.EXIT_AGENT_RUNNING == 3, proc
        assert proc.stderr == (
            f"cilia-agent init clean-state: an agent answers on {sock}; stop it first (its "
            "datapath uses this state)\n"
        )
        assert sorted(p.name for p in pins.iterdir()) == sorted(names)

        # the socket file is still there, but nothing listens: the agent is gone (in-process
        # from here: the CLI's exit status and message are shown above)
        parser = _build_parser()
        out = io.StringIO()
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("CILIUM_BPF_STATE", "true")
            assert run(parser.parse_args(list(args)), out, io.StringIO()) == 0
        assert out.getvalue().startswith("cilia-agent init clean-state: bpf state: removed 3: pin ")
        assert not pins.exists()
        out = io.StringIO()
        assert run(parser.parse_args([*args, "--bpf-state"]), out, io.StringIO()) == 0
        assert out.getvalue() == "cilia-agent init clean-state: bpf state: nothing to remove\n"


def test_all_state_removes_devices_routes_chain_and_state_in_a_netns(
    tmp_path: pathlib.Path, netns: str
) -> None:
    skips.require(skips.binary_missing("iptables-nft", "iptables"))
    ns = ("ip", "-n", netns)
    _sh(*ns, "link", "add", "ciliat_host", "type", "veth", "peer", "name", "ciliat_net")
    _sh(*ns, "link", "set", "ciliat_host", "up")
    _sh(*ns, "link", "add", "eth7", "type", "veth", "peer", "name", "eth8")
    _sh(*ns, "link", "set", "eth7", "up")
    _sh(*ns, "route", "add", "10.251.77.0/24", "dev", "eth7", "proto", "0xc1")  # ours
    _sh(*ns, "route", "add", "10.251.78.0/24", "dev", "eth7", "proto", "static")  # not ours
    nft = ("ip", "netns", "exec", netns, "iptables-nft")
    _sh(*nft, "-N", "CILIA_FORWARD")
    _sh(*nft, "-A", "CILIA_FORWARD", "-i", "lxc+", "-j", "ACCEPT")
    _sh(*nft, "-I", "FORWARD", "1", "-j", "CILIA_FORWARD")
    _sh(*nft, "-t", "nat", "-N", "CILIA_POST_nat")  # the masquerade chain and its jump
    _sh(*nft, "-t", "nat", "-A", "CILIA_POST_nat", "-s", "10.251.77.0/24", "-j", "MASQUERADE")
    _sh(*nft, "-t", "nat", "-I", "POSTROUTING", "1", "-j", "CILIA_POST_nat")
    _sh(*nft, "-t", "nat", "-A", "POSTROUTING", "-s", "10.9.0.0/16", "-j", "MASQUERADE")  # not ours
    state = tmp_path / "state"
    (state / "endpoints").mkdir(parents=True)
    (state / "endpoints" / "1.json").write_text("{}")
    (state / "node.json").write_text("{}")

    proc = _cli("init", "clean-state", "--all-state", f"--bpf-pin-dir={tmp_path / 'no-pins'}",
                f"--state-dir={state}", f"--socket={tmp_path / 'cilia.sock'}",
                "--host-device-name=ciliat_host", "--tunnel-device=ciliat_vx", netns=netns)  # fmt: skip
    assert proc.returncode == 0, proc
    links = _sh(*ns, "-o", "link", "show")
    assert "ciliat_host" not in links and "ciliat_net" not in links and "eth7" in links
    routes = _sh(*ns, "route", "show")
    assert "10.251.77.0/24" not in routes and "10.251.78.0/24" in routes
    saved = _sh(*nft[:-1], "iptables-nft-save")
    assert "CILIA_FORWARD" not in saved and "CILIA_POST_nat" not in saved
    assert "-A POSTROUTING -s 10.9.0.0/16 -j MASQUERADE" in saved
    assert not state.exists()
    # the legacy side was looked at without creating its tables (nothing of ours was there)
    tables = subprocess.run(["ip", "netns", "exec", netns, "cat", "/proc/net/ip_tables_names"],
                            capture_output=True, text=True, check=False).stdout  # fmt: skip
    assert tables == ""
    for what in ("route 10.251.77.0/24", "device ciliat_host",  # its veth peer goes with it
                 "iptables-nft -A FORWARD -j CILIA_FORWARD",
                 "iptables-nft -t nat -A POSTROUTING -j CILIA_POST_nat",
                 "iptables-nft -t nat -N CILIA_POST_nat", f"state dir {state} (3 entries)"):  # fmt: skip
        assert what in proc.stdout


def _read(netns: str, key: str) -> str:
    return _sh("ip", "netns", "exec", netns, "cat", f"/proc/sys/{key.replace('.', '/')}").strip()


def test_sysctl_sets_what_the_agent_needs_inside_a_netns_only(
    tmp_path: pathlib.Path, netns: str
) -> None:
    host_before = {k: _read_host(k) for k in ("net.ipv4.conf.all.rp_filter", "net.ipv4.ip_forward")}
    ns = ("ip", "-n", netns)
    _sh(*ns, "link", "add", "lxcabc", "type", "veth", "peer", "name", "eth9")
    wr = ("ip", "netns", "exec", netns, "sysctl", "-qw")
    _sh(*wr, "net.ipv4.ip_forward=0", "net.ipv4.conf.all.rp_filter=1",
        "net.ipv4.conf.lxcabc.rp_filter=1", "net.ipv4.conf.eth9.rp_filter=1")  # fmt: skip
    conf = tmp_path / "sysctl.d" / "99-zzz-override_cilia.conf"
    conf.parent.mkdir()  # the host's /etc/sysctl.d: init sysctl refuses a missing directory
    args = ("init", "sysctl", f"--sysctl-conf-file={conf}",
            "--sysctl-override=net.ipv4.conf.all.accept_local=1")  # fmt: skip

    proc = _cli(*args, netns=netns)
    assert proc.returncode == 0, proc
    assert "set net.ipv4.conf.lxcabc.rp_filter: 1 -> 0" in proc.stdout
    assert _read(netns, "net.ipv4.ip_forward") == "1"
    assert _read(netns, "net.ipv4.conf.all.rp_filter") == "0"
    assert _read(netns, "net.ipv4.conf.lxcabc.rp_filter") == "0"
    assert _read(netns, "net.ipv4.conf.eth9.rp_filter") == "1"  # not one of ours
    assert _read(netns, "net.ipv4.conf.all.accept_local") == "1"
    assert "net.ipv4.conf.lxc*.rp_filter = 0" in conf.read_text()
    assert {k: _read_host(k) for k in host_before} == host_before


def _read_host(key: str) -> str:
    return pathlib.Path("/proc/sys", *key.split(".")).read_text().strip()


def test_iptables_backend_follows_the_kubelet_hint_and_clears_the_other(netns: str) -> None:
    skips.require(
        skips.binary_missing("iptables-legacy", "iptables")
        or skips.binary_missing("iptables-nft", "iptables")
    )
    ex = ("ip", "netns", "exec", netns)
    _sh(*ex, "iptables-legacy", "-t", "mangle", "-N", "KUBE-IPTABLES-HINT")
    for _ in range(3):  # nft holds more rules: the hint must still win
        _sh(*ex, "iptables-nft", "-A", "INPUT", "-j", "ACCEPT")
    _sh(*ex, "iptables-nft", "-N", "CILIA_FORWARD")
    _sh(*ex, "iptables-nft", "-A", "FORWARD", "-j", "CILIA_FORWARD")

    proc = _cli("init", "iptables-backend", netns=netns)
    assert proc.returncode == 0, proc
    assert proc.stdout.splitlines() == [
        "cilia-agent init iptables-backend: legacy (the kubelet's hint chain is in legacy): "
        "the agent runs iptables-legacy",
        "cilia-agent init iptables-backend: removed the agent's stale rules from nft: "
        "-A FORWARD -j CILIA_FORWARD, -N CILIA_FORWARD",
    ]
    nft_rules = _sh(*ex, "iptables-nft-save")
    assert "CILIA_FORWARD" not in nft_rules and nft_rules.count("-A INPUT -j ACCEPT") == 3


_OFFLOAD_PROBE = """
import json, sys
from pyroute2.ethtool import Ethtool
f = Ethtool().get_features(sys.argv[1]).features
print(json.dumps({n: f[n].enable for n in ("tx-udp_tnl-segmentation",
                                           "tx-udp_tnl-csum-segmentation")}))
"""


def _tunnel_offload(netns: str, ifname: str) -> dict[str, bool]:
    import json

    out = _sh("ip", "netns", "exec", netns, sys.executable, "-c", _OFFLOAD_PROBE, ifname)
    result: dict[str, bool] = json.loads(out)
    return result


def test_handle_vxlan_offload_turns_tunnel_segmentation_off_only_for_a_listed_driver(
    netns: str,
) -> None:
    ns = ("ip", "-n", netns)
    _sh(*ns, "link", "add", "eth0", "type", "veth", "peer", "name", "eth1")
    _sh(*ns, "addr", "add", "192.0.2.10/24", "dev", "eth0")
    _sh(*ns, "link", "set", "eth0", "up")
    both_on = dict.fromkeys(("tx-udp_tnl-segmentation", "tx-udp_tnl-csum-segmentation"), True)
    assert _tunnel_offload(netns, "eth0") == both_on

    # the module's default: only vmxnet3 NICs are touched; a veth is left alone
    left = _cli("init", "handle-vxlan-offload", env={"NODE_IP": "192.0.2.10"}, netns=netns)
    assert left.returncode == 0, left
    assert "eth0 (driver veth): not one of vmxnet3; left alone" in left.stdout
    assert _tunnel_offload(netns, "eth0") == both_on

    done = _cli("init", "handle-vxlan-offload", "--node-ip", "192.0.2.10", "--drivers",
                "vmxnet3,veth", netns=netns)  # fmt: skip
    assert done.returncode == 0, done
    assert "turned off tx-udp_tnl-segmentation, tx-udp_tnl-csum-segmentation" in done.stdout
    assert _tunnel_offload(netns, "eth0") == dict.fromkeys(both_on, False)
    assert _tunnel_offload(netns, "eth1") == both_on  # the other end is another NIC

    missing = _cli("init", "handle-vxlan-offload", "--node-ip", "192.0.2.99", netns=netns)
    assert missing.returncode == 1
    assert missing.stderr.strip() == (
        "cilia-agent init handle-vxlan-offload: no interface holds the node IP 192.0.2.99"
    )
    unset = _cli("init", "handle-vxlan-offload", env={"NODE_IP": ""}, netns=netns)
    assert unset.returncode == 2 and "set NODE_IP or --node-ip" in unset.stderr
