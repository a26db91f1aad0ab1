"""A multi-node Cilia cluster on one host: each node a network namespace with its own agent,
joined by a LAN bridge; redis, the operator and the relay in the host's namespace.

Layout of the cluster holding stack slot ``S`` (the :class:`~cilia_testkit.stack.Stack` slot,
so clusters and stacks coexist on one host)::

    host netns:  bridge cilia-lan<S>  198.18.<S>.1/24   redis (unix socket), operator on
                 198.18.<S>.1:<port 0>, relay (Observer on 127.0.0.1:<port 0>)
                   │ veth cl<S>n<i> ─── eth0 in netns cilia-cl<S>-<node>   198.18.<S>.<10+i>/24
                   │                    default via 198.18.<S>.1, lo up
                   │                    cilia-agent serve (via nsenter --net), Hubble :4244,
                   │                    metrics :9962, its own socket/state/pins/CNI conf dir
    pods:        netns cilia-cl<S>-<pod>, plumbed by the real ``cilia-cni`` with their node's
                 conflist (the plugin talks to that node's agent socket)
    outside:     netns cilia-cl<S>-outside (:meth:`Cluster.add_outside_host`), 198.18.<S>.250/24
                 on the bridge, no default route and no route to any pod CIDR: the internet
                 of masquerade tests (agents run with --enable-ipv4-masquerade=true)

Addresses come from 198.18.0.0/15 (RFC 2544, benchmarking networks), one /24 per slot;
pods from the stack's pool ``10.<210+S>.0.0/16`` (a /24 block per node). Order of
operations in :meth:`Cluster.start`: slot → LAN (bridge, iptables ACCEPT for frames bridged
between its ports: the host's FORWARD policy may be DROP and ``br_netfilter`` passes bridged
IPv4 through it) → redis → operator → every node's netns and agent (all launched, then each
awaited: their start-ups overlap) → relay (``--peer-service`` = the first node's
Hubble socket; it learns the others through Peer ``Notify``). :meth:`Cluster.stop` undoes it in
reverse and deletes every netns with the cluster's prefix; :meth:`Cluster.prepare` removes what a
killed earlier holder of the slot left (namespaces, bridge, iptables rule).

Node lifecycle at run time: :meth:`Cluster.add_node`, :meth:`Cluster.remove_node` (agent
stopped, node record deleted through ``cilia-operator delete ciliumnodes NAME``, netns gone),
:meth:`Cluster.kill_agent` / :meth:`Cluster.restart_agent`. The relay's ``--peer-service`` is the
first node's Hubble socket: removing that node leaves the relay without its peer service.

Needs root (netns, veth, bridge, iptables, bpffs) and ``nsenter`` (util-linux).
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import pathlib
import subprocess
from collections.abc import Iterable, Mapping, Sequence
from types import TracebackType
from typing import Any, Self

from cilia_testkit import cni
from cilia_testkit.clusternodes import (
    BRIDGE_HOST,
    COMMAND_SECONDS,
    DEFAULT_MTU,
    HUBBLE_PORT,
    LAN_RANGE,
    METRICS_PORT,
    NODE_HOST_BASE,
    OUTSIDE_HOST,
    ROUTING_MODES,
    RTPROT_CILIA,
    ClusterError,
    Node,
    OutsideHost,
    RoutingMode,
    lan_network,
    netns_prefix,
    node_letter_name,
)
from cilia_testkit.host import sh, wait_for
from cilia_testkit.netns import create_netns, delete_netns, list_netns
from cilia_testkit.stack import READY_SECONDS, Stack


class Cluster:
    """N nodes, each a netns with its own ``cilia-agent``, on one operator (see the module
    docstring for the layout).

    Args:
        nodes: how many nodes :meth:`start` creates (``node-a``, ``node-b`` …).
        routing: every agent's ``--routing-mode`` (``tunnel`` adds ``--tunnel-protocol vxlan``).
        name: names the run dir (``cilia-<name>-…``).
        mtu: the LAN's MTU (bridge, veths) and the agents' ``--mtu``.
        relay: start cilia-relay.
        agent_args, operator_args, relay_args: extra flags of every agent / the operator /
            the relay.
        hubble_tls: Hubble over mutual TLS between relay and agents, and TLS from clients
            to the relay (:class:`~cilia_testkit.stack.Stack` ``hubble_tls``).
        ready_seconds: per component start timeout.
        run_dir, keep_run_dir: as for :class:`~cilia_testkit.stack.Stack`.

    Raises (from :meth:`start`):
        ClusterError, StackError: something failed to start; what started is stopped.
    """

    def __init__(
        self,
        nodes: int = 3,
        *,
        routing: RoutingMode = "native",
        name: str = "cluster",
        mtu: int = DEFAULT_MTU,
        relay: bool = True,
        agent_args: Sequence[str] = (),
        operator_args: Sequence[str] = (),
        relay_args: Sequence[str] = (),
        hubble_tls: bool = False,
        ready_seconds: float = READY_SECONDS,
        run_dir: pathlib.Path | None = None,
        keep_run_dir: bool = False,
    ) -> None:
        if routing not in ROUTING_MODES:
            raise ValueError(f"routing {routing!r} is not one of {ROUTING_MODES}")
        self.node_count = nodes
        self.routing: RoutingMode = routing
        self.mtu = mtu
        self.with_relay = relay
        self.extra_agent_args = tuple(agent_args)
        self.stack = Stack(
            name,
            agents=0,
            relay=relay,
            operator_args=operator_args,
            relay_args=relay_args,
            hubble_tls=hubble_tls,
            ready_seconds=ready_seconds,
            run_dir=run_dir,
            keep_run_dir=keep_run_dir,
        )
        self.nodes: dict[str, Node] = {}
        self.pods: list[cni.Pod] = []
        self.pod_node: dict[str, str] = {}
        self._lan_ready = False
        self._next_index = 0

    # -- names and addresses --------------------------------------------------------------

    @property
    def slot(self) -> int:
        """The stack slot held (-1 before :meth:`prepare`)."""
        return self.stack.slot

    @property
    def lan(self) -> ipaddress.IPv4Network:
        """The LAN, ``198.18.<slot>.0/24``."""
        return lan_network(self.slot)

    @property
    def bridge(self) -> str:
        """The LAN bridge's name in the host netns."""
        return f"cilia-lan{self.slot}"

    @property
    def bridge_address(self) -> str:
        """The host's address on the LAN (the nodes' default gateway, the operator's)."""
        return str(self.lan.network_address + BRIDGE_HOST)

    @property
    def prefix(self) -> str:
        """Prefix of every netns of this cluster."""
        return netns_prefix(self.slot)

    @property
    def pool_cidr(self) -> str:
        """The pod pool (the operator's ``default`` pool)."""
        return self.stack.pool_cidr

    @property
    def operator_address(self) -> str:
        """The operator's gRPC address on the LAN (``198.18.S.1:PORT``)."""
        return self.stack.operator_address

    @property
    def relay_address(self) -> str:
        """The relay's Observer address (``127.0.0.1:PORT``)."""
        return self.stack.relay_address

    def node(self, name: str) -> Node:
        """The node called ``name``.

        Raises:
            ClusterError: no such node.
        """
        try:
            return self.nodes[name]
        except KeyError:
            raise ClusterError(f"no node {name!r} in this cluster ({sorted(self.nodes)})") from None

    def agent_args(self) -> list[str]:
        """The routing flags every agent of this cluster gets, then the extra ones.

        NodePort programs and masquerade are on (the Stack turns them off for host-netns
        agents): each node's agent has its own netns, whose default-route device is its LAN
        veth."""
        args = ["--routing-mode", self.routing, "--mtu", str(self.mtu), "--enable-node-port=true",
                "--enable-ipv4-masquerade=true"]  # fmt: skip
        if self.routing == "tunnel":
            args += ["--tunnel-protocol", "vxlan"]
        else:  # the nodes share the LAN bridge: direct routes, as upstream's autoDirectNodeRoutes
            args += ["--auto-direct-node-routes=true"]
        return [*args, *self.extra_agent_args]

    # -- lifecycle ------------------------------------------------------------------------

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def prepare(self) -> Self:
        """Take a slot (:meth:`Stack.prepare`), remove what a killed holder of the slot left
        (netns with the prefix, the bridge, its iptables rule) and create the LAN bridge.

        Raises:
            StackError: no free slot.
            subprocess.CalledProcessError: the bridge could not be created (not root?).
        """
        self.stack.prepare()
        self.stack.operator_host = self.bridge_address
        self._remove_lan()
        self._create_lan()
        return self

    def start(self) -> Self:
        """:meth:`prepare`, then redis, operator, the nodes, the relay (module docstring).

        Raises:
            StackError: a component failed (everything started is stopped).
        """
        try:
            self.prepare()
            self.stack.start_redis()
            self.stack.start_operator()
            made = [self._create_node() for _ in range(self.node_count)]
            for node in made:
                node.agent.launch()
            for node in made:
                node.agent.wait_ready()
            if self.with_relay and made:
                self.stack.start_relay()
        except BaseException:
            self.stop()
            raise
        self.stack.started = True
        return self

    def stop(self) -> None:
        """Delete the pods (DEL while their agent runs), stop every component, delete every
        namespace of the cluster, the bridge and its iptables rule, release the slot.
        Idempotent."""
        self.delete_pods()
        slot = self.slot
        self.stack.stop()  # relay, agents, operator, redis; pins; run dir; slot
        if slot >= 0:
            for name in list_netns(netns_prefix(slot)):
                delete_netns(name)
            self._remove_lan(slot)
        self.nodes.clear()
        self._next_index = 0

    # -- the LAN --------------------------------------------------------------------------

    def _iptables_rule(self, bridge: str) -> list[str]:
        return [
            "FORWARD",
            "-i",
            bridge,
            "-o",
            bridge,
            "-m",
            "comment",
            "--comment",
            f"cilia test cluster LAN {bridge}",
            "-j",
            "ACCEPT",
        ]

    def _create_lan(self) -> None:
        bridge = self.bridge
        sh("ip", "link", "add", bridge, "type", "bridge")
        sh("ip", "link", "set", bridge, "mtu", str(self.mtu))
        sh("ip", "addr", "add", f"{self.bridge_address}/{self.lan.prefixlen}", "dev", bridge)
        sh("ip", "link", "set", bridge, "up")
        sh("iptables", "-I", *self._iptables_rule(bridge))
        self._lan_ready = True

    def _remove_lan(self, slot: int | None = None) -> None:
        bridge = f"cilia-lan{self.slot if slot is None else slot}"
        rule = self._iptables_rule(bridge)
        while sh("iptables", "-C", *rule, check=False).returncode == 0:
            sh("iptables", "-D", *rule, check=False)
        for name in list_netns(netns_prefix(self.slot if slot is None else slot)):
            delete_netns(name)
        if pathlib.Path(f"/sys/class/net/{bridge}").exists():
            sh("ip", "link", "del", bridge, check=False)
        self._lan_ready = False

    # -- the outside host -----------------------------------------------------------------

    def add_outside_host(self, name: str = "outside") -> OutsideHost:
        """A host on the LAN standing for the internet: netns ``<prefix><name>``, address
        ``198.18.<slot>.<OUTSIDE_HOST>`` on its ``eth0`` (a port of the bridge), the LAN's
        connected route only: no default route and no route to any pod CIDR, so a packet
        with a pod source address cannot be answered. Deleted by :meth:`stop` with every
        netns of the cluster.

        Raises:
            ClusterError: the LAN does not exist, or the host exists already.
        """
        if not self._lan_ready:
            raise ClusterError("the cluster's LAN does not exist: call prepare() or start()")
        netns = f"{self.prefix}{name}"
        if netns in list_netns(self.prefix):
            raise ClusterError(f"outside host {name!r} exists already")
        address = str(self.lan.network_address + OUTSIDE_HOST)
        veth = f"cl{self.slot}o{len(name)}{name[:4]}"[:15]
        create_netns(netns)
        sh("ip", "link", "del", veth, check=False)
        sh("ip", "link", "add", veth, "mtu", str(self.mtu), "type", "veth", "peer", "name",
           "eth0", "mtu", str(self.mtu), "netns", netns)  # fmt: skip
        sh("ip", "link", "set", veth, "master", self.bridge, "up")
        sh("ip", "-n", netns, "addr", "add", f"{address}/{self.lan.prefixlen}", "dev", "eth0")
        sh("ip", "-n", netns, "link", "set", "eth0", "up")
        sh("ip", "-n", netns, "link", "set", "lo", "up")
        return OutsideHost(name, netns, address, veth)

    # -- nodes ----------------------------------------------------------------------------

    def _create_node(
        self,
        name: str | None = None,
        interfaces: Sequence[str] | None = None,
        node_name: str | None = None,
    ) -> Node:
        """Create a node's netns, LAN veth, addresses and default route and its (not started)
        agent (``--node-name`` = ``node_name`` or ``name``)."""
        if not self._lan_ready:
            raise ClusterError("the cluster's LAN does not exist: call prepare() or start()")
        index = self._next_index
        self._next_index += 1
        name = name or node_letter_name(index)
        if name in self.nodes and not self.nodes[name].removed:
            raise ClusterError(f"node {name!r} exists already")
        netns = f"{self.prefix}{name}"
        if interfaces is None:
            interfaces = (
                f"{self.lan.network_address + NODE_HOST_BASE + index}/{self.lan.prefixlen}",
            )
        veth = f"cl{self.slot}n{index}"
        create_netns(netns)
        sh("ip", "link", "del", veth, check=False)
        sh(
            "ip",
            "link",
            "add",
            veth,
            "mtu",
            str(self.mtu),
            "type",
            "veth",
            "peer",
            "name",
            "eth0",
            "mtu",
            str(self.mtu),
            "netns",
            netns,
        )
        sh("ip", "link", "set", veth, "master", self.bridge, "up")
        for iface in interfaces:
            sh("ip", "-n", netns, "addr", "add", iface, "dev", "eth0")
        sh("ip", "-n", netns, "link", "set", "eth0", "up")
        if any(ipaddress.IPv4Interface(i).network == self.lan for i in interfaces):
            sh("ip", "-n", netns, "route", "add", "default", "via", self.bridge_address)
        agent = self.stack.add_agent(node_name=node_name or name, netns=netns)
        agent.host_device = "cilia_host"  # the default name: each node has a netns of its own
        agent.hubble_address = f":{HUBBLE_PORT}"
        agent.metrics_address = f":{METRICS_PORT}"
        agent.extra_args = tuple(self.agent_args())
        node = Node(name, index, netns, tuple(interfaces), veth, agent)
        self.nodes[name] = node
        return node

    def add_node(
        self,
        name: str | None = None,
        *,
        interfaces: Sequence[str] | None = None,
        node_name: str | None = None,
        start: bool = True,
        extra_args: Sequence[str] = (),
    ) -> Node:
        """Create one more node (netns, LAN veth, agent) and start its agent (wait until ready).

        Args:
            name: node name (default ``node-<letter of its index>``).
            interfaces: ``a.b.c.d/len`` addresses of its LAN interface, the first being the
                node's address (default: the next LAN address). A default route via the
                bridge is added when one of them is on the LAN.
            node_name: the agent's ``--node-name`` (default ``name``; another node's name makes
                two nodes claim one name).
            start: start the agent (else call ``node.agent.start()``).
            extra_args: more agent flags (after the cluster's).

        Raises:
            ClusterError: the name is taken.
            StackError: the agent did not get ready.
        """
        node = self._create_node(name, interfaces, node_name)
        node.agent.extra_args = (*node.agent.extra_args, *extra_args)
        if start:
            node.agent.start()
        return node

    def drop_node(self, name: str) -> Node:
        """Take node ``name`` off the LAN without telling the operator (a node that died):
        its pods' netns deleted, its agent stopped, its pins, netns and LAN veth removed.

        Raises:
            ClusterError: no such node.
        """
        node = self.node(name)
        for pod in [p for p in self.pods if self.pod_node.get(p.name) == name]:
            pod.destroy_netns()
            self.pods.remove(pod)
            self.pod_node.pop(pod.name, None)
        node.agent.stop()
        node.agent.remove_leftovers()
        delete_netns(node.netns)
        node.removed = True
        del self.nodes[name]
        return node

    def remove_node(self, name: str) -> subprocess.CompletedProcess[str]:
        """Take node ``name`` out as an operator would: :meth:`drop_node`, then its node record
        deleted through the operator (``cilia-operator delete ciliumnodes NAME``). Returns the
        delete command's outcome.

        Raises:
            ClusterError: no such node, or the operator refused the delete.
        """
        node_name = self.node(name).agent.node_name
        self.drop_node(name)
        out = self.stack.operator_cli("delete", "ciliumnodes", node_name, timeout=COMMAND_SECONDS)
        if out.returncode != 0:
            raise ClusterError(
                f"cilia-operator delete ciliumnodes {node_name} exited {out.returncode}: "
                f"{out.stderr.strip()}"
            )
        return out

    def kill_agent(self, name: str) -> int:
        """SIGKILL node ``name``'s agent and wait until it is gone; returns its pid."""
        return self.node(name).agent.kill()

    def restart_agent(self, name: str, timeout: float | None = None) -> None:
        """Start node ``name``'s agent again (after :meth:`kill_agent` or a stop) with the
        same flags; wait until ready.

        Raises:
            StackError: it did not get ready.
        """
        agent = self.node(name).agent
        if agent.pid is not None:
            agent.stop()
        agent.start(timeout=timeout)

    # -- pods -----------------------------------------------------------------------------

    def add_pod(
        self,
        node: str,
        name: str,
        labels: Mapping[str, str] | None = None,
        namespace: str = "default",
    ) -> cni.Pod:
        """A pod on ``node`` in Kubernetes namespace ``namespace``: netns ``<prefix><name>``
        created on the host and plumbed by the real ``cilia-cni`` with the node's conflist
        (CNI ADD, checked).

        Raises:
            ClusterError: no such node.
            cilia_testkit.cni.CniRunError: ADD failed (the netns is deleted).
        """
        owner = self.node(node)
        pod = cni.Pod(name=f"{self.prefix}{name}", namespace=namespace, labels=dict(labels or {}))
        pod.create_netns()
        try:
            pod.add(owner.agent.conflist()).check()
        except BaseException:
            pod.destroy_netns()
            raise
        self.pods.append(pod)
        self.pod_node[pod.name] = node
        return pod

    def delete_pod(self, pod: cni.Pod) -> None:
        """CNI DEL (when its node's agent runs; errors ignored) and the netns deleted."""
        node = self.nodes.get(self.pod_node.get(pod.name, ""))
        if node is not None and node.agent.pid is not None and node.agent.conflist_path.exists():
            with contextlib.suppress(OSError, ValueError, subprocess.SubprocessError):
                pod.delete(node.agent.conflist(), timeout=COMMAND_SECONDS)
        pod.destroy_netns()
        if pod in self.pods:
            self.pods.remove(pod)
        self.pod_node.pop(pod.name, None)

    def delete_pods(self, pods: Iterable[cni.Pod] | None = None) -> None:
        """:meth:`delete_pod` for ``pods`` (default: every pod of the cluster)."""
        for pod in list(self.pods if pods is None else pods):
            self.delete_pod(pod)

    def node_of(self, pod: cni.Pod) -> Node:
        """The node ``pod`` was created on.

        Raises:
            ClusterError: the pod is not one of this cluster's (or its node is gone).
        """
        return self.node(self.pod_node.get(pod.name, ""))

    # -- observation ----------------------------------------------------------------------

    def pod_cidrs(self) -> dict[str, list[str]]:
        """Node name → the pod CIDRs the operator gave it (``cilia-operator get ciliumnodes``).

        Raises:
            ClusterError: the operator did not answer.
        """
        out = self.stack.operator_cli("get", "ciliumnodes", "-o", "json", timeout=COMMAND_SECONDS)
        if out.returncode != 0:
            raise ClusterError(f"cilia-operator get ciliumnodes: {out.stderr.strip()}")
        data: Any = json.loads(out.stdout or "[]")
        items = data.get("items", []) if isinstance(data, dict) else data
        result: dict[str, list[str]] = {}
        for item in items:
            result[str(item["metadata"]["name"])] = _node_cidrs(item)
        return result

    def wait_for(self, predicate: Any, timeout: float, interval: float = 0.1) -> bool:
        """:func:`cilia_testkit.host.wait_for` (for symmetry in tests)."""
        return wait_for(predicate, timeout, interval=interval)

    def logs(self, lines: int = 20) -> str:
        """Every component's log tail (this start), for assertion messages."""
        return self.stack.logs(lines)

    def describe(self) -> str:
        """How to reach everything: one line per component and node."""
        out = [
            f"cluster: {len(self.nodes)} nodes, routing {self.routing}, LAN {self.lan} "
            f"(bridge {self.bridge}), pod pool {self.pool_cidr}, run dir {self.stack.run_dir}",
            f"operator: {self.operator_address} (cilia-operator get ciliumnodes --server "
            f"{self.operator_address})",
        ]
        if self.with_relay:
            out.append(
                f"relay: {self.relay_address} (cilia-relay observe --server {self.relay_address})"
            )
        for node in self.nodes.values():
            a = node.agent
            out.append(
                f"{node.name}: {node.address}, netns {node.netns} (ip netns exec {node.netns} …), "
                f"socket {a.socket} (cilia-agent status --socket {a.socket}), Hubble "
                f"{node.address}:{HUBBLE_PORT}, metrics {node.address}:{METRICS_PORT}, "
                f"conflist {a.conflist_path}, log {a.process.log}"
            )
        return "\n".join(out)


def _node_cidrs(item: Mapping[str, Any]) -> list[str]:
    """Every pod CIDR of one CiliumNode object (multi-pool ``spec.ipam.pools.allocated`` and
    ``spec.ipam.podCIDRs``)."""
    spec = item.get("spec", {})
    ipam = spec.get("ipam", {})
    cidrs = [str(c) for c in ipam.get("podCIDRs", []) or []]
    for allocated in (ipam.get("pools", {}) or {}).get("allocated", []) or []:
        cidrs.extend(str(c) for c in allocated.get("cidrs", []) or [])
    return sorted(set(cidrs))


__all__ = [
    "BRIDGE_HOST",
    "COMMAND_SECONDS",
    "DEFAULT_MTU",
    "HUBBLE_PORT",
    "LAN_RANGE",
    "METRICS_PORT",
    "NODE_HOST_BASE",
    "OUTSIDE_HOST",
    "ROUTING_MODES",
    "RTPROT_CILIA",
    "Cluster",
    "ClusterError",
    "Node",
    "OutsideHost",
    "RoutingMode",
    "lan_network",
    "netns_prefix",
    "node_letter_name",
]
