"""The agent's masquerade flags (one group of ``cilia-agent serve``'s configuration): whether
pod traffic leaving the cluster is source-NATed to the node's address, in iptables or in eBPF,
and what is never masqueraded. :class:`cilia_agent.config.Config` inherits them, so every
field is still ``cfg.<name>`` and one ``serve`` flag (upstream names:
``--enable-ipv4-masquerade``, ``--enable-bpf-masquerade``, ``--ipv4-native-routing-cidr``,
``--egress-masquerade-interfaces``, ``--enable-ip-masq-agent``, ``--bpf-nat-port-range``...).
The rule that BPF masquerade needs the BPF NodePort programs spans groups and stays in
``Config``.
"""

from __future__ import annotations

import ipaddress
import pathlib
import re
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from cilia_common.flags import Flag, split_list

#: An interface name, or its prefix: what the kernel accepts (at most 15 characters).
IFNAME = re.compile(r"^[A-Za-z0-9_.\-]{1,15}$")


class MasqueradeConfig(BaseModel):
    """Validated masquerade flags (a base of the agent's ``Config``).

    Raises (on construction):
        pydantic.ValidationError: a field is out of range or malformed; the message names
            the field.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    enable_ipv4_masquerade: bool = Field(
        default=True,
        description="SNAT pod traffic leaving the cluster to this node's address on the egress device (upstream enable-ipv4-masquerade): from this node's pod CIDRs to anything outside every pod CIDR of the cluster, --ipv4-native-routing-cidr and the ip-masq-agent's nonMasqueradeCIDRs",
    )
    enable_bpf_masquerade: bool = Field(
        default=False,
        description="masquerade in eBPF instead of iptables (upstream enable-bpf-masquerade; the Deckhouse module turns it on): the tc programs of bpf/bpf_host.c on --devices SNAT pod traffic to the device's address and a NAT port (--bpf-nat-port-range), state in cilium_snat_v4_external; no CILIA_POST_nat chain. Needs --enable-ipv4-masquerade, --enable-bpf, --kube-proxy-replacement and --enable-node-port (as upstream: BPF masquerade needs the BPF NodePort programs)",
    )
    bpf_nat_port_range: Annotated[str, Flag(metavar="MIN-MAX")] = Field(
        default="32768-65535",
        description="source ports the BPF NAT (NodePort SNAT and BPF masquerade) chooses from, inclusive; a new flow tries up to 16 random ports of the range that no other flow to the same destination address:port holds, else its packet is dropped and counted (cilia_nat_port_exhausted_total). Upstream compiles the same range: NodePort's maximum + 1 .. 65535. The node's own sockets take ephemeral ports from net.ipv4.ip_local_port_range (32768-60999 by default), which overlaps: keep them apart where that matters",
    )
    bpf_masquerade_gc_interval: float = Field(
        default=30.0,
        ge=0,
        description="seconds between passes of the agent's GC of masqueraded flows in cilium_snat_v4_external (0 = none; the LRU map still evicts the least recently used entries when full)",
    )
    bpf_nat_masquerade_timeout: float = Field(
        default=600.0,
        gt=0,
        description="seconds a masqueraded flow may stay idle (no packet from the pod) before the GC removes both its entries and frees its NAT port (upstream's SNAT entries follow its conntrack timeouts; one idle timeout here, longer than the kernel's TCP keepalive probes need to refresh it: 600 s)",
    )
    ipv4_native_routing_cidr: Annotated[str, Flag(metavar="CIDR")] = Field(
        default="",
        description="CIDR reachable without masquerade, e.g. the cluster's whole pod network (upstream ipv4-native-routing-cidr); never masqueraded; empty = none (every pod CIDR of the cluster is excluded anyway, from the node stream)",
    )
    egress_masquerade_interfaces: Annotated[list[str], Flag(metavar="IFNAME")] = Field(
        default_factory=list,
        description="devices pod traffic is masqueraded on (upstream egress-masquerade-interfaces); repeat or comma-separate; a trailing + matches a prefix (eth+); none = the devices of the IPv4 default routes, else the device carrying the node's first address",
    )
    enable_ip_masq_agent: bool = Field(
        default=False,
        description="also exclude the nonMasqueradeCIDRs of --ip-masq-agent-config-path from masquerade (upstream enable-ip-masq-agent; there BPF-only); file absent or list empty: upstream's default list (RFC 1918, 100.64.0.0/10, 198.18.0.0/15 …); 169.254.0.0/16 unless masqLinkLocal",
    )
    ip_masq_agent_config_path: pathlib.Path = Field(
        default=pathlib.Path("/etc/config/ip-masq-agent"),
        description="YAML or JSON file of the ip-masq-agent ConfigMap (nonMasqueradeCIDRs: [CIDR...], masqLinkLocal: bool) (upstream ip-masq-agent-config-path); re-read every --iptables-reconcile-interval",
    )
    only_masquerade_default_pool: bool = Field(
        default=False,
        description="masquerade only pods of the default pool (--ipam-default-ip-pool); pods of other multi-pool pools keep their address (upstream only-masquerade-default-pool)",
    )

    @field_validator("egress_masquerade_interfaces", mode="before")
    @classmethod
    def _masq_devices(cls, value: Any) -> Any:
        names = split_list([value] if isinstance(value, str) else value)
        if isinstance(names, list):
            for name in names:
                base = name[:-1] if isinstance(name, str) and name.endswith("+") else name
                if not isinstance(base, str) or not IFNAME.match(base):
                    raise ValueError(
                        f"--egress-masquerade-interfaces: {name!r} is not an interface name "
                        "(or a prefix ending in +)"
                    )
        return names

    @field_validator("ipv4_native_routing_cidr")
    @classmethod
    def _native_cidr(cls, value: str) -> str:
        if not value:
            return value
        try:
            return str(ipaddress.IPv4Network(value.strip(), strict=True))
        except ValueError as exc:
            raise ValueError(
                f"--ipv4-native-routing-cidr: {value!r} is not an IPv4 CIDR ({exc})"
            ) from None

    @field_validator("bpf_nat_port_range")
    @classmethod
    def _nat_port_range(cls, value: str) -> str:
        lo, sep, hi = value.strip().partition("-")
        try:
            first, last = int(lo), int(hi)
        except ValueError:
            first = last = -1
        if not sep or not 1024 <= first <= last <= 65535 or last - first < 255:
            raise ValueError(
                f"--bpf-nat-port-range: {value!r} is not MIN-MAX with 1024 <= MIN <= MAX <= "
                "65535 and at least 256 ports"
            )
        return f"{first}-{last}"

    @property
    def nat_port_range(self) -> tuple[int, int]:
        """``--bpf-nat-port-range`` as (first, last), inclusive."""
        lo, _, hi = self.bpf_nat_port_range.partition("-")
        return int(lo), int(hi)

    @property
    def bpf_masquerade_enabled(self) -> bool:
        """Masquerade in eBPF: ``--enable-ipv4-masquerade`` and ``--enable-bpf-masquerade``."""
        return self.enable_ipv4_masquerade and self.enable_bpf_masquerade
