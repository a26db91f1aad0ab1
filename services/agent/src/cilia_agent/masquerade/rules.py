"""The masquerade chain ``CILIA_POST_nat`` in the nat table: what it holds, and the runner
that reads, rebuilds and removes it.

Layout (upstream names its chain ``CILIUM_POST_nat`` and jumps to it from nat
``POSTROUTING``; Cilia's chains are ``CILIA_``-named, as ``CILIA_FORWARD``)::

    -A POSTROUTING -j CILIA_POST_nat                       (inserted at position 1)
    -A CILIA_POST_nat -d <excluded CIDR> -m comment --comment "cilia: no masquerade" -j RETURN
        ... one per excluded CIDR (collapsed, sorted)
    -A CILIA_POST_nat -s <pod CIDR> [-o <device>] -m comment --comment "cilia: masquerade" \\
        -j MASQUERADE --random-fully
        ... one per (masqueraded pod CIDR of this node, egress device)

``MASQUERADE`` takes the address of the outgoing device (the node's address there) and,
with ``--random-fully`` (as upstream), a fully random source port from the kernel's NAT
range; the kernel's conntrack keeps the translation and undoes it for replies, and expires
it (``nf_conntrack_tcp_timeout_*``, ``nf_conntrack_udp_timeout``). When every port towards
one destination address:port is taken the kernel drops the new connection's first packet
(counted in ``conntrack -S`` as ``insert_failed``/``drop``); there is no per-flow report
from the agent in this mode.

The chain is written in one ``iptables-restore --noflush`` transaction (declaring the chain
empties it and the rules are added in the same commit), so a rebuild never leaves a moment
with half the exclusions; the jump is checked with ``-S POSTROUTING`` and inserted when
missing. Nothing else in the nat table is touched.
"""

from __future__ import annotations

import ipaddress
import shlex
import subprocess
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from cilia_agent.datapath.errors import IptablesError
from cilia_agent.datapath.iptables import NAT_CHAIN, NAT_PARENT

COMMENT_EXCLUDE = "cilia: no masquerade"
COMMENT_MASQUERADE = "cilia: masquerade"


@dataclass(frozen=True)
class Plan:
    """What the chain must say.

    Attributes:
        sources: this node's pod CIDRs whose traffic is masqueraded (``a.b.c.d/n``).
        exclusions: destination CIDRs never masqueraded (collapsed and sorted by
            :func:`make_plan`).
        devices: egress devices (``-o``; a trailing ``+`` is iptables' prefix match);
            empty = every device.
    """

    sources: tuple[str, ...]
    exclusions: tuple[str, ...]
    devices: tuple[str, ...]


def _collapse(cidrs: Iterable[str]) -> tuple[str, ...]:
    nets = []
    for cidr in cidrs:
        try:
            nets.append(ipaddress.IPv4Network(cidr, strict=False))
        except ValueError:
            continue  # IPv6 or malformed: the IPv4 chain has nothing to say about it
    return tuple(str(n) for n in sorted(ipaddress.collapse_addresses(nets)))


def make_plan(sources: Iterable[str], exclusions: Iterable[str], devices: Sequence[str]) -> Plan:
    """A :class:`Plan` with every list normalised: sources and exclusions collapsed
    (``ipaddress.collapse_addresses``) and sorted, IPv6 and malformed CIDRs left out,
    devices deduplicated in order."""
    return Plan(_collapse(sources), _collapse(exclusions), tuple(dict.fromkeys(devices)))


def chain_rules(plan: Plan) -> list[list[str]]:
    """The chain's rules in ``iptables -S`` form, without the leading ``-A CHAIN``
    (the form :meth:`NatChain.read` returns, so the two compare as lists)."""
    rules = [
        ["-d", cidr, "-m", "comment", "--comment", COMMENT_EXCLUDE, "-j", "RETURN"]
        for cidr in plan.exclusions
    ]
    outs: list[list[str]] = [["-o", dev] for dev in plan.devices] or [[]]
    masq = ["-m", "comment", "--comment", COMMENT_MASQUERADE, "-j", "MASQUERADE", "--random-fully"]
    rules += [["-s", src, *out, *masq] for src in plan.sources for out in outs]
    return rules


def _restore_token(token: str) -> str:
    # iptables-restore splits on blanks and understands double quotes only (no shell
    # quoting); the rules are the agent's own, so a token never holds a double quote
    if '"' in token:
        raise ValueError(f"iptables-restore token with a double quote: {token!r}")
    return f'"{token}"' if not token or any(c.isspace() for c in token) else token


def restore_input(chain: str, rules: Sequence[Sequence[str]]) -> str:
    """``iptables-restore --noflush`` input that empties ``chain`` (creating it when
    missing) and fills it with ``rules``, in one commit of the nat table.

    Raises:
        ValueError: a token holds a double quote (iptables-restore cannot quote it).
    """
    lines = ["*nat", f":{chain} - [0:0]"]
    lines += [" ".join(_restore_token(t) for t in ["-A", chain, *rule]) for rule in rules]
    lines.append("COMMIT")
    return "\n".join(lines) + "\n"


class NatChain:
    """Reads, writes and removes the masquerade chain with ``iptables``/``iptables-restore``.

    Args:
        binary: the iptables executable (``iptables-nft`` or ``iptables-legacy``); the
            restore command is ``<binary>-restore`` (plain ``iptables`` → ``iptables-restore``).
        timeout: seconds one command may take (``--iptables-timeout``; also the xtables
            lock wait).
        chain: the agent's nat chain (``CILIA_POST_nat``; tests may use their own).
        parent: the chain holding the jump (``POSTROUTING``).
        prefix: argv run before each command (e.g. ``("ip", "netns", "exec", NAME)`` to
            manage another network namespace's chain; empty: this process's namespace).
    """

    def __init__(
        self,
        binary: str = "iptables",
        timeout: float = 10.0,
        *,
        chain: str = NAT_CHAIN,
        parent: str = NAT_PARENT,
        prefix: Sequence[str] = (),
    ) -> None:
        self.prefix = list(prefix)
        self.binary = binary
        self.timeout = timeout
        self.chain = chain
        self.parent = parent
        self._lock = threading.Lock()

    def _cmd(self, argv: list[str], stdin: str | None = None) -> subprocess.CompletedProcess[str]:
        argv = [*self.prefix, *argv]
        try:
            return subprocess.run(
                argv, input=stdin, capture_output=True, text=True, timeout=self.timeout
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise IptablesError(f"{' '.join(argv)}: {exc}") from exc

    def _iptables(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        argv = [self.binary, "-w", str(max(1, int(self.timeout))), "-t", "nat", *args]
        proc = self._cmd(argv)
        if check and proc.returncode != 0:
            raise IptablesError(f"{' '.join(argv)}: exit {proc.returncode}: {proc.stderr.strip()}")
        return proc

    def _read(self, chain: str) -> list[list[str]] | None:
        proc = self._iptables("-S", chain, check=False)
        if proc.returncode != 0:
            return None
        out = []
        for line in proc.stdout.splitlines():
            tokens = shlex.split(line)
            if len(tokens) >= 2 and tokens[0] == "-A" and tokens[1] == chain:
                out.append(tokens[2:])
        return out

    def read(self) -> list[list[str]] | None:
        """The chain's rules (``-S`` form without ``-A CHAIN``); None when it does not exist."""
        return self._read(self.chain)

    def has_jump(self) -> bool:
        """True when the parent chain jumps to the chain."""
        return ["-j", self.chain] in (self._read(self.parent) or [])

    def ensure(self, rules: Sequence[Sequence[str]]) -> list[str]:
        """Make the chain hold exactly ``rules`` and the parent jump to it.

        Reads first: nothing is written when both are in place. Returns what was done
        (``"chain rebuilt"``, ``"jump inserted"``), empty when nothing.

        Raises:
            IptablesError: a command failed (the nat table is as the failed commit left it:
                iptables-restore commits all or nothing).
        """
        with self._lock:
            done = []
            wanted = [list(r) for r in rules]
            if self.read() != wanted:
                restore = self.binary + "-restore"
                argv = [restore, "-w", str(max(1, int(self.timeout))), "--noflush"]
                proc = self._cmd(argv, restore_input(self.chain, wanted))
                if proc.returncode != 0:
                    raise IptablesError(
                        f"{' '.join(argv)}: exit {proc.returncode}: {proc.stderr.strip()}"
                    )
                done.append("chain rebuilt")
            if not self.has_jump():
                self._iptables("-I", self.parent, "1", "-j", self.chain)
                done.append("jump inserted")
            return done

    def remove(self) -> list[str]:
        """Delete every ``parent -j chain`` jump, then the chain. Returns what was removed
        (``iptables -S`` form); [] when the chain does not exist.

        Raises:
            IptablesError: flushing or deleting the chain failed.
        """
        with self._lock:
            if self.read() is None:
                return []
            removed = []
            while self._iptables("-D", self.parent, "-j", self.chain, check=False).returncode == 0:
                removed.append(f"-t nat -A {self.parent} -j {self.chain}")
            self._iptables("-F", self.chain)
            self._iptables("-X", self.chain)
            removed.append(f"-t nat -N {self.chain}")
            return removed
