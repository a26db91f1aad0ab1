"""The eBPF datapath's owners, built together once the programs are loaded.

Order: bpffs mounted if needed → ``bpf_lxc.o`` (compiled ahead of time by ``make bpf``)
loaded with libbpf and its pinned maps opened (``datapath.loader``) → the ipcache with its BPF writer as listener → the policy engine
over the pinned ``cilia_policy`` map (adopting the entries found there) with its streams'
readiness → the identity allocator feeding the engine's identity cache → endpoint
regeneration over all of them (the engine calls it back to write enforcement flags).

After a restart, :func:`restore` re-enforces the endpoints restored from their state
files; :func:`watches` names the operator streams that feed the owners.

Without ``--enable-bpf`` none of this exists: the ipcache still names addresses for
Hubble and nothing is written to the kernel.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import AsyncIterable, Awaitable, Callable, Iterable
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any, Protocol

from cilia_agent.config import Config
from cilia_agent.config_hubble import MONITOR_AGGREGATION_LEVELS
from cilia_agent.controlplane import ControlPlane, OperatorAPI, RetryQueue
from cilia_agent.datapath.bpffs import ensure_bpffs
from cilia_agent.datapath.loader import Datapath, DatapathConfig
from cilia_agent.datapath.objects import default_bpf_dir
from cilia_agent.endpoint.regeneration import Regeneration
from cilia_agent.endpoint.state import EndpointRecord
from cilia_agent.identity.allocator import IdentityAllocator
from cilia_agent.identity.watcher import consume_identities
from cilia_agent.ipcache import IPCache
from cilia_agent.ipcache.bpf import BPFWriter, read_prefixes
from cilia_agent.ipcache.watcher import consume_ipcache
from cilia_agent.metrics import Metrics
from cilia_agent.policy.engine import PolicyEngine
from cilia_agent.policy.maps import PolicyMapError, PolicyMapWriter
from cilia_agent.policy.watcher import PolicyStreams

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Enforcement:
    """The owners of the node's enforcement state (see the module docstring)."""

    bpf: Datapath
    ipcache: IPCache
    engine: PolicyEngine
    streams: PolicyStreams
    identities: IdentityAllocator
    regeneration: Regeneration


async def load(
    cfg: Config,
    ipcache: IPCache,
    control: ControlPlane,
    retry: RetryQueue,
    executor: Executor,
    metrics: Metrics,
) -> Enforcement:
    """Load the datapath and build the owners over it.

    Raises:
        BpfUnavailable: the object missing or stale, bpffs not mounted, a pinned map of
            other sizes, or the verifier refused a program.
    """
    loop = asyncio.get_running_loop()
    if await loop.run_in_executor(executor, ensure_bpffs, cfg.bpf_pin_dir):
        log.info("mounted bpffs", extra={"path": "/sys/fs/bpf"})
    dp_config = DatapathConfig(
        bpf_dir=cfg.bpf_dir or default_bpf_dir(),
        pin_dir=cfg.bpf_pin_dir,
        ipcache_max=cfg.bpf_ipcache_map_max,
        policy_max=cfg.bpf_policy_map_max,
        ct_max=cfg.bpf_ct_global_max,
        events_pages=cfg.bpf_events_ringbuf_pages,
        events_wakeup_events=cfg.bpf_events_wakeup_events,
        monitor_aggregation=MONITOR_AGGREGATION_LEVELS[cfg.monitor_aggregation],
        monitor_aggregation_interval_ns=int(cfg.monitor_aggregation_interval * 1e9),
        monitor_aggregation_flags=cfg.monitor_aggregation_mask(),
        host_legacy_routing=cfg.enable_host_legacy_routing,
    )
    started = time.perf_counter()
    bpf = await loop.run_in_executor(executor, Datapath.load, dp_config)
    ipcache.add_listener(BPFWriter(bpf))
    engine = PolicyEngine(
        PolicyMapWriter(bpf.policy_map, capacity=cfg.bpf_policy_map_max),
        prefixes=ipcache,  # policy CIDRs → the ipcache (and its BPF writer)
    )
    streams = PolicyStreams(
        engine, metrics.policy, cfg.endpoint_policy_wait_timeout, metrics.policy_unenforceable
    )
    identities = IdentityAllocator(control, retry, engine, on_learn_error=(PolicyMapError,))
    regeneration = Regeneration(
        datapath=bpf,
        identities=identities,
        ipcache=ipcache,
        engine=engine,
        streams=streams,
        control=control,
        retry=retry,
        executor=executor,
        node_name=cfg.node_name,
        mode=cfg.enable_policy,
        policy_audit_mode=cfg.policy_audit_mode,
    )
    engine.on_enforce = regeneration.on_enforce
    adopted = engine.restore()
    engine.restore_prefixes(read_prefixes(bpf.ipcache_map.items()))
    log.info(
        "eBPF datapath ready",
        extra={
            "pin_dir": str(cfg.bpf_pin_dir),
            "load_s": round(time.perf_counter() - started, 2),
            "adopted_policy_endpoints": len(adopted),
            "policy_mode": cfg.enable_policy,
            "policy_audit_mode": cfg.policy_audit_mode,
        },
    )
    return Enforcement(bpf, ipcache, engine, streams, identities, regeneration)


Watch = tuple[str, Callable[[], AsyncIterable[Any]], Callable[[AsyncIterable[Any]], Awaitable[Any]]]
"""``(name, open_stream, consume)`` of one operator watch stream."""


def watches(enf: Enforcement, api: OperatorAPI) -> list[Watch]:
    """The operator streams feeding the owners: identities → the identity cache (through the
    engine; readiness re-read), policies → the repository, ipcache → the ipcache."""
    identities = functools.partial(
        consume_identities, enf.engine, enf.identities, on_change=enf.streams.changed
    )
    return [
        ("identities", api.watch_identities, identities),
        ("policies", api.watch_policies, enf.streams.consume_policies),
        ("ipcache", api.watch_ipcache, functools.partial(consume_ipcache, enf.ipcache)),
    ]


async def restore(
    enf: Enforcement, restored: Iterable[EndpointRecord], cleaned: Iterable[EndpointRecord]
) -> list[EndpointRecord]:
    """Re-enforce the endpoints restored after a restart; release the operator records,
    identities and pinned ipcache entries of the ones cleaned up (a crash mid-Add, a missed
    Del — a record cleaned while ``creating`` may have reached the operator already).
    Returns the restored endpoints without an identity (created with BPF off)."""
    cleaned = list(cleaned)
    missing = await enf.regeneration.restore(restored)
    enf.regeneration.forget(cleaned)
    enf.regeneration.purge_ipcache(cleaned)
    return missing


class EndpointIdentities(Protocol):
    """Where a late identity is recorded (``EndpointManager.set_identity``)."""

    async def set_identity(self, key: tuple[str, str], identity: int) -> None:
        """Persist ``identity`` for the endpoint ``key``."""


async def late_enforce(
    enf: Enforcement, endpoints: EndpointIdentities, rec: EndpointRecord
) -> None:
    """Give an endpoint restored without identity (created with BPF off) its enforcement;
    a failure raises (the caller's supervisor retries with backoff)."""
    identity = await enf.regeneration.create(rec, 0)
    await endpoints.set_identity(rec.key, identity)
    log.info("restored endpoint enforced", extra={"endpoint_id": rec.id})
