"""Deleting an endpoint (CNI DEL): enforcement undone, host veth, address, state file.

Del runs the enforcement hooks' delete first, then removes the host veth (not for a chained
endpoint: the veth and address are the other plugin's), releases the address when IPAM holds
it for this attachment, and removes the state file. The record is kept ``disconnecting`` until
everything is done, so a retried Del (or a restore after a crash) can finish.
"""

from __future__ import annotations

import logging

from cilia_agent.datapath import host_ifname
from cilia_agent.endpoint.errors import InvalidRequest
from cilia_agent.endpoint.params import owner_of, validate_ifname
from cilia_agent.endpoint.state import EndpointRecord
from cilia_agent.endpoint.table import EndpointTable

log = logging.getLogger(__name__)


class EndpointDeletes(EndpointTable):
    """Del, and the delete-under-lock that Add (an abandoned Add) and GC reuse."""

    async def delete(
        self, container_id: str, ifname: str, netns: str = "", *, not_after_ms: int = 0
    ) -> bool:
        """Delete the endpoint of ``(container_id, ifname)``; True if one existed.

        Everything is looked up by the attachment key: the endpoint record, its state
        file, its host veth and the address (released only when IPAM holds it for this
        key), so a DEL of an old sandbox never touches a newer sandbox of the same pod.
        Succeeds when there is nothing to delete and when ``netns`` is empty or gone
        (the host side and the IP are cleaned up anyway). A leftover host veth of an
        unknown key is removed too. A chained endpoint is detached and forgotten; the
        other plugin's veth and address stay.

        Args:
            not_after_ms: when > 0 (a replayed DEL queued at this Unix ms time), an
                endpoint created after it is a newer attachment and is kept.

        Raises:
            InvalidRequest: ``container_id`` or ``ifname`` is empty/invalid.
            DatapathError, StateError: cleanup failed (the record is kept, so a
                retried Del can finish).
        """
        if not container_id:
            raise InvalidRequest("container_id", "must not be empty")
        validate_ifname(ifname)
        key = (container_id, ifname)
        extra = {"container_id": container_id, "ifname": ifname, "netns": netns}
        async with self._lock(key):
            rec = self._endpoints.get(key)
            if rec is not None and not_after_ms and rec.created_at_ms > not_after_ms:
                log.info(
                    "del: endpoint is newer than the queued DEL, kept",
                    extra={**extra, "endpoint_id": rec.id},
                )
                return False
            if rec is None:
                leftover = await self._run(self.datapath.unplumb, host_ifname(*key))
                log.info(
                    "del: no such endpoint",
                    extra={**extra, "removed_leftover_veth": leftover},
                )
                self._forget_lock(key)
                if self.ipam.forget_pending(owner_of(*key)):  # a DEL after a failed ADD
                    self._on_change()
                return False
            await self._delete_locked(key, rec, extra)
        self._forget_lock(key)
        self.ipam.forget_pending(owner_of(*key))
        self._on_change()
        return True

    async def _delete_if(self, key: tuple[str, str], endpoint_id: int) -> bool:
        """Delete the endpoint of ``key`` only if it is still endpoint ``endpoint_id``."""
        extra = {"container_id": key[0], "ifname": key[1]}
        try:
            async with self._lock(key):
                rec = self._endpoints.get(key)
                if rec is None or rec.id != endpoint_id or rec.state == "creating":
                    return False
                await self._delete_locked(key, rec, extra)
        except Exception as exc:
            log.error("cannot delete endpoint", extra={**extra, "reason": str(exc)})
            return False
        self._forget_lock(key)
        self._on_change()
        return True

    async def _delete_locked(
        self, key: tuple[str, str], rec: EndpointRecord, extra: dict[str, str]
    ) -> None:
        rec = rec.model_copy(update={"state": "disconnecting"})
        self._endpoints[key] = rec
        await self._write(rec)
        if self.hooks is not None:
            await self.hooks.delete(rec, veth_deleted_next=not rec.chained)
        if not rec.chained:
            await self._run(self.datapath.unplumb, rec.host_ifname)
        self._release_ip(rec)
        await self._remove(*key)
        del self._endpoints[key]
        self._update_gauges()
        log.info(
            "endpoint deleted",
            extra={**extra, "endpoint_id": rec.id, "ipv4": rec.ipv4, "chained": rec.chained},
        )
