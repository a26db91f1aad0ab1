"""``iptables-backend``: which iptables the host uses, nft or legacy, so the agent uses the same.

The kernel keeps two independent rule sets: the nf_tables one (``iptables-nft``) and the
legacy xtables one (``iptables-legacy``). Rules written through the wrong one still run, but
next to the host's, in an order neither side controls, and kube-proxy/kubelet/firewall
tools never see them. The rule, as upstream images decide it (the Kubernetes
``iptables-wrapper`` script Cilium's image ships, and the Deckhouse module's
clearing-unnecessary-iptables init step):

1. the kubelet marks the backend it uses with the chain ``KUBE-IPTABLES-HINT`` (or, older,
   ``KUBE-KUBELET-CANARY``) in the ``mangle`` table: look in nft first, then in legacy;
2. without a hint, the backend holding more rules (``-A`` lines of ``*-save``) wins;
3. on a tie (an empty host) nft, the default of every current distribution.

The legacy side is only read when ``/proc/net/ip_tables_names`` lists tables:
``iptables-legacy-save`` would otherwise create them (and load ``ip_tables``) just by
looking, after which every ``iptables-nft`` call warns about legacy tables.

The agent then runs ``iptables-nft`` or ``iptables-legacy`` by name for every command
(``--iptables-backend``; ``auto`` runs this detection at start, which is what the init step
runs too, so both reach the same answer). The init step also removes the agent's own chain
(``CILIA_FORWARD`` and its jump, the nat chain ``CILIA_POST_nat`` and its POSTROUTING
jump) from the *other* backend — left there when the host moved
from one to the other — and nothing else (the Deckhouse step flushes every legacy chain and
unloads the legacy modules; Cilia touches only its own rules).
"""

from __future__ import annotations

import pathlib
import shutil
import subprocess
from dataclasses import dataclass
from typing import Literal

from cilia_agent.datapath.iptables import CHAIN, NAT_CHAIN, NAT_PARENT, PARENT

Backend = Literal["nft", "legacy"]
BACKENDS: tuple[Backend, Backend] = ("nft", "legacy")
HINT_CHAINS = ("KUBE-IPTABLES-HINT", "KUBE-KUBELET-CANARY")
LEGACY_TABLES = pathlib.Path("/proc/net/ip_tables_names")


class BackendError(Exception):
    """No usable iptables binary, or a save command failed (message names it and what to do)."""


def binary(backend: Backend, family: str = "iptables") -> str:
    """``iptables-nft`` / ``iptables-legacy`` (``family`` "ip6tables" for v6)."""
    return f"{family}-{backend}"


@dataclass(frozen=True)
class Detection:
    """The chosen backend and why (``reason`` is one log line)."""

    backend: Backend
    reason: str


def _save(backend: Backend, timeout: float, table: str | None = None) -> str | None:
    """``iptables-<backend>-save [-t table]`` output; None when the binary is missing."""
    exe = shutil.which(f"iptables-{backend}-save")
    if exe is None:
        return None
    cmd = [exe] + (["-t", table] if table else [])
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise BackendError(f"{' '.join(cmd)}: {exc}") from exc
    if proc.returncode != 0:
        # a kernel without that backend's tables (no nf_tables, no ip_tables): nothing there
        return ""
    return proc.stdout


def has_hint(save_output: str) -> bool:
    """True when ``save_output`` (of ``-t mangle``) declares a kubelet hint chain."""
    return any(line.split()[0][1:] in HINT_CHAINS for line in save_output.splitlines()
               if line.startswith(":"))  # fmt: skip


def count_rules(save_output: str) -> int:
    """Number of rules (``-A`` lines) in ``*-save`` output."""
    return sum(1 for line in save_output.splitlines() if line.startswith("-A "))


def decide(
    hint: dict[Backend, bool], rules: dict[Backend, int], available: set[Backend]
) -> Detection:
    """The rule of the module docstring, on already-read facts (pure).

    Raises:
        BackendError: neither backend's binaries are installed.
    """
    if not available:
        raise BackendError(
            "neither iptables-nft nor iptables-legacy is installed; install Debian's iptables "
            "package (or run with --install-iptables-rules=false)"
        )
    for b in BACKENDS:
        if b in available and hint.get(b):
            return Detection(b, f"the kubelet's hint chain is in {b}")
    if len(available) == 1:
        (only,) = available
        return Detection(only, f"only iptables-{only} is installed")
    nft, legacy = rules.get("nft", 0), rules.get("legacy", 0)
    if legacy > nft:
        return Detection("legacy", f"legacy holds more rules ({legacy} > {nft})")
    if nft > legacy:
        return Detection("nft", f"nft holds more rules ({nft} > {legacy})")
    return Detection("nft", f"no hint and as many rules in both ({nft}): the default nft")


def detect(timeout: float = 10.0) -> Detection:
    """Read both backends in this network namespace and decide (see the module docstring).

    Args:
        timeout: seconds each ``*-save`` may take (``--iptables-timeout``).

    Raises:
        BackendError: no backend installed, or a save command hung.
    """
    hint: dict[Backend, bool] = {}
    rules: dict[Backend, int] = {}
    available: set[Backend] = set()
    legacy_tables = _legacy_tables()
    for b in BACKENDS:
        if shutil.which(f"iptables-{b}-save") is None:
            continue
        available.add(b)
        if b == "legacy" and "mangle" not in legacy_tables:
            hint[b] = False  # not read: reading would create the legacy tables
            continue
        hint[b] = has_hint(_save(b, timeout, "mangle") or "")
    if not any(hint.values()) and len(available) == 2:
        for b in BACKENDS:
            empty = b == "legacy" and not legacy_tables
            rules[b] = 0 if empty else count_rules(_save(b, timeout) or "")
    return decide(hint, rules, available)


def _legacy_tables(path: pathlib.Path = LEGACY_TABLES) -> set[str]:
    """The legacy tables that exist in this network namespace (``/proc/net/ip_tables_names``;
    absent: the ip_tables module is not loaded, so there are none). Read instead of running
    ``iptables-legacy-save`` where that is enough, because that command creates the legacy
    tables (and loads the module) as a side effect."""
    try:
        return set(path.read_text().split())
    except OSError:
        return set()


#: the agent's chains, as (table, chain, parent): what the init steps remove
AGENT_CHAINS: tuple[tuple[str, str, str], ...] = (
    ("filter", CHAIN, PARENT),
    ("nat", NAT_CHAIN, NAT_PARENT),
)


def remove_agent_chains(backend: Backend, timeout: float = 10.0) -> list[str]:
    """:func:`remove_stale_chain` for every chain of :data:`AGENT_CHAINS`; what was removed,
    each prefixed with ``-t <table>`` for the nat table.

    Raises:
        BackendError: as :func:`remove_stale_chain`.
    """
    removed = []
    for table, chain, parent in AGENT_CHAINS:
        for rule in remove_stale_chain(backend, timeout, chain=chain, parent=parent, table=table):
            removed.append(rule if table == "filter" else f"-t {table} {rule}")
    return removed


def remove_stale_chain(
    backend: Backend,
    timeout: float = 10.0,
    *,
    chain: str = CHAIN,
    parent: str = PARENT,
    table: str = "filter",
) -> list[str]:
    """Remove the agent's jump ``parent -j chain`` and ``chain`` itself from ``table`` of
    ``backend`` (the one the agent does *not* use, or both at clean-state). Returns what
    was removed (``iptables -S`` form); [] when nothing was there or the binary is missing.

    Raises:
        BackendError: a delete failed for another reason than "not there".
    """
    exe = shutil.which(binary(backend))
    if exe is None or (backend == "legacy" and table not in _legacy_tables()):
        return []  # no such legacy table: nothing of ours there (and none is created)

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        cmd = [exe, "-w", str(max(1, int(timeout))), "-t", table, *args]
        try:
            return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise BackendError(f"{' '.join(cmd)}: {exc}") from exc

    removed = []
    if run("-S", chain).returncode != 0:
        return []
    while run("-D", parent, "-j", chain).returncode == 0:
        removed.append(f"-A {parent} -j {chain}")
    for step in (("-F", chain), ("-X", chain)):
        proc = run(*step)
        if proc.returncode != 0:
            raise BackendError(
                f"{binary(backend)} {' '.join(step)}: {proc.stderr.strip()}; remove the chain "
                "by hand or whatever still jumps to it"
            )
    removed.append(f"-N {chain}")
    return removed
