"""Cilia's test and dev kit: one place for what tests, benches and the demo share.

Modules (standard library + pytest only; importable without root):

- :mod:`cilia_testkit.cni` — libcni emulation: exec a plugin as a runtime does, conflists
  (chained plugins), :class:`~cilia_testkit.cni.Pod`;
- :mod:`cilia_testkit.netns` — named network namespaces: create, delete, list, ping, and a
  registry with a per-suite prefix that removes what it made;
- :mod:`cilia_testkit.host` — host commands, polling, host links, the iptables FORWARD policy;
- :mod:`cilia_testkit.bpfmaps` — the agent's pinned BPF maps read through ``bpftool``;
- :mod:`cilia_testkit.stack` — :class:`~cilia_testkit.stack.Stack`: redis, operator, agents,
  relay from ``.venv/bin`` with their own run dir, sockets, BPF pins, device names and TCP
  ports the servers bind themselves;
- :mod:`cilia_testkit.plugin` — the pytest plugin (fixtures ``netns_registry``, ``testkit_stack``).
"""

from __future__ import annotations

import pathlib

#: The repository root (this package is installed editable from ``lib/testkit/src``).
ROOT = pathlib.Path(__file__).resolve().parents[4]
#: The project's virtualenv commands (``cilia-agent``, ``cilia-cni`` …), installed by
#: ``scripts/setup.sh``.
VENV_BIN = ROOT / ".venv" / "bin"

__all__ = ["ROOT", "VENV_BIN"]
