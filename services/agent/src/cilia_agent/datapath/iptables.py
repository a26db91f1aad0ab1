"""The agent's own iptables chain, managed through the ``iptables`` binary.

Once Docker runs, the FORWARD policy is DROP (environment-notes.md), so routed
pod traffic needs explicit admission. The agent owns one chain,
``CILIA_FORWARD``, holding ``-i lxc+ -j ACCEPT`` and ``-o lxc+ -j ACCEPT``, and
one jump ``FORWARD -j CILIA_FORWARD`` inserted at position 1 when absent. No
other rule is touched.
"""

from __future__ import annotations

import logging
import subprocess

from cilia_agent.datapath.errors import IptablesError

log = logging.getLogger(__name__)

CHAIN = "CILIA_FORWARD"
RULES: tuple[tuple[str, ...], ...] = (
    ("-i", "lxc+", "-j", "ACCEPT"),
    ("-o", "lxc+", "-j", "ACCEPT"),
)
JUMP: tuple[str, ...] = ("-j", CHAIN)


class Iptables:
    """Runs ``iptables -w`` (waits for the xtables lock).

    Args:
        binary: the iptables executable.
        timeout: seconds one command may take (``--iptables-timeout``).
    """

    def __init__(self, binary: str = "iptables", timeout: float = 10.0) -> None:
        self.binary = binary
        self.timeout = timeout

    def _run(self, *args: str, check: bool = True) -> bool:
        cmd = [self.binary, "-w", str(max(1, int(self.timeout))), *args]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=self.timeout)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise IptablesError(f"{' '.join(cmd)}: {exc}") from exc
        if proc.returncode != 0 and check:
            raise IptablesError(f"{' '.join(cmd)}: exit {proc.returncode}: {proc.stderr.strip()}")
        return proc.returncode == 0

    def ensure_forward_rules(self) -> None:
        """Create ``CILIA_FORWARD`` with its two rules and the FORWARD jump, idempotently.

        Raises:
            IptablesError: a command failed.
        """
        if not self._run("-t", "filter", "-S", CHAIN, check=False):
            self._run("-t", "filter", "-N", CHAIN)
            log.info("created iptables chain", extra={"chain": CHAIN})
        for rule in RULES:
            if not self._run("-t", "filter", "-C", CHAIN, *rule, check=False):
                self._run("-t", "filter", "-A", CHAIN, *rule)
        if not self._run("-t", "filter", "-C", "FORWARD", *JUMP, check=False):
            self._run("-t", "filter", "-I", "FORWARD", "1", *JUMP)
            log.info("inserted FORWARD jump", extra={"chain": CHAIN})
