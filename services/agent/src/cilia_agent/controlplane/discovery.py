"""Finding the operator without a ClusterIP: ``--operator k8s:NAMESPACE/SERVICE``.

Clusters run without kube-proxy, and the ClusterIP of the operator's Service is translated
only by the agents' own socket load balancer, whose Services come from the operator: an
agent that dialled the ClusterIP would wait on itself. So the agent lists the Service's
EndpointSlices through the API server (:mod:`.kubeapi`, which it reaches at
``k8sServiceHost:Port``) and dials the operator's addresses directly (the operator runs with
``hostNetwork``, as upstream's, so its addresses are node addresses).

Order of operations:

1. LIST ``/apis/discovery.k8s.io/v1/namespaces/NAMESPACE/endpointslices`` with
   ``labelSelector=kubernetes.io/service-name=SERVICE``;
2. from every IPv4 slice, every endpoint whose ``conditions.ready`` is not false (the
   EndpointSlice API's rule: unset means ready) gives ``address:port``, the port being the
   slice port named :data:`PORT_NAME` (``grpc``); sorted, so the target is stable;
3. the gRPC target becomes ``ipv4:a:port,b:port`` with ``pick_first``: gRPC tries the
   addresses in turn and keeps the first that connects, so a dead address in the list costs
   one failed connect, not the session;
4. the list is taken again every ``--operator-discovery-interval`` seconds and at once when
   the channel is in ``TRANSIENT_FAILURE`` (no address answers: the operator moved), first
   after ``--operator-reconnect-min-backoff``, the gap doubling up to the interval while the
   failure lasts; a new address set gives a new channel for
   new calls (:class:`DiscoveredChannel`), running calls finish on theirs, and the sessions'
   own reconnects land on the new one.

A list that fails, or finds no ready endpoint, keeps the addresses known before (logged):
the operator did not necessarily move because the API server is away.

With mutual TLS (``--tls-operator-*``) the operator's certificate must carry
``--tls-operator-server-name``, by default ``SERVICE.NAMESPACE.svc`` (the name the chart puts
in the operator's certificate), since the dialled addresses are not names.
"""

from __future__ import annotations

import asyncio
import dataclasses
import ipaddress
import logging
import re
from collections.abc import Sequence
from typing import Any

import grpc

from cilia_agent.config import Config
from cilia_agent.controlplane.kubeapi import KubeAPIError, KubeClient, resolve_access
from cilia_common.channels import SwappableChannel
from cilia_common.tls import ClientTLS, RotatingChannel

log = logging.getLogger(__name__)

PREFIX = "k8s:"
PORT_NAME = "grpc"
"""The Service port name of the operator's gRPC port (``cilia-operator``, port 4250)."""
SERVICE_LABEL = "kubernetes.io/service-name"
_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")


class OperatorNotFound(LookupError):
    """The Service's EndpointSlices list no ready address with a ``grpc`` port."""


def parse_operator_service(value: str) -> tuple[str, str] | None:
    """``k8s:NAMESPACE/SERVICE`` → ``(namespace, service)``; None for a ``host:port``.

    Raises:
        ValueError: ``k8s:`` followed by anything but two DNS-1123 labels.
    """
    if not value.startswith(PREFIX):
        return None
    namespace, sep, service = value[len(PREFIX) :].partition("/")
    if not sep or not _NAME.match(namespace) or not _NAME.match(service):
        raise ValueError(f"{value!r} is not k8s:NAMESPACE/SERVICE (DNS-1123 labels)")
    return namespace, service


def ready_addresses(slices: Sequence[dict[str, Any]], port_name: str = PORT_NAME) -> list[str]:
    """Sorted ``ip:port`` of every ready IPv4 endpoint of ``slices`` (EndpointSlice JSON
    objects) on the port named ``port_name``; see the module docstring, step 2."""
    out: set[str] = set()
    for item in slices:
        if item.get("addressType") != "IPv4":
            continue
        ports = [p.get("port") for p in item.get("ports") or [] if p.get("name") == port_name]
        if not ports or not isinstance(ports[0], int):
            continue
        for endpoint in item.get("endpoints") or []:
            if (endpoint.get("conditions") or {}).get("ready") is False:
                continue
            for address in endpoint.get("addresses") or []:
                try:
                    ip = ipaddress.IPv4Address(address)
                except ValueError:
                    continue
                out.add(f"{ip}:{ports[0]}")
    return sorted(out, key=lambda a: (ipaddress.IPv4Address(a.rsplit(":", 1)[0]), a))


def target_of(addresses: Sequence[str]) -> str:
    """The gRPC target of ``addresses`` (``["10.0.0.1:4250"]`` → ``ipv4:10.0.0.1:4250``)."""
    return "ipv4:" + ",".join(addresses)


class OperatorEndpoints:
    """Lists the operator Service's ready endpoints through the API server.

    Args:
        client: the API server client.
        namespace, service: from ``k8s:NAMESPACE/SERVICE``.
    """

    def __init__(self, client: KubeClient, namespace: str, service: str) -> None:
        self.client = client
        self.namespace = namespace
        self.service = service

    def describe(self) -> str:
        """``k8s:NAMESPACE/SERVICE``."""
        return f"{PREFIX}{self.namespace}/{self.service}"

    def list(self) -> list[str]:
        """The ready ``ip:port`` addresses now (blocking).

        Raises:
            KubeAPIError: the API server did not answer the LIST.
            OperatorNotFound: no ready endpoint with a ``grpc`` port.
        """
        body = self.client.get(
            f"/apis/discovery.k8s.io/v1/namespaces/{self.namespace}/endpointslices",
            {"labelSelector": f"{SERVICE_LABEL}={self.service}"},
        )
        found = ready_addresses(body.get("items") or [])
        if not found:
            raise OperatorNotFound(
                f"Service {self.namespace}/{self.service} has no ready endpoint with a port "
                f"named {PORT_NAME!r} (is the operator running?)"
            )
        return found


class DiscoveredChannel(SwappableChannel):
    """A ``grpc.aio.Channel`` to the addresses :class:`OperatorEndpoints` last found; a
    stub made once follows every change (a :class:`cilia_common.channels.SwappableChannel`:
    its multi-callables bind at each call).

    Args:
        endpoints: the lister.
        options: channel options (reconnect backoff); ``pick_first`` is added.
        tls: mutual-TLS files (None: plaintext); ``tls.server_name`` is the name checked.
        interval: ``--operator-discovery-interval`` (s) between lists.
        min_gap: least seconds between two lists (``--operator-reconnect-min-backoff``).
    """

    def __init__(
        self,
        endpoints: OperatorEndpoints,
        options: Sequence[tuple[str, Any]],
        tls: ClientTLS | None,
        *,
        interval: float,
        min_gap: float,
    ) -> None:
        super().__init__()
        self.endpoints = endpoints
        self._options = [*options, ("grpc.lb_policy_name", "pick_first")]
        self._tls = tls
        self.interval = interval
        self.min_gap = min_gap
        self.addresses: list[str] = []
        self._target = ""

    # -- discovery -----------------------------------------------------------------------

    def _dial(self, target: str) -> grpc.aio.Channel:
        if self._tls is not None:
            return RotatingChannel(target, self._tls, self._options)
        return grpc.aio.insecure_channel(target, options=self._options)

    def apply(self, addresses: Sequence[str]) -> bool:
        """Use ``addresses`` for new calls; True when they differ from the current ones."""
        if list(addresses) == self.addresses:
            return False
        old, self.addresses = self.addresses, list(addresses)
        self._target = target_of(self.addresses)
        self.swap(self._dial(self._target))
        log.info(
            "operator endpoints found",
            extra={"operator": self.endpoints.describe(), "addresses": self.addresses,
                   "previous": old},
        )  # fmt: skip
        return True

    async def refresh(self) -> bool:
        """List once and apply the result; False when the list failed or was empty (the
        known addresses stay, the reason is logged)."""
        try:
            found = await asyncio.to_thread(self.endpoints.list)
        except (KubeAPIError, OperatorNotFound) as exc:
            log.warning(
                "cannot find the operator's endpoints; keeping the known ones",
                extra={"operator": self.endpoints.describe(), "reason": str(exc),
                       "known": self.addresses},
            )  # fmt: skip
            return False
        self.apply(found)
        return True

    def _failing(self) -> bool:
        current = self._current
        if current is None:
            return True
        state = current.get_state(try_to_connect=False)
        return bool(state == grpc.ChannelConnectivity.TRANSIENT_FAILURE)

    async def run(self) -> None:
        """Re-list every :attr:`interval` s, and sooner whenever the channel is failing or no
        address is known yet: after :attr:`min_gap` s, the gap doubling (up to
        :attr:`interval`) while the failure lasts, so an operator outage on a large cluster
        does not become a stream of LISTs at the API server; until cancelled."""
        loop = asyncio.get_running_loop()
        last = loop.time()
        gap = self.min_gap
        while True:
            await asyncio.sleep(min(self.min_gap, self.interval))
            now = loop.time()
            failing = self._failing()
            if not failing:
                gap = self.min_gap
            if now - last >= self.interval or (failing and now - last >= gap):
                last = now
                await self.refresh()
                if failing:
                    gap = min(gap * 2, self.interval)

    # -- grpc.aio.Channel -----------------------------------------------------------------

    def current(self) -> grpc.aio.Channel:
        """The channel for a new call; before any address is known, one to an address no
        server holds (calls fail UNAVAILABLE and their callers retry with backoff)."""
        if self._current is None:
            self._target = "unix:/nonexistent/cilia-operator-not-discovered-yet"
            self.swap(self._dial(self._target))
        return self._current

    async def close(self, grace: float | None = None) -> None:
        """Close the current channel, every superseded one, and the API-server client."""
        await super().close(grace)
        self.endpoints.client.close()


def discovered_channel(cfg: Config, options: Sequence[tuple[str, Any]]) -> DiscoveredChannel:
    """The :class:`DiscoveredChannel` of ``--operator k8s:NAMESPACE/SERVICE`` with the API
    server of ``--k8s-kubeconfig-path``/``--k8s-api-server``/the environment
    (:func:`~.kubeapi.resolve_access`), requests bounded by ``--operator-timeout``, and the
    mutual-TLS server name defaulting to ``SERVICE.NAMESPACE.svc``.

    Raises:
        KubeConfigError: the API server's location or credentials are unusable.
        TLSFileError: a TLS file is unusable.
    """
    parsed = parse_operator_service(cfg.operator)
    assert parsed is not None, "not a k8s: operator"
    namespace, service = parsed
    access = resolve_access(cfg.k8s_kubeconfig_path, cfg.k8s_api_server)
    client = KubeClient(access, timeout=cfg.operator_timeout)
    tls = cfg.operator_tls
    if tls is not None and not tls.server_name:
        tls = dataclasses.replace(tls, server_name=f"{service}.{namespace}.svc")
    log.info(
        "finding the operator through the API server",
        extra={"operator": cfg.operator, "api_server": access.server, "source": access.source},
    )
    return DiscoveredChannel(
        OperatorEndpoints(client, namespace, service),
        options,
        tls,
        interval=cfg.operator_discovery_interval,
        min_gap=cfg.operator_reconnect_min_backoff,
    )
