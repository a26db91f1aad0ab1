"""The frozen ``cilia-cni`` (services/cni/freeze: PyInstaller onedir bundle) as a host gets it,
against a real cilia-agent, with no Python anywhere in its environment.

The bundle is installed the way the DaemonSet's init container installs it
(``deploy/images/cni-install.sh`` into a temporary ``/opt/cni``-like tree: a versioned copy
plus the ``bin/cilia-cni`` wrapper) and every exec gets exactly the CNI spec's variables and
``PATH=/nonexistent`` (``env -i``): no ``python3`` can be found, no ``PYTHON*`` variable is
set. While one ADD runs (held at its stdin read), ``/proc/<pid>/exe`` and ``/proc/<pid>/maps``
show that the process is the bundle's executable and that it maps no file from a Python
installation (no ``.venv``, pyenv, ``/usr/lib/python3*`` or ``/usr/bin/python*``): only the
bundle's own libpython and modules and the system's C libraries.

Last, a root filesystem with nothing but the bundle and the C libraries it links (no
``python3``, no ``sh``, no libpython but the bundle's, no ``/proc``) runs it through
``chroot``: VERSION, spec errors (6; 5 for a stdin that is a directory, which the launcher
handles itself there), and ADD + DEL against the real agent, whose socket is hard-linked
into it.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import shutil
import subprocess
import time
from typing import Any

import pytest
from realagent import Netns, RealAgent, sh

from cilia_testkit import ROOT

INSTALLER = ROOT / "deploy" / "images" / "cni-install.sh"
BUILDER = ROOT / "services" / "cni" / "freeze" / "build.py"
#: Seconds one plugin exec may take (the plugin's own agent deadlines are 30 s and 10 s).
EXEC_TIMEOUT_SECONDS = 60.0
#: Seconds to wait for the plugin to map its libraries before reading /proc/<pid>/maps.
MAPS_WAIT_SECONDS = 20.0
#: Paths of a Python installation that the frozen plugin must not map.
HOST_PYTHON_MARKERS = ("/.venv/", "/.pyenv/", "/usr/lib/python3", "/usr/bin/python", ".tox/")


@pytest.fixture(scope="module")
def bundle() -> pathlib.Path:
    """The frozen bundle's directory, from the cache scripts/setup.sh fills (built if missing)."""
    res = subprocess.run(
        [str(ROOT / ".venv" / "bin" / "python"), str(BUILDER)],
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert res.returncode == 0, f"the frozen cilia-cni could not be built: {res.stderr}"
    executable = pathlib.Path(res.stdout.strip())
    assert executable.is_file() and os.access(executable, os.X_OK), executable
    return executable.parent


@pytest.fixture
def installed(bundle: pathlib.Path, short_tmp: str) -> pathlib.Path:
    """``cilia-cni-install`` run against a temporary host tree; returns ``<bin>/cilia-cni``."""
    host = pathlib.Path(short_tmp) / "opt-cni"
    env = {
        "PATH": "/usr/sbin:/usr/bin:/sbin:/bin",
        "CILIA_CNI_BUNDLE": str(bundle),
        "CILIA_CNI_BIN_DIR": str(host / "bin"),
        "CILIA_CNI_LIB_DIR": str(host / "cilia"),
        "CILIA_CNI_HOST_LIB_DIR": str(host / "cilia"),
    }
    # an earlier version's install: a sh wrapper exec'ing its copy, which a runtime may
    # still be running; the new install keeps that copy and removes the older one
    (host / "bin").mkdir(parents=True)
    for name in ("0.0.9-old", "0.0.8-older"):
        (host / "cilia" / name).mkdir(parents=True)
    wrapper = host / "bin" / "cilia-cni"
    wrapper.write_text(f'#!/bin/sh\nexec {host}/cilia/0.0.9-old/cilia-cni "$@"\n')
    res = subprocess.run(["sh", str(INSTALLER)], env=env, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert {p.name for p in (host / "cilia").iterdir()} >= {"0.0.9-old"}
    assert not (host / "cilia" / "0.0.8-older").exists()
    # the plugin is a symbolic link to the new copy (no sh exec per call); installing again
    # replaces the link and removes the copy no link names any more
    link = host / "bin" / "cilia-cni"
    assert link.is_symlink(), "the plugin is a link to its copy"
    res = subprocess.run(["sh", str(INSTALLER)], env=env, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert not list((host / "bin").glob(".cilia-cni*")), "temporary link left behind"
    copies = list((host / "cilia").iterdir())
    assert len(copies) == 1 and not copies[0].name.startswith("."), copies
    assert os.readlink(link) == f"{copies[0]}/cilia-cni"
    assert not [p for p in copies[0].rglob("*") if p.name in ("python", "python3")], (
        "the bundle must carry no python executable"
    )
    return host / "bin" / "cilia-cni"


def _env(command: str, **cni: str) -> dict[str, str]:
    """Exactly what a runtime sets (``env -i``) plus a PATH where nothing can be found."""
    return {"PATH": "/nonexistent", "CNI_COMMAND": command, **cni}


def _exec(plugin: pathlib.Path, env: dict[str, str], stdin: bytes) -> tuple[int, dict[str, Any]]:
    proc = subprocess.run(
        [str(plugin)],
        env=env,
        input=stdin,
        capture_output=True,
        timeout=EXEC_TIMEOUT_SECONDS,
        check=False,
    )
    assert b"Traceback" not in proc.stdout + proc.stderr, proc
    out = json.loads(proc.stdout) if proc.stdout.strip() else {}
    return proc.returncode, out


def _netconf(agent: RealAgent, **extra: Any) -> bytes:
    conflist = agent.conflist()
    conf = dict(conflist["plugins"][0], name=conflist["name"], cniVersion=conflist["cniVersion"])
    conf.update(extra)
    return json.dumps(conf).encode()


def _spec_error(code: int, out: dict[str, Any], rc: int, needle: str) -> None:
    assert rc == 1, out
    assert set(out) == {"cniVersion", "code", "msg", "details"}, out
    assert out["code"] == code, out
    assert needle in out["msg"], out


def test_version_and_bad_config_give_the_spec_json_without_python(installed: pathlib.Path) -> None:
    rc, out = _exec(installed, _env("VERSION"), b'{"cniVersion": "0.4.0"}')
    assert rc == 0, out
    assert out["cniVersion"] == "0.4.0"
    assert out["supportedVersions"] == ["0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0"]

    add_env = _env(
        "ADD",
        CNI_CONTAINERID="frozen-bad",
        CNI_NETNS="/var/run/netns/none",
        CNI_IFNAME="eth0",
        CNI_PATH="/nonexistent",
    )
    rc, out = _exec(installed, add_env, b"{not json")
    _spec_error(6, out, rc, "JSON")
    rc, out = _exec(
        installed, add_env, b'{"cniVersion": "9.9.9", "name": "n", "type": "cilia-cni"}'
    )
    _spec_error(1, out, rc, "9.9.9")
    rc, out = _exec(installed, add_env, b'{"cniVersion": "1.0.0", "type": "cilia-cni"}')
    _spec_error(7, out, rc, "`name`")
    rc, out = _exec(installed, _env("ADD", CNI_NETNS="/x", CNI_IFNAME="eth0"), b"{}")
    _spec_error(4, out, rc, "CNI_CONTAINERID")
    # stdin a directory: the embedded interpreter cannot start with one; the launcher hands
    # the plugin --stdin-is-a-directory and the plugin answers code 5 (I/O failure).
    root = os.open("/", os.O_RDONLY | os.O_DIRECTORY)
    try:
        proc = subprocess.run(
            [str(installed)], env=_env("VERSION"), stdin=root, capture_output=True, timeout=30
        )
    finally:
        os.close(root)
    assert proc.returncode == 1, proc
    assert json.loads(proc.stdout)["code"] == 5, proc


def test_add_del_against_the_real_agent_with_no_host_python(
    installed: pathlib.Path, bundle: pathlib.Path, real_agent: RealAgent, netns: Netns
) -> None:
    ns = netns.add()
    cni = {
        "CNI_CONTAINERID": "frozen-1",
        "CNI_NETNS": ns,
        "CNI_IFNAME": "eth0",
        "CNI_PATH": str(installed.parent),
        "CNI_ARGS": "IgnoreUnknown=1;K8S_POD_NAMESPACE=team;K8S_POD_NAME=frozen-0",
    }
    # ADD, held at its stdin read while /proc/<pid> is inspected
    proc = subprocess.Popen(
        [str(installed)],
        env=_env("ADD", **cni),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        maps = _maps_once_loaded(proc.pid)
        exe = os.readlink(f"/proc/{proc.pid}/exe")
        environ = pathlib.Path(f"/proc/{proc.pid}/environ").read_bytes().split(b"\0")
        stdout, stderr = proc.communicate(_netconf(real_agent), timeout=EXEC_TIMEOUT_SECONDS)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, (stdout, stderr)
    assert pathlib.Path(exe).name == "cilia-cni" and pathlib.Path(exe).parent.parent == (
        installed.parent.parent / "cilia"
    ), exe
    assert not [e for e in environ if e.startswith(b"PYTHON")], environ
    mapped = {line.split(None, 5)[5] for line in maps.splitlines() if len(line.split()) == 6}
    python_files = [m for m in mapped if any(marker in m for marker in HOST_PYTHON_MARKERS)]
    assert not python_files, python_files
    libpython = [m for m in mapped if "libpython3" in m]
    assert libpython and all(m.startswith(str(exe.rpartition("/")[0])) for m in libpython), mapped
    assert str(bundle) not in maps, "the host copy runs, not the build cache"

    result = json.loads(stdout)
    ip = result["ips"][0]["address"]
    container_if = result["interfaces"][result["ips"][0]["interface"]]
    assert container_if["name"] == "eth0" and container_if["sandbox"] == ns, result
    addrs = json.loads(sh("ip", "-4", "-n", os.path.basename(ns), "-j", "addr", "show", "eth0"))
    assert ip in {f"{a['local']}/{a['prefixlen']}" for a in addrs[0]["addr_info"]}, addrs
    assert [(c, i) for c, i, _ in real_agent.endpoints()] == [("frozen-1", "eth0")]

    rc, out = _exec(installed, _env("DEL", **cni), _netconf(real_agent, prevResult=result))
    assert (rc, out) == (0, {})
    assert real_agent.endpoints() == []


def _maps_once_loaded(pid: int) -> str:
    """``/proc/<pid>/maps`` once the plugin blocks reading its stdin (``/proc/<pid>/syscall``
    reads ``0 0x0 …``: x86-64 ``read(0, …)``), by then the interpreter and the plugin's
    modules are loaded; the wait is bounded by :data:`MAPS_WAIT_SECONDS`.

    Raises:
        AssertionError: it was not seen blocked on stdin in time.
    """
    deadline = time.monotonic() + MAPS_WAIT_SECONDS
    while time.monotonic() < deadline:
        syscall = pathlib.Path(f"/proc/{pid}/syscall").read_text().split()
        if syscall[:2] == ["0", "0x0"]:
            return pathlib.Path(f"/proc/{pid}/maps").read_text()
        time.sleep(0.01)
    raise AssertionError(f"the plugin never blocked reading stdin: syscall {syscall}")


def _c_libraries(bundle: pathlib.Path) -> set[str]:
    """Host libraries (absolute paths) the bundle needs: everything the executable (the
    launcher) links from outside the bundle (its libpython comes from the support directory,
    through its RPATH), and what the bundle's shared objects link that the bundle does not
    carry: glibc and its loader."""
    carried = {p.name for p in bundle.rglob("*.so*")}
    found: set[str] = set()
    for obj in [bundle / "cilia-cni", *bundle.rglob("*.so*")]:
        out = subprocess.run(["ldd", str(obj)], capture_output=True, text=True).stdout
        for path in re.findall(r"(/\S+) \(0x", out):
            if pathlib.Path(path).is_relative_to(bundle):
                continue
            if obj.name == "cilia-cni" or pathlib.Path(path).name not in carried:
                found.add(path)
    return found


def test_runs_in_a_root_filesystem_without_python(
    bundle: pathlib.Path, real_agent: RealAgent, netns: Netns, short_tmp: str
) -> None:
    root = pathlib.Path(short_tmp) / "root"
    shutil.copytree(bundle, root / "cilia-cni", symlinks=True)
    for lib in _c_libraries(bundle):
        dest = root / lib.lstrip("/")
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(os.path.realpath(lib), dest)
    files = [p for p in root.rglob("*") if p.is_file()]
    assert not [p for p in files if re.fullmatch(r"python3?(\.\d+)?|sh|bash|dash", p.name)]
    assert [p for p in files if p.name.startswith("libpython3")] == [
        root / "cilia-cni" / ".cilia-cni" / "libpython3.11.so.1.0"
    ]
    socket = pathlib.Path(real_agent.socket)
    (root / socket.parent.relative_to("/")).mkdir(parents=True)
    os.link(socket, root / socket.relative_to("/"))  # same inode: connect() reaches the agent

    chroot = shutil.which("chroot") or "/usr/sbin/chroot"  # coreutils

    def run(env: dict[str, str], stdin: bytes) -> tuple[int, dict[str, Any]]:
        proc = subprocess.run(
            [chroot, str(root), "/cilia-cni/cilia-cni"],
            env=env,
            input=stdin,
            capture_output=True,
            timeout=EXEC_TIMEOUT_SECONDS,
            check=False,
        )
        assert b"Traceback" not in proc.stdout + proc.stderr, proc
        return proc.returncode, (json.loads(proc.stdout) if proc.stdout.strip() else {})

    rc, out = run(_env("VERSION"), b'{"cniVersion": "1.1.0"}')
    assert (rc, out["cniVersion"]) == (0, "1.1.0"), out
    rc, out = run(_env("ADD", CNI_CONTAINERID="c", CNI_NETNS="/n", CNI_IFNAME="eth0"), b"[]")
    _spec_error(6, out, rc, "object")
    # stdin a directory and no sh here to close it: the launcher itself starts the plugin
    # with stdin closed and --stdin-is-a-directory (the embedded interpreter would abort)
    directory = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        proc = subprocess.run(
            [chroot, str(root), "/cilia-cni/cilia-cni"],
            env=_env("VERSION"),
            stdin=directory,
            capture_output=True,
            timeout=EXEC_TIMEOUT_SECONDS,
            check=False,
        )
    finally:
        os.close(directory)
    assert b"Traceback" not in proc.stdout + proc.stderr, proc
    _spec_error(5, json.loads(proc.stdout), proc.returncode, "stdin is a directory")

    ns = netns.add()
    cni = {"CNI_CONTAINERID": "frozen-chroot", "CNI_NETNS": ns, "CNI_IFNAME": "eth0"}
    # the agent's log-file (if its conflist names one) would be written inside the root
    conf = json.loads(_netconf(real_agent))
    conf.pop("log-file", None)
    rc, result = run(_env("ADD", CNI_PATH="/cilia-cni", **cni), json.dumps(conf).encode())
    assert rc == 0, result
    assert result["interfaces"][result["ips"][0]["interface"]]["sandbox"] == ns, result
    assert [(c, i) for c, i, _ in real_agent.endpoints()] == [("frozen-chroot", "eth0")]
    conf["prevResult"] = result
    rc, out = run(_env("DEL", CNI_PATH="/cilia-cni", **cni), json.dumps(conf).encode())
    assert (rc, out) == (0, {})
    assert real_agent.endpoints() == []


def test_install_keeps_the_copy_the_previous_link_names_whatever_the_lib_dir_is_called(
    tmp_path: pathlib.Path,
) -> None:
    """Two installs of different bundles into a lib dir not named ``cilia``
    (``CILIA_CNI_HOST_LIB_DIR=/opt/cni/plugins-lib``): the second keeps the first copy, which
    the old link named and a runtime may still be exec'ing, beside its own. (A stand-in
    bundle: a sh script answering VERSION, so no freeze build is needed.)"""
    lib = tmp_path / "plugins-lib"
    env = {
        "PATH": "/usr/sbin:/usr/bin:/sbin:/bin",
        "CILIA_CNI_BIN_DIR": str(tmp_path / "bin"),
        "CILIA_CNI_LIB_DIR": str(lib),
        "CILIA_CNI_HOST_LIB_DIR": str(lib),
    }
    for name in ("a", "b"):
        src = tmp_path / f"bundle-{name}"
        (src / ".cilia-cni").mkdir(parents=True)
        (src / ".cilia-cni" / "cilia-cni.version").write_text("0.1.0\n")
        plugin = src / "cilia-cni"
        plugin.write_text(f'#!/bin/sh\necho \'{{"cniVersion": "1.0.0", "build": "{name}"}}\'\n')
        plugin.chmod(0o755)
        res = subprocess.run(
            ["sh", str(INSTALLER)],
            env={**env, "CILIA_CNI_BUNDLE": str(src)},
            capture_output=True,
            text=True,
            check=False,
        )
        assert res.returncode == 0, res.stderr
    copies = sorted(p.name for p in lib.iterdir())
    link = os.readlink(tmp_path / "bin" / "cilia-cni")
    assert len(copies) == 2, f"the previous copy was removed: {copies}"
    assert link.startswith(f"{lib}/") and link.split("/")[-2] in copies, (link, copies)
