"""Changes to live endpoints: new pod labels (relabel) and a new router IP (move_gateway)."""

from __future__ import annotations

import asyncio
import ipaddress
import logging

from cilia_agent.endpoint.table import EndpointTable

log = logging.getLogger(__name__)


class EndpointUpdates(EndpointTable):
    """Relabel and gateway moves of endpoints that exist."""

    async def move_gateway(
        self, old: ipaddress.IPv4Address, new: ipaddress.IPv4Address, *, wait: float = 10.0
    ) -> bool:
        """The node's router IP moves from ``old`` to ``new``: once the Adds in flight (which
        may have read the old gateway) are done — at most ``wait`` seconds — every pod's
        default route is repointed and the old address removed
        (``LinuxDatapath.move_router_ip``). Chained endpoints (another plugin's routes)
        are left alone. Returns False, keeping ``old``, when a pod could not be repointed.

        Raises:
            DatapathError: the host device cannot be changed.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait
        while self.adds_in_flight and loop.time() < deadline:
            await asyncio.sleep(0.05)
        pods = [(r.netns, r.ifname) for r in self._endpoints.values() if not r.chained]
        problems = await self._run(self.datapath.move_router_ip, old, new, pods)
        if problems:
            log.warning("router IP not moved yet", extra={"problems": problems[:10]})
            return False
        log.info("router IP moved", extra={"old_router_ip": str(old), "router_ip": str(new)})
        return True

    async def relabel(self, namespace: str, name: str, labels: dict[str, str]) -> list[int]:
        """Pod ``namespace/name`` has new labels (Kubernetes mode: Pod or Namespace labels
        edited): each of its endpoints gets them, its identity and policy re-computed
        (:meth:`EndpointHooks.relabel`) and its state file rewritten. Returns the ids of
        the endpoints relabelled.

        Raises:
            StateError: a state file could not be written.
            Exception: from the hooks (identity allocation, policy maps); the endpoint
                keeps its previous labels then.
        """
        done: list[int] = []
        for key, rec in list(self._endpoints.items()):
            if rec.pod_namespace != namespace or rec.pod_name != name or rec.labels == labels:
                continue
            async with self._lock(key):
                current = self._endpoints.get(key)
                if current is None or current.labels == labels:
                    continue
                updated = current.model_copy(update={"labels": dict(labels)})
                if self.hooks is not None and current.identity:
                    identity = await self.hooks.relabel(updated)
                    updated = updated.model_copy(update={"identity": identity})
                await self._write(updated)
                self._endpoints[key] = updated
                done.append(updated.id)
        return done
