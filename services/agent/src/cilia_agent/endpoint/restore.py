"""Reconciling the endpoints with the node: restore from state files at start, CNI GC.

Restore (before serving) re-occupies the addresses of ready endpoints whose netns and veth
still exist and cleans up the rest (a missed DEL, a crash mid-Add or mid-Del). GC (CNI 1.1)
releases every attachment the runtime no longer lists, and addresses IPAM holds for no
endpoint (a leak).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from cilia_agent.datapath import DatapathError
from cilia_agent.endpoint.delete import EndpointDeletes
from cilia_agent.endpoint.params import Key, Keys, owner_of, parse_owner
from cilia_agent.endpoint.state import EndpointRecord
from cilia_agent.ipam import AddressInUse

log = logging.getLogger(__name__)


@dataclass
class RestoreReport:
    """What :meth:`EndpointManager.restore` did, by attachment ``container_id/ifname``."""

    restored: list[str] = field(default_factory=list)
    removed_stale: list[str] = field(default_factory=list)
    rolled_back: list[str] = field(default_factory=list)
    invalid_files: list[str] = field(default_factory=list)
    cleaned: list[EndpointRecord] = field(default_factory=list)
    """Records of every endpoint removed or rolled back (their operator records and
    identities are released by the enforcement layer)."""


class EndpointRestore(EndpointDeletes):
    """Restore at start and CNI GC."""

    # --- GC ------------------------------------------------------------------------
    async def gc(self, valid: set[Key]) -> Keys:
        """Release every attachment not in ``valid`` (CNI 1.1 GC); returns those released.

        Each released endpoint goes through the same path as Del (enforcement hooks:
        programs, BPF entries, identity reference, operator record; host veth; address;
        state file). Attachments whose Add or Del is in progress, and endpoints still
        ``creating``, are kept. Addresses IPAM holds for an attachment key that has no
        endpoint and no Add in progress (a leak) are released too. A failure on one
        attachment is logged and the others are still processed.
        """
        released: Keys = []
        for rec in list(self._endpoints.values()):
            key = rec.key
            if key in valid or key in self._adding or self._busy(key):
                continue
            if await self._delete_if(key, rec.id):
                released.append(key)
        for address, holder in self.ipam.allocated().items():
            parsed = parse_owner(holder)
            if parsed is None:
                continue
            key = parsed
            if key in valid or key in self._endpoints or key in self._adding or self._busy(key):
                continue
            if self.ipam.allocated().get(address) == holder:
                self.ipam.release(address)
                self.metrics.ipam_events.labels(action="release", family="ipv4").inc()
                log.warning("gc: released an address without endpoint", extra={"owner": holder})
                if key not in released:
                    released.append(key)
        if released:
            log.info(
                "gc: attachments released", extra={"released": [owner_of(*k) for k in released]}
            )
        return released

    # --- restore -------------------------------------------------------------------
    def restore(self) -> RestoreReport:
        """Restore endpoints from state files; run before serving (blocking).

        - ``ready`` endpoints whose netns and host veth still exist re-occupy
          their IPs (chained endpoints hold no IP of ours);
        - endpoints whose netns or host veth is gone (a missed DEL) are cleaned up;
        - ``creating`` endpoints (crash mid-Add) are rolled back;
        - ``disconnecting`` endpoints (crash mid-Del) are finished;
        - unreadable files are renamed to ``*.invalid`` and reported.
        """
        report = RestoreReport()
        records, bad = self.store.load_endpoints()
        for path in bad:
            path.rename(path.with_suffix(".invalid"))
            report.invalid_files.append(str(path))
        for rec in records:
            name = owner_of(*rec.key)
            extra = {"container_id": rec.container_id, "ifname": rec.ifname, "netns": rec.netns}
            if rec.state != "ready":
                self._cleanup_restored(rec)
                report.rolled_back.append(name)
                report.cleaned.append(rec)
                log.info(f"restore: finished interrupted {rec.state} endpoint", extra=extra)
                continue
            if not self.datapath.netns_exists(rec.netns) or not self.datapath.link_exists(
                rec.host_ifname
            ):
                self._cleanup_restored(rec)
                report.removed_stale.append(name)
                report.cleaned.append(rec)
                log.info("restore: netns or host veth gone, endpoint removed", extra=extra)
                continue
            if not rec.chained:
                try:
                    self.ipam.occupy(rec.ipv4, name, rec.pool)
                except AddressInUse as exc:
                    log.error(
                        "restore: address claimed twice, endpoint removed",
                        extra={**extra, "reason": str(exc)},
                    )
                    self._cleanup_restored(rec)
                    report.removed_stale.append(name)
                    report.cleaned.append(rec)
                    continue
            self._endpoints[rec.key] = rec
            self._next_id = max(self._next_id, rec.id + 1)
            report.restored.append(name)
            log.info(
                "restore: endpoint restored",
                extra={**extra, "endpoint_id": rec.id, "ipv4": rec.ipv4},
            )
        self._update_gauges()
        return report

    def _cleanup_restored(self, rec: EndpointRecord) -> None:
        if not rec.chained:
            try:
                self.datapath.unplumb(rec.host_ifname)
            except DatapathError as exc:
                log.error(
                    "restore: cannot delete veth",
                    extra={"container_id": rec.container_id, "reason": str(exc)},
                )
        self.store.remove_endpoint(*rec.key)
