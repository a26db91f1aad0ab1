"""The operator client (``cilia.controlplane.v1``): register, demand, allocations.

One long-running task keeps a session with the operator:

1. ``NodeService.Register`` with the node's addresses, local networks
   (every interface's IPv4 subnet, read with pyroute2) and Hubble address;
2. ``IPAMService.UpdateDemand`` at once and whenever :meth:`OperatorClient.demand_changed`
   is called (coalesced: only the latest demand is sent, and only when it differs
   from the last one sent in this session), with the CIDRs the node hands back
   (``released``); never in ``--ipam cluster-pool`` mode (the demand callback returns None);
3. ``IPAMService.WatchAllocations``: every message is handed to ``on_allocation``.

When any step fails or the stream ends, the session is torn down and retried
after a bounded exponential backoff (:func:`backoff_delay`, flags
``--operator-reconnect-min-backoff``/``--operator-reconnect-max-backoff``); the
delay resets once a session has delivered an allocation. gRPC's own channel
reconnect backoff is capped with the same flags. No retry library fits this
session shape (a stream plus a side task), so the loop is kept small here.

:class:`OperatorAPI` holds one channel for everything else of the issue-3 contract:
``IdentityService.Allocate/Release``, ``EndpointService.UpsertEndpoint/DeleteEndpoint``
(unary, ``--operator-timeout``; failures raise :class:`OperatorUnavailable`) and the
watch streams (identities, policies, ipcache, nodes), each followed by
:func:`run_watch` with the same bounded reconnect backoff. :class:`RetryQueue` retries
best-effort calls (DeleteEndpoint, Release after a Del) until they succeed.

:class:`PoolResolver` asks ``IPAMService.ResolvePool`` for the pool of each new pod
(multi-pool; nothing is cached, so pool edits apply to the next pod at once).
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import socket
from collections.abc import AsyncIterable, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, Self, TypeVar

import grpc
from pyroute2 import IPRoute

from cilia.controlplane.v1 import controlplane_pb2 as cp
from cilia.controlplane.v1 import controlplane_pb2_grpc as cp_grpc
from cilia_agent.config import Config
from cilia_agent.datapath.nodeaddress import DEFAULT_MTU, detect_node_address, node_first
from cilia_common import retry
from cilia_common.backoff import Backoff
from cilia_common.tls import ClientTLS, RotatingChannel, TLSFileError, certificate_identity

log = logging.getLogger(__name__)


class Demand(Protocol):
    """What the node asks for with ``UpdateDemand`` (``cilia_agent.ipam.node.Demand``).

    ``needed``: ``pool -> addresses needed``; ``released``: ``pool -> [cidr, ...]`` handed
    back. Compared with ``==`` to skip sending the same demand twice.
    """

    @property
    def needed(self) -> Mapping[str, int]: ...

    @property
    def released(self) -> Mapping[str, Sequence[str]]: ...


def backoff_delay(attempt: int, minimum: float, maximum: float) -> float:
    """Delay in seconds before reconnect attempt ``attempt`` (0-based): the one backoff
    policy, :meth:`cilia_common.backoff.Backoff.ceiling` (``min(maximum, minimum * 2**attempt)``:
    1, 2, 4, 8, 16, 30, 30, ... with the defaults, 1 s and 30 s)."""
    return Backoff(minimum, maximum).ceiling(attempt)


@dataclass(frozen=True)
class NodeNetworks:
    """The node's addresses (its own address first, :mod:`cilia_agent.datapath.nodeaddress`),
    the subnets of its interfaces, and the device carrying the node address with its MTU."""

    addresses: list[str]
    local_networks: list[tuple[str, str]]  # (interface, cidr)
    device: str = ""
    mtu: int = DEFAULT_MTU


#: Interface name prefixes never reported: pod veths (``lxc…``) and the host devices of
#: Cilia agents (``cilia_host`` and, with several agents on one host, theirs), whose /32
#: router addresses lie inside pod CIDRs and are no node network.
AGENT_DEVICE_PREFIXES = ("lxc", "cilia_")


def read_node_networks(
    exclude: tuple[str, ...] = (),
    exclude_prefixes: tuple[str, ...] = AGENT_DEVICE_PREFIXES,
    ipv4_node: str = "auto",
) -> NodeNetworks:
    """Read every global IPv4 address of the host and its subnet with pyroute2.

    Returns the addresses, this node's own address first (``ipv4_node``, ``--ipv4-node``:
    :func:`~cilia_agent.datapath.nodeaddress.detect_node_address`; never merely the first
    the kernel lists), ``(interface, subnet)`` of every interface with a global IPv4 address,
    and the node address's device and MTU. Loopback, the agent's own devices (``exclude``,
    e.g. ``--host-device-name``) and devices named with ``exclude_prefixes`` (pod veths,
    agents' host devices) are skipped. Blocking; run it in a thread.
    """
    addresses: list[str] = []
    networks: list[tuple[str, str]] = []
    names: dict[int, str] = {}
    with IPRoute() as ipr:
        # only the addresses are dumped, and the names of their links looked up one by one:
        # a dump of every link grew with the pods' veths (234 ms of CPU at 200 pods)
        for msg in ipr.addr("dump", family=2):
            ifname = names.get(msg["index"])
            if ifname is None:
                try:
                    ifname = names[msg["index"]] = socket.if_indextoname(msg["index"])
                except OSError:  # the link went away meanwhile
                    ifname = names[msg["index"]] = ""
            if msg["scope"] != 0 or not ifname or ifname == "lo":
                continue
            if ifname in exclude or ifname.startswith(exclude_prefixes):
                continue
            addr = msg.get("IFA_LOCAL") or msg.get("IFA_ADDRESS")
            if not addr:
                continue
            iface = ipaddress.IPv4Interface(f"{addr}/{msg['prefixlen']}")
            addresses.append(str(iface.ip))
            cidr = str(iface.network)
            if (ifname, cidr) not in networks:
                networks.append((ifname, cidr))
    node = detect_node_address(ipv4_node, exclude, exclude_prefixes)
    return NodeNetworks(node_first(addresses, node.address), networks, node.device, node.mtu)


def _describe(exc: BaseException) -> str:
    if isinstance(exc, grpc.aio.AioRpcError):
        return f"{exc.code().name}: {exc.details()}"
    return f"{type(exc).__name__}: {exc}"


OPERATOR_MAX_MESSAGE_BYTES = 4 * 1024 * 1024
"""Default of ``--operator-max-message-bytes``: grpcio's own default receive limit (4 MiB),
which the operator's ``--watch-max-message-bytes`` pages its streams to by default."""


def reconnect_options(
    min_backoff: float, max_backoff: float, max_message_bytes: int = OPERATOR_MAX_MESSAGE_BYTES
) -> list[tuple[str, int]]:
    """gRPC channel options capping its reconnect backoff to ``min``..``max`` seconds and the
    largest message it takes in to ``max_message_bytes`` (``--operator-max-message-bytes``;
    a larger one fails its stream with RESOURCE_EXHAUSTED)."""
    ms_min, ms_max = int(min_backoff * 1000), int(max_backoff * 1000)
    return [
        ("grpc.initial_reconnect_backoff_ms", ms_min),
        ("grpc.min_reconnect_backoff_ms", ms_min),
        ("grpc.max_reconnect_backoff_ms", ms_max),
        ("grpc.max_receive_message_length", max_message_bytes),
    ]


def operator_channel(
    address: str,
    min_backoff: float,
    max_backoff: float,
    *,
    tls: ClientTLS | None = None,
    max_message_bytes: int = OPERATOR_MAX_MESSAGE_BYTES,
) -> grpc.aio.Channel:
    """A channel to the operator with the reconnect backoff ``min``..``max`` (s) and the
    receive limit ``max_message_bytes`` (see :func:`reconnect_options`): plaintext,
    or with ``tls`` mutual TLS whose files are re-read for new calls once they change
    (:class:`cilia_common.tls.RotatingChannel`), so a renewed certificate is used without a
    restart.

    Raises:
        TLSFileError: a TLS file is unusable at start.
    """
    options = reconnect_options(min_backoff, max_backoff, max_message_bytes)
    if tls is not None:
        return RotatingChannel(address, tls, options)
    return grpc.aio.insecure_channel(address, options=options)


def warn_foreign_certificate(cfg: Config) -> None:
    """Log an error when ``--tls-operator-client-cert-file`` is not this node's agent
    certificate (``CN=system:node:<--node-name>, O=system:nodes``), or unreadable."""
    tls = cfg.operator_tls
    if tls is None:
        return
    try:
        who = certificate_identity(tls.cert_file)
    except TLSFileError as exc:
        log.error("operator client certificate unusable", extra={"error": str(exc)})
        return
    if who.node != cfg.node_name:
        log.error(
            "operator client certificate is not this node's: the operator will refuse this "
            "agent's writes (PERMISSION_DENIED)",
            extra={"certificate": who.describe(), "node": cfg.node_name,
                   "expected": f"CN=system:node:{cfg.node_name}, O=system:nodes"},
        )  # fmt: skip


class OperatorClient:
    """Keeps the node registered and its allocation flowing.

    Args:
        address: operator ``host:port``.
        node_name: this node's name.
        version: agent version sent with Register.
        timeout: deadline (s) of each unary call.
        min_backoff, max_backoff: reconnect delays (s), see :func:`backoff_delay`.
        exclude_devices: host devices not reported as local networks.
        demand: awaited for the :class:`~cilia_agent.ipam.node.Demand` to send (needed
            addresses per pool, CIDRs handed back); None sends nothing (cluster-pool).
        on_registered: awaited with the ``RegisterResponse`` (default pool, the
            operator's IPAM mode) after each Register.
        on_allocation: awaited with every ``NodeAllocation`` received.
        on_demand_sent: called with each demand the operator accepted and the
            ``UpdateDemandResponse.resource_version`` (its write of the node).
        hubble_address: returns ``host:port`` of this node's Hubble server given the
            node's addresses ("" = none), sent with Register.
        channel: the agent's one operator channel (gRPC reconnects it; its owner closes
            it); None = a channel of its own for each session.
        tls: mutual-TLS files of the session's own channel (None: plaintext; unused with
            ``channel``).
        alias_uses: returns the alias VIPs' uses (``loadbalancer.usage``), sent with every
            Register (``reports_alias_use``) and by :meth:`report_alias_use`; None: not
            reported (no load balancer).
        ipv4_node: ``--ipv4-node``: the node address registered first.
    """

    def __init__(
        self,
        *,
        address: str,
        node_name: str,
        version: str,
        timeout: float,
        min_backoff: float,
        max_backoff: float,
        exclude_devices: tuple[str, ...],
        demand: Callable[[], Awaitable[Demand | None]],
        on_registered: Callable[[cp.RegisterResponse], Awaitable[None]],
        on_allocation: Callable[[cp.NodeAllocation], Awaitable[None]],
        hubble_address: Callable[[list[str]], str] = lambda _addresses: "",
        on_demand_sent: Callable[[Demand, str], None] = lambda _demand, _rv: None,
        channel: grpc.aio.Channel | None = None,
        tls: ClientTLS | None = None,
        alias_uses: Callable[[], list[cp.AliasUse]] | None = None,
        ipv4_node: str = "auto",
    ) -> None:
        self.ipv4_node = ipv4_node
        self._alias_uses = alias_uses
        # an older operator (no ReportAliasUse): alias uses ride on Register this session
        self._reports_by_register = False
        self._nets: NodeNetworks | None = None
        self.tls = tls
        self.address = address
        self.node_name = node_name
        self.version = version
        self.timeout = timeout
        self.min_backoff = min_backoff
        self.max_backoff = max_backoff
        self.exclude_devices = exclude_devices
        self._demand = demand
        self._on_registered = on_registered
        self._on_allocation = on_allocation
        self._hubble_address = hubble_address
        self._on_demand_sent = on_demand_sent
        self._channel = channel
        self._demand_event = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.connected = False

    def start(self) -> None:
        """Start the session task (call from the running event loop)."""
        self._task = asyncio.get_running_loop().create_task(self.run(), name="operator-client")

    async def stop(self) -> None:
        """Cancel the session task and wait for it."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    def demand_changed(self) -> None:
        """Ask for the demand to be recomputed and sent (coalesced)."""
        self._demand_event.set()

    async def run(self) -> None:
        """Keep a session with the operator until cancelled (reconnects with backoff)."""
        attempt = 0
        while True:
            try:
                delivered = await self._session()
                reason = "allocation stream ended"
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # keep the agent alive whatever the operator does
                delivered, reason = False, _describe(exc)
            finally:
                self.connected = False
            if delivered:
                attempt = 0
            delay = backoff_delay(attempt, self.min_backoff, self.max_backoff)
            attempt += 1
            log.warning(
                "operator session lost, reconnecting",
                extra={"operator": self.address, "reason": reason, "retry_in_s": delay},
            )
            await asyncio.sleep(delay)

    def _register_request(self, nets: NodeNetworks) -> cp.RegisterRequest:
        self._nets = nets
        uses = self._alias_uses() if self._alias_uses is not None else None
        return cp.RegisterRequest(
            node_name=self.node_name,
            addresses=nets.addresses,
            local_networks=[cp.LocalNetwork(interface=i, cidr=c) for i, c in nets.local_networks],
            version=self.version,
            hubble_address=self._hubble_address(nets.addresses),
            reports_alias_use=uses is not None,
            alias_uses=uses or [],
        )

    async def report_alias_use(self) -> None:
        """Send the alias uses with ``NodeService.ReportAliasUse`` over the shared channel
        (``loadbalancer.usage.AliasUsage.report_loop`` calls it): the operator records
        them and nothing else (a Register would also queue an IPAM reconcile of the node).
        An older operator without that RPC (UNIMPLEMENTED) gets a Register carrying them,
        as before, for the rest of the session. Nothing before the first Register.

        Raises:
            OperatorUnavailable: the operator did not take it.
        """
        if self._nets is None or self._channel is None:
            return
        if self._alias_uses is not None and not self._reports_by_register:
            request = cp.ReportAliasUseRequest(
                node_name=self.node_name, alias_uses=self._alias_uses()
            )
            try:
                await cp_grpc.NodeServiceStub(self._channel).ReportAliasUse(  # type: ignore[no-untyped-call]
                    request, timeout=self.timeout
                )
                return
            except grpc.aio.AioRpcError as exc:
                if exc.code() != grpc.StatusCode.UNIMPLEMENTED:
                    raise _operator_error(
                        exc, f"ReportAliasUse at operator {self.address}"
                    ) from exc
                log.info(
                    "operator has no ReportAliasUse; reporting alias use with Register",
                    extra={"operator": self.address},
                )
                self._reports_by_register = True
        await self.register_again(self._nets)

    async def register_again(self, nets: NodeNetworks) -> None:
        """Register once more with ``nets`` (the node's addresses changed), over the shared
        channel; the session's own Register covers it when that channel is absent.

        Raises:
            OperatorUnavailable: the operator did not take it (the next session retries).
        """
        if self._channel is None:
            return
        try:
            await cp_grpc.NodeServiceStub(self._channel).Register(  # type: ignore[no-untyped-call]
                self._register_request(nets), timeout=self.timeout
            )
        except grpc.aio.AioRpcError as exc:
            raise _operator_error(exc, f"Register at operator {self.address}") from exc

    async def _session(self) -> bool:
        self._reports_by_register = False  # the operator may have been upgraded meanwhile
        nets = await asyncio.to_thread(
            read_node_networks, self.exclude_devices, AGENT_DEVICE_PREFIXES, self.ipv4_node
        )
        delivered = False
        own = self._channel is None
        channel = self._channel or operator_channel(
            self.address, self.min_backoff, self.max_backoff, tls=self.tls
        )
        try:
            node = cp_grpc.NodeServiceStub(channel)  # type: ignore[no-untyped-call]
            ipam = cp_grpc.IPAMServiceStub(channel)  # type: ignore[no-untyped-call]
            resp = await node.Register(self._register_request(nets), timeout=self.timeout)
            log.info(
                "registered with operator",
                extra={
                    "operator": self.address,
                    "default_pool": resp.default_pool,
                    "operator_ipam_mode": resp.ipam_mode,
                },
            )
            await self._on_registered(resp)
            self.connected = True
            sender = asyncio.get_running_loop().create_task(self._send_demand(ipam))
            stream = ipam.WatchAllocations(cp.WatchAllocationsRequest(node_name=self.node_name))
            try:
                async for msg in stream:
                    delivered = True
                    await self._on_allocation(msg.allocation)
                    if sender.done():
                        sender.result()  # re-raise a demand failure → reconnect
            finally:
                stream.cancel()  # a shared channel outlives the session: end the call
                sender.cancel()
                with contextlib.suppress(asyncio.CancelledError, grpc.aio.AioRpcError):
                    await sender
        finally:
            if own:
                await channel.close()
        return delivered

    async def _send_demand(self, ipam: cp_grpc.IPAMServiceStub) -> None:
        last: Demand | None = None
        self._demand_event.set()
        attempt = 0
        while True:
            await self._demand_event.wait()
            self._demand_event.clear()
            demand = await self._demand()
            if demand is None or demand == last:
                continue
            try:
                resp = await ipam.UpdateDemand(
                    cp.UpdateDemandRequest(
                        node_name=self.node_name,
                        demands=[
                            cp.PoolDemand(pool=p, needed_ipv4=n) for p, n in demand.needed.items()
                        ],
                        released=[
                            cp.PoolCIDRs(pool=p, cidrs=c) for p, c in demand.released.items()
                        ],
                    ),
                    timeout=self.timeout,
                )
            except grpc.aio.AioRpcError as exc:
                delay = backoff_delay(attempt, self.min_backoff, self.max_backoff)
                attempt += 1
                log.warning(
                    "demand update failed, retrying",
                    extra={"reason": _describe(exc), "retry_in_s": delay},
                )
                self._demand_event.set()
                await asyncio.sleep(delay)
                continue
            attempt = 0
            last = demand
            self._on_demand_sent(demand, resp.resource_version)
            log.info("demand sent", extra={"demand": demand.needed, "released": demand.released})


class PoolNotResolved(Exception):
    """The operator refused to pick a pool for a pod (FAILED_PRECONDITION, INVALID_ARGUMENT:
    several pools' selectors match, or a required named pool does not exist)."""


class OperatorConnection:
    """One channel to the operator for unary calls with a fixed deadline; the base of
    :class:`PoolResolver` and :class:`OperatorAPI`.

    Args:
        address: operator ``host:port``.
        node_name: this node (sent with the requests).
        timeout: deadline (s) of each unary call (``--operator-timeout``).
        min_backoff, max_backoff: gRPC channel reconnect backoff (s).

    Create it inside the running event loop; :meth:`close` closes the channel. A subclass
    creates its service stubs on the channel in :meth:`_stubs`.
    """

    def __init__(
        self,
        *,
        address: str,
        node_name: str,
        timeout: float,
        min_backoff: float,
        max_backoff: float,
        channel: grpc.aio.Channel | None = None,
        tls: ClientTLS | None = None,
    ) -> None:
        self.address = address
        self.node_name = node_name
        self.timeout = timeout
        self._owns_channel = channel is None
        self.channel = channel or operator_channel(address, min_backoff, max_backoff, tls=tls)
        self._stubs(self.channel)

    @classmethod
    def from_config(cls, cfg: Config, channel: grpc.aio.Channel | None = None) -> Self:
        """Connect to ``cfg.operator`` as ``cfg.node_name`` with ``--operator-timeout`` and
        the ``--operator-reconnect-{min,max}-backoff`` of the agent's config; over
        ``channel`` when given (the agent's one operator channel, closed by its owner).
        With mutual TLS, a client certificate made for another node is logged as an error:
        the operator refuses every write of this agent then."""
        warn_foreign_certificate(cfg)
        return cls(
            address=cfg.operator,
            node_name=cfg.node_name,
            timeout=cfg.operator_timeout,
            min_backoff=cfg.operator_reconnect_min_backoff,
            max_backoff=cfg.operator_reconnect_max_backoff,
            channel=channel,
            tls=cfg.operator_tls,
        )

    def _stubs(self, channel: grpc.aio.Channel) -> None:
        """Create the subclass's service stubs on ``channel`` (called once by __init__)."""

    async def close(self) -> None:
        """Close the channel if this connection made it (open streams end with CANCELLED);
        a shared channel is closed by its owner."""
        if self._owns_channel:
            await self.channel.close()


class PoolResolver(OperatorConnection):
    """``IPAMService.ResolvePool`` for each new pod (multi-pool mode), over its own channel.

    Args (keyword-only, see :class:`OperatorConnection`):
        address: operator ``host:port``.
        node_name: this node (sent with each request).
        timeout: deadline (s) of each call (``--operator-timeout``).
        min_backoff, max_backoff: gRPC channel reconnect backoff (s).

    Create it inside the running event loop; :meth:`close` closes the channel. Nothing is
    cached: a pool edit applies to the next pod.
    """

    def _stubs(self, channel: grpc.aio.Channel) -> None:
        self.ipam = cp_grpc.IPAMServiceStub(channel)  # type: ignore[no-untyped-call]

    async def resolve(
        self,
        namespace: str,
        name: str,
        labels: dict[str, str],
        annotations: dict[str, str],
    ) -> tuple[str, str]:
        """Return ``(pool, reason)`` the operator picked for pod ``namespace/name``.

        Raises:
            PoolNotResolved: the operator refused (the message carries its reason).
            OperatorUnavailable: the operator is unreachable, timed out, or does not
                implement ResolvePool; the message names the operator and the cause.
        """
        try:
            resp = await self.ipam.ResolvePool(
                cp.ResolvePoolRequest(
                    node_name=self.node_name,
                    pod_namespace=namespace,
                    pod_name=name,
                    pod_labels=labels,
                    pod_annotations=annotations,
                ),
                timeout=self.timeout,
            )
        except grpc.aio.AioRpcError as exc:
            if exc.code() in (
                grpc.StatusCode.FAILED_PRECONDITION,
                grpc.StatusCode.INVALID_ARGUMENT,
            ):
                raise PoolNotResolved(
                    f"no IPAM pool for pod {namespace}/{name}: {exc.details()}"
                ) from exc
            raise OperatorUnavailable(
                f"cannot choose the IPAM pool of pod {namespace}/{name}: ResolvePool at "
                f"operator {self.address} failed: {_describe(exc)}"
            ) from exc
        if not resp.pool:
            raise OperatorUnavailable(
                f"operator {self.address} resolved no pool for pod {namespace}/{name}"
            )
        return resp.pool, resp.reason


class OperatorUnavailable(Exception):
    """A call to the operator failed (unreachable, deadline, or an operator error)."""


class OperatorRejected(OperatorUnavailable):
    """The operator answered INVALID_ARGUMENT: the request itself is wrong (e.g. a pod name
    that is no DNS-1123 subdomain) and retrying it cannot succeed. The CNI gets code 7
    instead of 11 ("try again later"), so a runtime does not retry it forever. A subclass of
    :class:`OperatorUnavailable`: every caller that handles a failed operator call handles
    this one too.
    """


def _operator_error(exc: grpc.aio.AioRpcError, message: str) -> OperatorUnavailable:
    """The exception for a failed operator call: :class:`OperatorRejected` for
    INVALID_ARGUMENT, else :class:`OperatorUnavailable`; ``message`` gets the status."""
    kind = (
        OperatorRejected if exc.code() == grpc.StatusCode.INVALID_ARGUMENT else OperatorUnavailable
    )
    return kind(f"{message}: {_describe(exc)}")


class OperatorAPI(OperatorConnection):
    """Unary calls and watch streams of IdentityService, EndpointService, PolicyService,
    NodeService.WatchNodes, PodService.WatchPods and ServiceService.WatchServices over one
    channel.

    Args (keyword-only, see :class:`OperatorConnection`):
        address: operator ``host:port``.
        node_name: this node (sent with Allocate/Release/endpoint records).
        timeout: deadline (s) of each unary call (``--operator-timeout``).
        min_backoff, max_backoff: gRPC channel reconnect backoff (s).

    Create it inside the running event loop; :meth:`close` closes the channel (streams end
    with CANCELLED).
    """

    def _stubs(self, channel: grpc.aio.Channel) -> None:
        self.identities = cp_grpc.IdentityServiceStub(channel)  # type: ignore[no-untyped-call]
        self.endpoints = cp_grpc.EndpointServiceStub(channel)  # type: ignore[no-untyped-call]
        self.policies = cp_grpc.PolicyServiceStub(channel)  # type: ignore[no-untyped-call]
        self.nodes = cp_grpc.NodeServiceStub(channel)  # type: ignore[no-untyped-call]
        self.pods = cp_grpc.PodServiceStub(channel)  # type: ignore[no-untyped-call]
        self.services = cp_grpc.ServiceServiceStub(channel)  # type: ignore[no-untyped-call]

    async def allocate_identity(self, labels: list[str]) -> cp.Identity:
        """``IdentityService.Allocate`` for the (filtered, sorted) ``labels``.

        Raises:
            OperatorRejected: the operator refused the labels (INVALID_ARGUMENT).
            OperatorUnavailable: the call failed otherwise; the message names the reason.
        """
        try:
            resp = await self.identities.Allocate(
                cp.AllocateRequest(node_name=self.node_name, labels=labels), timeout=self.timeout
            )
        except grpc.aio.AioRpcError as exc:
            raise _operator_error(
                exc, f"identity allocation at operator {self.address} failed"
            ) from exc
        identity: cp.Identity = resp.identity
        if identity.id == 0:
            raise OperatorUnavailable(f"operator {self.address} allocated identity 0 for {labels}")
        return identity

    async def release_identity(self, identity: int) -> None:
        """``IdentityService.Release``. Raises OperatorUnavailable."""
        try:
            await self.identities.Release(
                cp.ReleaseRequest(node_name=self.node_name, id=identity), timeout=self.timeout
            )
        except grpc.aio.AioRpcError as exc:
            raise OperatorUnavailable(f"identity release failed: {_describe(exc)}") from exc

    async def upsert_endpoint(self, record: cp.EndpointRecord) -> None:
        """``EndpointService.UpsertEndpoint``.

        Raises:
            OperatorRejected: the operator refused the record (INVALID_ARGUMENT).
            OperatorUnavailable: any other failure.
        """
        try:
            await self.endpoints.UpsertEndpoint(
                cp.UpsertEndpointRequest(endpoint=record), timeout=self.timeout
            )
        except grpc.aio.AioRpcError as exc:
            raise _operator_error(
                exc, f"endpoint record at operator {self.address} failed"
            ) from exc

    async def delete_endpoint(self, namespace: str, name: str, container_id: str = "") -> None:
        """``EndpointService.DeleteEndpoint`` of this node's (and, when given, this
        container's) record. A record the operator says belongs to another node or
        container (FAILED_PRECONDITION) is not ours to delete: logged, not an error.

        Raises OperatorUnavailable for any other failure (the caller retries).
        """
        try:
            await self.endpoints.DeleteEndpoint(
                cp.DeleteEndpointRequest(
                    namespace=namespace,
                    name=name,
                    node_name=self.node_name,
                    container_id=container_id,
                ),
                timeout=self.timeout,
            )
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.FAILED_PRECONDITION:
                log.info(
                    "operator kept the endpoint record: %s",
                    exc.details(),
                    extra={"endpoint": f"{namespace}/{name}", "container_id": container_id},
                )
                return
            raise OperatorUnavailable(f"endpoint delete failed: {_describe(exc)}") from exc

    def watch_identities(self) -> AsyncIterable[cp.WatchIdentitiesResponse]:
        """A new ``WatchIdentities`` stream."""
        return self.identities.WatchIdentities(cp.WatchIdentitiesRequest())  # type: ignore[no-any-return]

    def watch_policies(self) -> AsyncIterable[cp.WatchPoliciesResponse]:
        """A new ``WatchPolicies`` stream."""
        return self.policies.WatchPolicies(cp.WatchPoliciesRequest())  # type: ignore[no-any-return]

    def watch_ipcache(self) -> AsyncIterable[cp.WatchIPCacheResponse]:
        """A new ``WatchIPCache`` stream."""
        return self.endpoints.WatchIPCache(cp.WatchIPCacheRequest())  # type: ignore[no-any-return]

    def watch_nodes(self) -> AsyncIterable[cp.WatchNodesResponse]:
        """A new ``WatchNodes`` stream."""
        return self.nodes.WatchNodes(cp.WatchNodesRequest())  # type: ignore[no-any-return]

    def watch_pods(self, node_name: str) -> AsyncIterable[cp.WatchPodsResponse]:
        """A new ``PodService.WatchPods`` stream of ``node_name``'s Pods (Kubernetes mode)."""
        return self.pods.WatchPods(cp.WatchPodsRequest(node_name=node_name))  # type: ignore[no-any-return]

    def watch_services(self) -> AsyncIterable[cp.WatchServicesResponse]:
        """A new ``ServiceService.WatchServices`` stream (every Service, then changes)."""
        return self.services.WatchServices(  # type: ignore[no-any-return]
            cp.WatchServicesRequest(node_name=self.node_name)
        )


T = TypeVar("T")


async def run_watch(
    name: str,
    open_stream: Callable[[], AsyncIterable[T]],
    consume: Callable[[AsyncIterable[T]], Awaitable[bool]],
    *,
    min_backoff: float,
    max_backoff: float,
) -> None:
    """Follow a watch stream forever: :func:`cilia_common.retry.run_watch` with the operator
    reconnect backoff; gRPC errors are expected (no traceback), read as :func:`_describe`."""
    await retry.run_watch(
        name, open_stream, consume, Backoff(min_backoff, max_backoff),
        logger=log, quiet=(grpc.aio.AioRpcError,), describe=_describe,
    )  # fmt: skip


class RetryQueue(retry.RetryQueue):
    """Retries best-effort operator calls (e.g. DeleteEndpoint after a Del) until they succeed:
    :class:`cilia_common.retry.RetryQueue` on the operator reconnect backoff. Not persisted:
    calls pending when the agent stops are lost (the operator's garbage collection covers
    them)."""

    def __init__(self, *, min_backoff: float, max_backoff: float) -> None:
        super().__init__(Backoff(min_backoff, max_backoff), logger=log)
        self.min_backoff = min_backoff
        self.max_backoff = max_backoff
