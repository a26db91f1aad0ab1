"""The ip-masq-agent configuration: destinations that are never masqueraded.

Upstream Cilium's ``--enable-ip-masq-agent`` reads the file ``--ip-masq-agent-config-path``
(default ``/etc/config/ip-masq-agent``, the ``config`` key of the ``ip-masq-agent``
ConfigMap mounted there), YAML or JSON::

    nonMasqueradeCIDRs:
    - 10.0.0.0/8
    masqLinkLocal: false

Rules kept from upstream:

- the file absent, or ``nonMasqueradeCIDRs`` empty or missing: the default list
  :data:`DEFAULT_NON_MASQ_CIDRS` (the private and reserved IPv4 ranges);
- ``masqLinkLocal`` false (the default): ``169.254.0.0/16`` is not masqueraded either;
- the file is re-read while the agent runs (here every ``--iptables-reconcile-interval``).

Upstream applies this list in its BPF masquerade only; Cilia's iptables mode applies it as
``RETURN`` rules of ``CILIA_POST_nat`` (masquerade/rules.py).
"""

from __future__ import annotations

import ipaddress
import pathlib
from dataclasses import dataclass

import yaml

#: upstream ip-masq-agent's default nonMasqueradeCIDRs (used when the file gives none)
DEFAULT_NON_MASQ_CIDRS: tuple[str, ...] = (
    "10.0.0.0/8",
    "172.16.0.0/12",
    "192.168.0.0/16",
    "100.64.0.0/10",
    "192.0.0.0/24",
    "192.0.2.0/24",
    "192.88.99.0/24",
    "198.18.0.0/15",
    "198.51.100.0/24",
    "203.0.113.0/24",
    "240.0.0.0/4",
)
LINK_LOCAL = "169.254.0.0/16"


class IPMasqConfigError(ValueError):
    """The file exists but is not a valid ip-masq-agent configuration (message says why)."""


@dataclass(frozen=True)
class IPMasqConfig:
    """The destinations ip-masq-agent keeps unmasqueraded.

    Attributes:
        non_masquerade_cidrs: IPv4 CIDRs as written (normalised), the defaults when none.
        masq_link_local: ``masqLinkLocal``.
        source: where they came from ("defaults: <path> absent", or the path).
    """

    non_masquerade_cidrs: tuple[str, ...]
    masq_link_local: bool
    source: str

    def exclusions(self) -> tuple[str, ...]:
        """The CIDRs the masquerade chain must skip (link-local added unless masqLinkLocal)."""
        extra = () if self.masq_link_local else (LINK_LOCAL,)
        return (*self.non_masquerade_cidrs, *extra)


def load(path: pathlib.Path) -> IPMasqConfig:
    """Read ``path`` (YAML or JSON, upstream's keys).

    Raises:
        IPMasqConfigError: unreadable, not a mapping, an unknown key, a CIDR that is not
            IPv4 (IPv6 entries are skipped: the agent masquerades IPv4 only), or
            ``masqLinkLocal`` not a boolean.
    """
    try:
        text = path.read_text()
    except FileNotFoundError:
        return IPMasqConfig(DEFAULT_NON_MASQ_CIDRS, False, f"defaults: {path} absent")
    except OSError as exc:
        raise IPMasqConfigError(f"{path}: {exc}") from exc
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise IPMasqConfigError(f"{path}: not YAML/JSON: {exc}") from exc
    if doc is None:
        doc = {}
    if not isinstance(doc, dict):
        raise IPMasqConfigError(f"{path}: expected a mapping, got {type(doc).__name__}")
    unknown = set(doc) - {"nonMasqueradeCIDRs", "masqLinkLocal", "masqLinkLocalIPv6"}
    if unknown:
        raise IPMasqConfigError(f"{path}: unknown keys {sorted(unknown)}")
    link_local = doc.get("masqLinkLocal", False)
    if not isinstance(link_local, bool):
        raise IPMasqConfigError(f"{path}: masqLinkLocal must be true or false, got {link_local!r}")
    raw = doc.get("nonMasqueradeCIDRs") or []
    if not isinstance(raw, list):
        raise IPMasqConfigError(f"{path}: nonMasqueradeCIDRs must be a list of CIDRs")
    cidrs: list[str] = []
    for item in raw:
        try:
            net = ipaddress.ip_network(str(item).strip(), strict=False)
        except ValueError as exc:
            raise IPMasqConfigError(f"{path}: nonMasqueradeCIDRs: {item!r}: {exc}") from None
        if net.version == 4:
            cidrs.append(str(net))
    if not raw:
        return IPMasqConfig(DEFAULT_NON_MASQ_CIDRS, link_local, f"defaults: {path} lists none")
    return IPMasqConfig(tuple(cidrs), link_local, str(path))
