"""The load-balancer map writer: Services in, ``cilium_lb4_*`` entries out.

:class:`LBMaps` opens the maps pinned under ``--bpf-pin-dir`` (created by the socket-LB
programs' loading, ``socklb``). :class:`ServiceMapWriter` keeps them equal to the
Services it is given, one frontend (VIP, port, protocol) at a time:

1. each backend (address, port, protocol) gets a ``backend_id`` (u32, from 1, shared by
   every frontend that uses it, as upstream) and its entry in ``cilium_lb4_backends_v3``
   with state active — or terminating when no frontend has it active;
2. each frontend gets a ``rev_nat_index`` (u16, from 1) and its ``cilium_lb4_reverse_nat``
   entry;
3. the active backends go into slots 1..n of the frontend (written before the master entry
   when there are more, so the programs never pick an empty slot), then the master entry
   (slot 0: count n, flags, ClientIP affinity timeout), then slots beyond n are deleted;
4. backends no frontend uses any more are deleted last (ids freed).

With ClientIP affinity, ``cilium_lb_affinity_match`` holds (backend_id, rev_nat_index) for
each active backend, so a remembered backend that left the Service is not used again.

Restart: :meth:`ServiceMapWriter.restore` reads the pinned maps back, so every frontend
keeps its rev-NAT index and every backend its id (the programs and established sockets
never see a change); a resync (:meth:`begin_resync` … :meth:`end_resync`, the operator's
listing) then deletes what no Service claims any more.

Not thread-safe: one caller (the Service watcher) at a time.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import pathlib
import socket
from dataclasses import dataclass, field
from typing import Any

from cilia.controlplane.v1 import controlplane_pb2 as cp
from cilia_agent.datapath.errors import DatapathError
from cilia_agent.datapath.layout import ip_from_map, ip_to_map, port_to_map
from cilia_agent.datapath.libbpf import LibbpfError, PinnedMap
from cilia_agent.loadbalancer.layout import (
    AFFINITY_MATCH_MAP,
    BACKENDS_MAP,
    BE_STATE_ACTIVE,
    BE_STATE_TERMINATING,
    LB_LOOKUP_SCOPE_EXT,
    REVNAT_MAP,
    SERVICES_MAP,
    SVC_FLAG_AFFINITY,
    SVC_FLAG_EXT_LOCAL_SCOPE,
    SVC_FLAG_INT_LOCAL_SCOPE,
    SVC_FLAG_NODEPORT,
    SVC_FLAG_ROUTABLE,
    AffinityMatch,
    Lb4Backend,
    Lb4Key,
    Lb4ReverseNat,
    Lb4Service,
)
from cilia_agent.loadbalancer.model import (
    Backend,
    Frontend,
    FrontendSpec,
    frontends,
    service_name,
)

log = logging.getLogger(__name__)

MAX_REV_NAT = 0xFFFF
MAX_BACKEND_ID = 0xFFFFFFFF


_U32 = ctypes.c_uint32
_U16 = ctypes.c_uint16
_U8 = ctypes.c_uint8


class LBMapFull(DatapathError):
    """A load-balancer map or id space is full (raise ``--bpf-lb-map-max``)."""


class LBMaps:
    """Handles on the pinned load-balancer maps under ``pin_dir``.

    Raises:
        LibbpfError: a map is not pinned there (the socket-LB programs were never loaded
            with this pin dir) or no permission.
    """

    def __init__(self, pin_dir: pathlib.Path) -> None:
        self.pin_dir = pin_dir
        self.services: PinnedMap[Lb4Key, Lb4Service] = PinnedMap(
            pin_dir / SERVICES_MAP, Lb4Key, Lb4Service
        )
        self.backends: PinnedMap[Any, Lb4Backend] = PinnedMap(
            pin_dir / BACKENDS_MAP, _U32, Lb4Backend
        )
        self.revnat: PinnedMap[Any, Lb4ReverseNat] = PinnedMap(
            pin_dir / REVNAT_MAP, _U16, Lb4ReverseNat
        )
        self.affinity_match: PinnedMap[AffinityMatch, Any] = PinnedMap(
            pin_dir / AFFINITY_MATCH_MAP, AffinityMatch, _U8
        )

    def close(self) -> None:
        """Close every map fd (idempotent)."""
        for m in (self.services, self.backends, self.revnat, self.affinity_match):
            m.close()


def frontend_key(frontend: Frontend, slot: int = 0) -> Lb4Key:
    """The ``lb4_key`` of ``frontend``'s ``slot`` (0 = master entry)."""
    return Lb4Key(
        address=ip_to_map(frontend.address),
        dport=port_to_map(frontend.port),
        backend_slot=slot,
        proto=frontend.proto,
        scope=LB_LOOKUP_SCOPE_EXT,
    )


def frontend_of(key: Lb4Key) -> Frontend:
    """Inverse of :func:`frontend_key` (the slot dropped)."""
    return Frontend(ip_from_map(key.address), socket.ntohs(key.dport), key.proto)


def backend_of(value: Lb4Backend) -> Backend:
    """The :class:`Backend` an ``lb4_backend`` value describes."""
    return Backend(ip_from_map(value.address), socket.ntohs(value.port), value.proto)


@dataclass
class Programmed:
    """What one frontend holds in the maps.

    Attributes:
        rev_nat: its rev-NAT index (also its ID in ``service list``).
        active: backend ids in slots 1..n, in slot order.
        terminating: backend ids kept for established connections only.
        affinity_timeout: seconds, 0 = no ClientIP affinity.
        service: ``namespace/name`` ("" when restored and not listed again yet).
        service_type: ``ClusterIP`` …
        slots_high: slots that may exist in the map (more than ``active`` after a failed
            write, so the next write deletes them).
        dirty: a write failed half-way: the next one rewrites every slot.
    """

    rev_nat: int
    active: list[int] = field(default_factory=list)
    terminating: set[int] = field(default_factory=set)
    affinity_timeout: int = 0
    service: str = ""
    service_type: str = "ClusterIP"
    slots_high: int = 0
    dirty: bool = False


class ServiceMapWriter:
    """Keeps the load-balancer maps equal to the Services given (see the module docstring).

    Args:
        maps: the pinned maps.
        capacity: ``--bpf-lb-map-max`` (entries per map), for the error message.
        node_name: this node (``--node-name``): which backends are node-local for the
            ``Local`` traffic policies.
    """

    def __init__(self, maps: LBMaps, capacity: int, node_name: str = "") -> None:
        self.maps = maps
        self.capacity = capacity
        self.node_name = node_name
        self.frontends: dict[Frontend, Programmed] = {}
        self.backends: dict[int, Backend] = {}
        self._backend_ids: dict[Backend, int] = {}
        self._backend_state: dict[int, int] = {}
        self._refs: dict[int, set[Frontend]] = {}
        self._by_service: dict[str, set[Frontend]] = {}
        self._matches: dict[int, set[int]] = {}  # rev_nat -> backend ids in the match map
        self._rev_nats: set[int] = set()
        self._next_backend = 1
        self._next_rev_nat = 1
        self._stale: set[Frontend] | None = None

    # --- restore ----------------------------------------------------------------------
    def restore(self) -> int:
        """Read the pinned maps back (after a restart); returns the frontends found.

        Slots beyond a frontend's count and rev-NAT entries no frontend uses (left by a
        crash mid-write) are deleted.
        """
        slots: dict[Frontend, dict[int, int]] = {}
        extra: list[Lb4Key] = []
        for key, value in self.maps.services.items():
            front = frontend_of(key)
            if key.backend_slot == 0:
                self.frontends[front] = Programmed(
                    rev_nat=value.rev_nat_index,
                    affinity_timeout=value.backend_id if value.flags & SVC_FLAG_AFFINITY else 0,
                )
            else:
                slots.setdefault(front, {})[key.backend_slot] = value.backend_id
        for bid, bval in self.maps.backends.items():
            self.backends[bid.value] = backend_of(bval)
            self._backend_ids[backend_of(bval)] = bid.value
            self._backend_state[bid.value] = bval.flags
            self._refs[bid.value] = set()
        for front, by_slot in slots.items():
            prog = self.frontends.get(front)
            master = self.maps.services.lookup(frontend_key(front))
            count = master.count if master is not None else 0
            for slot, bid in sorted(by_slot.items()):
                if prog is None or slot > count or bid not in self.backends:
                    extra.append(frontend_key(front, slot))
                    continue
                prog.active.append(bid)
                prog.slots_high = len(prog.active)
                self._refs[bid].add(front)
        for key in extra:
            self.maps.services.delete(key)
        for front, prog in self.frontends.items():
            master = self.maps.services.lookup(frontend_key(front))
            if master is not None and len(prog.active) != master.count:
                prog.dirty = True  # a slot is missing: rewrite them all at the next listing
        self._rev_nats = {p.rev_nat for p in self.frontends.values()}
        for index, _ in list(self.maps.revnat.items()):
            if index.value not in self._rev_nats:
                self.maps.revnat.delete(index)
        for match, _ in self.maps.affinity_match.items():
            self._matches.setdefault(match.rev_nat_id, set()).add(match.backend_id)
        self._next_backend = max(self.backends, default=0) + 1
        self._next_rev_nat = max(self._rev_nats, default=0) + 1
        return len(self.frontends)

    # --- the Service stream ------------------------------------------------------------
    def begin_resync(self) -> None:
        """A full listing starts: frontends not written again before :meth:`end_resync`
        are deleted then."""
        self._stale = set(self.frontends)

    def end_resync(self) -> int:
        """The listing ended: delete the frontends it did not claim and the backends no
        frontend uses; returns the frontends deleted."""
        stale, self._stale = self._stale or set(), None
        for front in stale:
            self._delete_frontend(front)
        for bid in [b for b, refs in self._refs.items() if not refs]:
            self._release_backend(bid)
        return len(stale)

    def upsert_service(self, svc: cp.Service) -> list[str]:
        """Program every frontend of ``svc`` and delete the ones it no longer has.

        Returns the problems found in ``svc`` (skipped frontends or backends).

        Raises:
            LBMapFull: a map or an id space is full.
            LibbpfError: another kernel error.
        """
        name = service_name(svc.namespace, svc.name)
        parsed = frontends(svc, self.node_name)
        wanted = {spec.frontend for spec in parsed.specs}
        try:
            for spec in parsed.specs:
                self._write(spec)
        except Exception:
            if self._stale is None:  # ids taken for backends that never made it into a slot
                for bid in [b for b, refs in self._refs.items() if not refs]:
                    self._release_backend(bid)
            raise
        for front in self._by_service.get(name, set()) - wanted:
            if self.frontends.get(front, Programmed(0)).service == name:
                self._delete_frontend(front)
        self._by_service[name] = wanted
        return parsed.problems

    def delete_service(self, namespace: str, name: str) -> int:
        """Delete every frontend of Service ``namespace/name``; returns how many."""
        key = service_name(namespace, name)
        mine = [
            f
            for f in self._by_service.pop(key, set())
            if self.frontends.get(f, Programmed(0)).service == key
        ]
        for front in mine:
            self._delete_frontend(front)
        return len(mine)

    # --- one frontend -----------------------------------------------------------------
    def _write(self, spec: FrontendSpec) -> None:
        front = spec.frontend
        if self._stale is not None:
            self._stale.discard(front)
        prog = self.frontends.get(front)
        if prog is None:
            prog = self.frontends[front] = Programmed(rev_nat=self._alloc_rev_nat())
            self._update(
                self.maps.revnat,
                _U16(prog.rev_nat),
                Lb4ReverseNat(address=ip_to_map(front.address), port=port_to_map(front.port)),
            )
        elif prog.service and prog.service != spec.service:
            log.warning(
                "frontend claimed by two Services; the later one wins",
                extra={"frontend": _text(front), "was": prog.service, "now": spec.service},
            )
            self._by_service.get(prog.service, set()).discard(front)
        prog.service, prog.service_type = spec.service, spec.service_type
        old_ids = set(prog.active) | prog.terminating
        active = [self._backend_id(b) for b in spec.active]
        terminating = {self._backend_id(b) for b in spec.terminating}
        for bid in set(active) | terminating:
            self._refs.setdefault(bid, set()).add(front)
        old_active = prog.active
        prog.active, prog.terminating = active, terminating
        high = max(len(old_active), prog.slots_high)
        try:
            self._write_slots(front, prog, old_active, spec)
        except Exception:
            # what the maps hold is unknown now: rewrite every slot next time, and keep the
            # backends this write was dropping referenced until then
            prog.dirty, prog.slots_high = True, max(high, len(active))
            prog.terminating |= old_ids - set(active)
            raise
        for slot in range(len(active) + 1, high + 1):
            self.maps.services.delete(frontend_key(front, slot))
        prog.slots_high, prog.dirty = len(active), False
        prog.affinity_timeout = spec.affinity_timeout
        self._sync_matches(prog)
        for bid in old_ids - set(active) - terminating:
            self._unref(bid, front)

    def _write_slots(
        self, front: Frontend, prog: Programmed, old_active: list[int], spec: FrontendSpec
    ) -> None:
        """Backend states, slots 1..n (those that changed), then the master entry."""
        for bid in set(prog.active) | prog.terminating | set(old_active):
            self._sync_backend_state(bid)
        for slot, bid in enumerate(prog.active, start=1):
            if prog.dirty or slot > len(old_active) or old_active[slot - 1] != bid:
                self._update(
                    self.maps.services, frontend_key(front, slot), Lb4Service(backend_id=bid)
                )
        affinity_timeout = spec.affinity_timeout
        flags = SVC_FLAG_AFFINITY if affinity_timeout else 0
        flags2 = 0
        if spec.node_port:
            flags |= SVC_FLAG_NODEPORT | (SVC_FLAG_EXT_LOCAL_SCOPE if spec.local_scope else 0)
        else:
            flags |= SVC_FLAG_ROUTABLE
            flags2 |= SVC_FLAG_INT_LOCAL_SCOPE if spec.local_scope else 0
        self._update(
            self.maps.services,
            frontend_key(front),
            Lb4Service(
                backend_id=affinity_timeout,
                count=len(prog.active),
                rev_nat_index=prog.rev_nat,
                flags=flags,
                flags2=flags2,
            ),
        )

    def _delete_frontend(self, front: Frontend) -> None:
        prog = self.frontends.pop(front, None)
        if prog is None:
            return
        self.maps.services.delete(frontend_key(front))
        for slot in range(1, max(len(prog.active), prog.slots_high) + 1):
            self.maps.services.delete(frontend_key(front, slot))
        self.maps.revnat.delete(_U16(prog.rev_nat))
        self._rev_nats.discard(prog.rev_nat)
        used = set(prog.active) | prog.terminating
        prog.active, prog.terminating, prog.affinity_timeout = [], set(), 0
        self._sync_matches(prog)
        for bid in used:
            self._unref(bid, front)

    def _sync_matches(self, prog: Programmed) -> None:
        want = set(prog.active) if prog.affinity_timeout else set()
        have = self._matches.setdefault(prog.rev_nat, set())
        for bid in want - have:
            match = AffinityMatch(backend_id=bid, rev_nat_id=prog.rev_nat)
            self._update(self.maps.affinity_match, match, _U8(1))
        for bid in have - want:
            self.maps.affinity_match.delete(AffinityMatch(backend_id=bid, rev_nat_id=prog.rev_nat))
        if want:
            self._matches[prog.rev_nat] = want
        else:
            self._matches.pop(prog.rev_nat, None)

    # --- backends ---------------------------------------------------------------------
    def _backend_id(self, backend: Backend) -> int:
        bid = self._backend_ids.get(backend)
        if bid is None:
            bid = self._alloc_backend_id()
            self._backend_ids[backend] = bid
            self.backends[bid] = backend
            self._refs[bid] = set()
        return bid

    def _sync_backend_state(self, bid: int) -> None:
        """Write the backend with state active when any frontend has it active."""
        backend = self.backends.get(bid)
        if backend is None:
            return
        active = any(
            bid in self.frontends[f].active for f in self._refs.get(bid, ()) if f in self.frontends
        )
        state = BE_STATE_ACTIVE if active else BE_STATE_TERMINATING
        if self._backend_state.get(bid) == state:
            return
        self._update(
            self.maps.backends,
            _U32(bid),
            Lb4Backend(
                address=ip_to_map(backend.address),
                port=port_to_map(backend.port),
                proto=backend.proto,
                flags=state,
            ),
        )
        self._backend_state[bid] = state

    def _unref(self, bid: int, front: Frontend) -> None:
        refs = self._refs.get(bid)
        if refs is None:
            return
        refs.discard(front)
        if refs:
            self._sync_backend_state(bid)
        elif self._stale is None:  # during a resync, restored backends wait for end_resync
            self._release_backend(bid)

    def _release_backend(self, bid: int) -> None:
        self.maps.backends.delete(_U32(bid))
        backend = self.backends.pop(bid, None)
        if backend is not None:
            self._backend_ids.pop(backend, None)
        self._backend_state.pop(bid, None)
        self._refs.pop(bid, None)

    # --- ids --------------------------------------------------------------------------
    def _alloc_backend_id(self) -> int:
        if len(self.backends) >= min(self.capacity, MAX_BACKEND_ID):
            raise LBMapFull(
                f"{len(self.backends)} backends fill {BACKENDS_MAP} "
                f"(--bpf-lb-map-max {self.capacity})"
            )
        while self._next_backend in self.backends or self._next_backend == 0:
            self._next_backend = self._next_backend % MAX_BACKEND_ID + 1
        bid = self._next_backend
        self._next_backend = bid % MAX_BACKEND_ID + 1
        return bid

    def _alloc_rev_nat(self) -> int:
        if len(self._rev_nats) >= min(self.capacity, MAX_REV_NAT):
            raise LBMapFull(
                f"{len(self._rev_nats)} frontends use every rev-NAT index "
                f"(at most {min(self.capacity, MAX_REV_NAT)}, --bpf-lb-map-max {self.capacity})"
            )
        while self._next_rev_nat in self._rev_nats or self._next_rev_nat == 0:
            self._next_rev_nat = self._next_rev_nat % MAX_REV_NAT + 1
        index = self._next_rev_nat
        self._rev_nats.add(index)
        self._next_rev_nat = index % MAX_REV_NAT + 1
        return index

    def _update(self, pinned: PinnedMap[Any, Any], key: Any, value: Any) -> None:
        try:
            pinned.update(key, value)
        except LibbpfError as exc:
            if exc.errno in (errno.E2BIG, errno.ENOSPC, errno.ENOMEM):
                raise LBMapFull(
                    f"{pinned.path.name} is full (--bpf-lb-map-max {self.capacity}): {exc}"
                ) from exc
            raise


def _text(front: Frontend) -> str:
    proto = {6: "TCP", 17: "UDP"}.get(front.proto, str(front.proto))
    return f"{front.address}:{front.port}/{proto}"
