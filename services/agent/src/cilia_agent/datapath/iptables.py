"""The agent's own iptables chain, managed through the ``iptables`` binary.

Once Docker runs, the FORWARD policy is DROP (environment-notes.md), so routed
pod traffic needs explicit admission. The agent owns one chain,
``CILIA_FORWARD``, holding ``-i lxc+ -j ACCEPT`` and ``-o lxc+ -j ACCEPT``, and
one jump ``FORWARD -j CILIA_FORWARD`` inserted at position 1 when absent (or
moved there when found after a DROP/REJECT rule). Rules in ``CILIA_FORWARD`` other
than its two are deleted; no other rule is touched.

dockerd restarts, firewall reloads (``iptables -F FORWARD``, firewalld, ufw) and
people remove the jump or flush the chain; every routed pod packet is then dropped.
:class:`IptablesReconciler` re-checks every ``--iptables-reconcile-interval`` seconds
and repairs what is missing (upstream Cilium re-installs its rules from a
controller, ``pkg/datapath/iptables``).
"""

from __future__ import annotations

import asyncio
import logging
import shlex
import subprocess
import threading
from collections.abc import Callable
from concurrent.futures import Executor

from prometheus_client import CollectorRegistry, Counter

from cilia_agent.datapath.errors import IptablesError

log = logging.getLogger(__name__)

CHAIN = "CILIA_FORWARD"
PARENT = "FORWARD"
RULES: tuple[tuple[str, ...], ...] = (
    ("-i", "lxc+", "-j", "ACCEPT"),
    ("-o", "lxc+", "-j", "ACCEPT"),
)
JUMP: tuple[str, ...] = ("-j", CHAIN)
# the masquerade chain of the nat table and the chain jumping to it (masquerade/rules.py;
# upstream CILIUM_POST_nat); named here so init clean-state removes it too
NAT_CHAIN = "CILIA_POST_nat"
NAT_PARENT = "POSTROUTING"
TERMINAL = ("DROP", "REJECT")

# repair kinds (the ``repair`` label of the repairs counter)
REPAIR_CHAIN = "chain_created"
REPAIR_RULE = "rule_added"
REPAIR_EXTRA = "rule_removed"
REPAIR_JUMP = "jump_inserted"
REPAIR_JUMP_MOVED = "jump_moved"
REPAIRS = (REPAIR_CHAIN, REPAIR_RULE, REPAIR_EXTRA, REPAIR_JUMP, REPAIR_JUMP_MOVED)


def _target(tokens: list[str]) -> str | None:
    for i, tok in enumerate(tokens[:-1]):
        if tok in ("-j", "--jump"):
            return tokens[i + 1]
    return None


class Iptables:
    """Runs ``iptables -w`` (waits for the xtables lock).

    Args:
        binary: the iptables executable.
        timeout: seconds one command may take (``--iptables-timeout``).
        chain: name of the agent's chain (``CILIA_FORWARD``; tests use their own).
        parent: built-in or user chain holding the jump (``FORWARD``; tests use their own).
    """

    def __init__(
        self,
        binary: str = "iptables",
        timeout: float = 10.0,
        *,
        chain: str = CHAIN,
        parent: str = PARENT,
    ) -> None:
        self.binary = binary
        self.timeout = timeout
        self.chain = chain
        self.parent = parent
        # ensure_forward_rules (start, new allocation) and the reconcile timer run on
        # different worker threads; one at a time, so neither inserts a second jump.
        self._lock = threading.Lock()

    def _cmd(self, *args: str) -> subprocess.CompletedProcess[str]:
        cmd = [self.binary, "-w", str(max(1, int(self.timeout))), *args]
        try:
            return subprocess.run(cmd, capture_output=True, text=True, timeout=self.timeout)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise IptablesError(f"{' '.join(cmd)}: {exc}") from exc

    def _run(self, *args: str, check: bool = True) -> bool:
        proc = self._cmd(*args)
        if proc.returncode != 0 and check:
            cmd = " ".join(str(a) for a in proc.args)
            raise IptablesError(f"{cmd}: exit {proc.returncode}: {proc.stderr.strip()}")
        return proc.returncode == 0

    def _rules(self, chain: str) -> list[list[str]] | None:
        """``iptables -S chain`` as token lists without ``-A chain``; None: no such chain."""
        proc = self._cmd("-t", "filter", "-S", chain)
        if proc.returncode != 0:
            return None
        out = []
        for line in proc.stdout.splitlines():
            tokens = shlex.split(line)
            if len(tokens) >= 2 and tokens[0] == "-A" and tokens[1] == chain:
                out.append(tokens[2:])
        return out

    def ensure_forward_rules(self) -> None:
        """Create ``CILIA_FORWARD`` with its two rules and the FORWARD jump, idempotently
        (the same checks and repairs as :meth:`reconcile`, logged at info).

        Raises:
            IptablesError: a command failed.
        """
        for repair, detail in self.reconcile():
            log.info("iptables repaired", extra={"repair": repair, "detail": detail})

    def reconcile(self) -> list[tuple[str, str]]:
        """Make the chain hold exactly its two rules and put the jump before any DROP/REJECT.

        Checks ``iptables -S`` of the chain and of the parent: a missing chain is created,
        a missing rule appended, any other rule in the chain deleted; a missing jump is
        inserted at position 1, a jump placed after a rule whose target is DROP or REJECT
        is deleted and inserted at position 1 (rules of other tools above ours, such as
        dockerd's ``DOCKER-USER``, are fine as long as they do not drop). Nothing is run
        when everything is in place (two ``-S`` reads only).

        Returns:
            ``[(repair, detail), ...]``, empty when nothing was missing; ``repair`` is one
            of :data:`REPAIRS`, ``detail`` the rule in ``iptables -S`` form.

        Raises:
            IptablesError: a command failed (the repairs before it stay done).
        """
        with self._lock:
            return self._reconcile()

    def _reconcile(self) -> list[tuple[str, str]]:
        repairs: list[tuple[str, str]] = []
        chain, parent = self.chain, self.parent
        have = self._rules(chain)
        if have is None:
            self._run("-t", "filter", "-N", chain)
            repairs.append((REPAIR_CHAIN, f"-N {chain}"))
            have = []
        wanted = [list(rule) for rule in RULES]
        seen: list[list[str]] = []
        for rule in have:
            if rule in wanted and rule not in seen:
                seen.append(rule)
                continue
            self._run("-t", "filter", "-D", chain, *rule)
            repairs.append((REPAIR_EXTRA, shlex.join(["-A", chain, *rule])))
        for rule in wanted:
            if rule not in seen:
                self._run("-t", "filter", "-A", chain, *rule)
                repairs.append((REPAIR_RULE, shlex.join(["-A", chain, *rule])))
        jump = ["-j", chain]
        detail = shlex.join(["-A", parent, *jump])
        rules = self._rules(parent)
        if rules is None:
            raise IptablesError(f"{self.binary} -S {parent}: no such chain")
        ours = rules.index(jump) if jump in rules else None
        first_drop = next(
            (i for i, rule in enumerate(rules) if _target(rule) in TERMINAL), len(rules)
        )
        if ours is None:
            self._run("-t", "filter", "-I", parent, "1", *jump)
            repairs.append((REPAIR_JUMP, detail))
        elif ours > first_drop:
            # deletes the first jump, the misplaced one; traffic it should admit is
            # already dropped, so the moment between -D and -I loses nothing more
            self._run("-t", "filter", "-D", parent, *jump)
            self._run("-t", "filter", "-I", parent, "1", *jump)
            repairs.append(
                (REPAIR_JUMP_MOVED, f"{detail} (was after {shlex.join(rules[first_drop])})")
            )
        return repairs


class IptablesReconciler:
    """Repairs the agent's iptables rules every ``interval`` seconds (a timer task).

    Each tick runs :meth:`Iptables.reconcile` in ``executor`` (never on the event loop),
    counts each repair in ``cilia_iptables_reconcile_repairs_total{repair}`` (no upstream
    twin; upstream lists none for this) and logs it at info. A tick with nothing to repair
    logs nothing. When something is repaired on consecutive ticks (another tool keeps
    removing it), the 1st, 2nd, 4th, 8th, ... repair in a row is logged with the streak
    length, so two tools fighting over a rule never flood the log; a clean tick ends the
    streak. Failed ticks (``IptablesError``) log a warning under the same rule.

    Args:
        iptables: the runner (its chain names and timeout).
        interval: seconds between ticks (``--iptables-reconcile-interval``); 0 disables:
            :meth:`run` returns at once.
        executor: worker threads for the iptables commands.
        registry: Prometheus registry the counter is registered in.
    """

    def __init__(
        self,
        iptables: Iptables,
        interval: float,
        executor: Executor | None,
        registry: CollectorRegistry,
    ) -> None:
        self.iptables = iptables
        self.interval = interval
        self.executor = executor
        self.repairs = Counter(
            "cilia_iptables_reconcile_repairs",
            "iptables rules of the agent found missing or misplaced and repaired, by repair",
            ["repair"],
            registry=registry,
        )
        self.streak = 0
        self.failures = 0
        self.ticks = 0
        self.on_tick: Callable[[], None] | None = None  # tests: called after each tick

    async def tick(self) -> list[tuple[str, str]]:
        """One check-and-repair; returns the repairs (errors are logged, give ``[]``)."""
        loop = asyncio.get_running_loop()
        try:
            repairs = await loop.run_in_executor(self.executor, self.iptables.reconcile)
        except IptablesError as exc:
            self.failures += 1
            if self.failures & (self.failures - 1) == 0:
                log.warning(
                    "iptables reconcile failed",
                    extra={"reason": str(exc), "failures_in_a_row": self.failures},
                )
            return []
        self.failures = 0
        self.ticks += 1
        if not repairs:
            self.streak = 0
            return repairs
        self.streak += 1
        for repair, _ in repairs:
            self.repairs.labels(repair=repair).inc()
        if self.streak & (self.streak - 1) == 0:
            log.info(
                "iptables rules repaired",
                extra={
                    "repairs": [f"{repair}: {detail}" for repair, detail in repairs],
                    "ticks_in_a_row": self.streak,
                },
            )
        return repairs

    async def run(self) -> None:
        """Tick every ``interval`` seconds until cancelled; returns at once when 0."""
        if self.interval <= 0:
            return
        while True:
            await asyncio.sleep(self.interval)
            await self.tick()
            if self.on_tick is not None:
                self.on_tick()
