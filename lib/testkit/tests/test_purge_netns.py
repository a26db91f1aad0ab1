"""``scripts/stack.sh purge`` deletes only leftover namespaces whose owner is gone: on a shared
host another run's live namespaces stay (privileged: real ``ip netns``)."""

from __future__ import annotations

import os
import subprocess
import sys

from cilia_testkit import skips
from cilia_testkit.netns import NETNS_DIR, OWNER_DIR, create_netns, delete_netns, netns_owner
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
