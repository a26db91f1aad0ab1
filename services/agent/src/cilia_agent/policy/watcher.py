"""The policy stream and readiness of policy computation.

:class:`PolicyStreams` follows ``PolicyService.WatchPolicies`` into the engine's repository
(a new stream resyncs it) and tells when policies are computable: both the identity and
the policy stream have delivered their listing (``PolicyEngine.ready``). An Add in policy
mode ``default`` waits for that up to ``--endpoint-policy-wait-timeout`` (upstream blocks
endpoint creation until its policy is computed).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterable
from typing import Protocol

from cilia.controlplane.v1 import controlplane_pb2 as cp
from cilia_agent.policy.engine import PolicyEngine

log = logging.getLogger(__name__)


class PolicyNotReady(Exception):
    """The identity/policy streams did not sync within ``--endpoint-policy-wait-timeout``."""


class PolicyGauge(Protocol):
    """``cilium_policy``: the number of policies loaded."""

    def set(self, value: float) -> None:
        """Set the gauge."""


class PolicyStreams:
    """Readiness and the policy stream of one :class:`PolicyEngine`.

    Args:
        engine: the engine (its repository is fed here, its identity cache elsewhere).
        gauge: ``cilium_policy``.
        wait_timeout: ``--endpoint-policy-wait-timeout`` (s).
        unenforceable: ``cilia_policy_unenforceable`` (policies stored fail closed), or
            None.

    Create it inside the running event loop.
    """

    def __init__(
        self,
        engine: PolicyEngine,
        gauge: PolicyGauge,
        wait_timeout: float,
        unenforceable: PolicyGauge | None = None,
    ) -> None:
        self.engine = engine
        self.gauge = gauge
        self.unenforceable = unenforceable
        self.wait_timeout = wait_timeout
        self._ready = asyncio.Event()

    @property
    def ready(self) -> bool:
        """True once the identity and policy streams have synced (policies computable)."""
        return self.engine.ready

    def changed(self) -> None:
        """Re-read readiness and the policy count (after any stream message)."""
        if self.engine.ready:
            self._ready.set()
        else:
            self._ready.clear()
        self.gauge.set(len(self.engine.repository))
        if self.unenforceable is not None:
            self.unenforceable.set(len(self.engine.repository.unenforced()))

    async def wait_ready(self) -> None:
        """Wait up to ``wait_timeout`` for :attr:`ready`.

        Raises:
            PolicyNotReady: the streams did not sync in time.
        """
        if self.engine.ready:
            return
        try:
            await asyncio.wait_for(self._ready.wait(), self.wait_timeout)
        except TimeoutError as exc:
            raise PolicyNotReady(
                "policy not computable yet: identities/policies from the operator have not "
                f"synced within {self.wait_timeout:g}s (--endpoint-policy-wait-timeout)"
            ) from exc

    def local_synced(self) -> None:
        """No operator: there are no policies and no remote identities; mark both synced."""
        self.engine.on_identities(cp.WatchIdentitiesResponse(synced=True))
        self.engine.on_policies(cp.WatchPoliciesResponse(synced=True))
        self.changed()

    async def consume_policies(self, stream: AsyncIterable[cp.WatchPoliciesResponse]) -> bool:
        """Follow one ``WatchPolicies`` stream (a new stream resyncs the repository)."""
        delivered = False
        async for response in stream:
            if not delivered:
                self.engine.repository.begin_resync()
                delivered = True
            try:
                result, recompiled = self.engine.on_policies(response)
                if result.updates or recompiled:
                    log.info(
                        "policies applied",
                        extra={
                            "revision": self.engine.repository.revision,
                            "policies": len(self.engine.repository),
                            "recompiled_endpoints": sorted(recompiled),
                        },
                    )
            finally:
                self.changed()
        return delivered
