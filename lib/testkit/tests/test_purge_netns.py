"""``scripts/stack.sh purge`` deletes only leftover namespaces whose owner is gone: on a shared
host another run's live namespaces stay (privileged: real ``ip netns``); nor does it remove
the pins and host device another checkout's running agent uses."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import types
from typing import cast

import pytest

from cilia_testkit import skips, stackctl
from cilia_testkit.bpfmaps import DEFAULT_PIN_DIR
from cilia_testkit.host import wait_for
from cilia_testkit.netns import NETNS_DIR, OWNER_DIR, create_netns, delete_netns, netns_owner
from cilia_testkit.stack import Stack
from cilia_testkit.stackctl import remove_leftover_netns


def test_purge_keeps_namespaces_of_live_owners_and_deletes_the_rest() -> None:
    skips.require_netns("ip netns add/delete")
    tag = f"{os.getpid()}x"
    live_owner = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    gone_owner = subprocess.Popen([sys.executable, "-c", "pass"])
    gone_owner.wait()
    names = {
        "live": f"cilia-e2e-purge{tag}-live",  # another suite's running test
        "gone": f"cilia-e2e-purge{tag}-gone",  # its owner was killed: a leftover
        "mine": f"cilia-bench-purge{tag}-mine",  # this process's: alive too
        "legacy": f"cilia-tk-{gone_owner.pid}-9",  # no owner record, dead pid in the name
    }
    try:
        create_netns(names["live"], owner=live_owner.pid)
        create_netns(names["gone"], owner=gone_owner.pid)
        create_netns(names["mine"])
        create_netns(names["legacy"])
        (OWNER_DIR / names["legacy"]).unlink()
        assert netns_owner(names["live"]) == live_owner.pid
        assert netns_owner(names["mine"]) == os.getpid()
        assert netns_owner(names["gone"]) is None

        # only these names: a purge of the whole host would touch other runs' leftovers
        deleted, kept = remove_leftover_netns(only=set(names.values()))

        assert sorted(deleted) == sorted([names["gone"], names["legacy"]])
        assert kept == {
            names["live"]: f"owner pid {live_owner.pid}",
            names["mine"]: f"owner pid {os.getpid()}",
        }
        existing = {p.name for p in NETNS_DIR.iterdir()}
        assert {names["live"], names["mine"]} <= existing
        assert not {names["gone"], names["legacy"]} & existing
    finally:
        live_owner.kill()
        live_owner.wait()
        for name in names.values():
            delete_netns(name)


def test_purge_keeps_the_pins_and_host_device_another_checkouts_agent_uses(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every checkout's ``make up`` agent has the same pin dir and host device: a purge in
    one checkout must not pull them from under another's running agent (it removed them,
    and that agent went on reporting ready without a datapath). Unprivileged: the "agents"
    are processes whose command lines look like ``cilia-agent serve``."""
    pins, other = tmp_path / "pins", tmp_path / "other"
    sleep = [sys.executable, "-c", "import time; time.sleep(60)", "/x/.venv/bin/cilia-agent"]
    procs = {
        "spaced": subprocess.Popen([*sleep, "serve", "--bpf-pin-dir", str(pins)]),
        "alias": subprocess.Popen([*sleep, "serve", f"--bpf-root={pins}/"]),
        "elsewhere": subprocess.Popen([*sleep, "serve", "--bpf-pin-dir", str(other)]),
        "not-serve": subprocess.Popen([*sleep, "status", "--bpf-pin-dir", str(pins)]),
        "default": subprocess.Popen([*sleep, "serve", "--node-name", "n"]),
    }
    removed: list[str] = []
    agent = types.SimpleNamespace(
        pin_dir=pins, host_device="cilia_tkx", remove_leftovers=lambda: removed.append("x")
    )
    stack = cast(Stack, types.SimpleNamespace(agent=agent))
    monkeypatch.setattr(stackctl, "down", lambda *a, **k: 0)
    monkeypatch.setattr(stackctl, "remove_leftover_netns", lambda: ([], {}))
    monkeypatch.setattr(stackctl, "SHARED_RUN", tmp_path / "run")
    try:
        assert wait_for(lambda: len(stackctl.agents_using(pins)) == 2, 10)
        users = stackctl.agents_using(pins)
        assert users == sorted([procs["spaced"].pid, procs["alias"].pid])
        assert stackctl.agents_using(other) == [procs["elsewhere"].pid]
        assert procs["default"].pid in stackctl.agents_using(DEFAULT_PIN_DIR)

        assert stackctl.purge(stack, stop_timeout=1) == 0
        assert removed == []  # kept: agents use them

        for name in ("spaced", "alias"):
            procs[name].kill()
            procs[name].wait()
        assert stackctl.purge(stack, stop_timeout=1) == 0
        assert removed == ["x"]
    finally:
        for proc in procs.values():
            proc.kill()
            proc.wait()
