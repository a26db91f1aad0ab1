"""``cilia-agent init handle-vxlan-offload``: UDP-tunnel segmentation offload off on NICs that
corrupt VXLAN traffic with it (VXLAN mode only, as the Deckhouse module's init container).

What the module's init step does (restated): on the interface holding the node's IP (env
``NODE_IP``, the pod's ``status.podIP``, which is the host's with ``hostNetwork``), and only
when that interface's driver is ``vmxnet3`` (VMware's paravirtual NIC, whose UDP-tunnel
segmentation offload breaks VXLAN-encapsulated TCP), it turns off the ethtool features
``tx-udp_tnl-segmentation`` and ``tx-udp_tnl-csum-segmentation`` (``ethtool -K``).

Here: the driver comes from the ``ETHTOOL_GDRVINFO`` ioctl (what ``ethtool -i`` prints; it
also names virtual drivers such as ``veth``), the features are changed with pyroute2's
ethtool (the ``ETHTOOL_SFEATURES`` ioctl of ``ethtool -K``), so no ethtool binary is
needed. The drivers are a flag (``--drivers``, default ``vmxnet3``). An interface whose driver
is not listed is left alone and said so; a feature the NIC does not have is skipped.
"""

from __future__ import annotations

import array
import fcntl
import ipaddress
import socket
import struct

from pyroute2 import IPRoute
from pyroute2.ethtool import Ethtool

FEATURES = ("tx-udp_tnl-segmentation", "tx-udp_tnl-csum-segmentation")
"""The ethtool features the module turns off."""
DEFAULT_DRIVERS = ("vmxnet3",)

_SIOCETHTOOL = 0x8946
_ETHTOOL_GDRVINFO = 0x00000003
_DRVINFO_SIZE = 196  # struct ethtool_drvinfo: cmd, driver[32], version[32], fw[32], bus[32], ...


class OffloadError(RuntimeError):
    """The interface or its driver cannot be found, or the kernel refused the change."""


def interface_of(address: str) -> str:
    """The interface holding IPv4 ``address``.

    Raises:
        OffloadError: not an IPv4 address, or no interface holds it.
    """
    try:
        wanted = str(ipaddress.IPv4Address(address))
    except ValueError:
        raise OffloadError(f"--node-ip {address!r} is not an IPv4 address") from None
    with IPRoute() as ipr:
        for msg in ipr.addr("dump", family=socket.AF_INET):
            if (msg.get("IFA_LOCAL") or msg.get("IFA_ADDRESS")) == wanted:
                return socket.if_indextoname(msg["index"])
    raise OffloadError(f"no interface holds the node IP {wanted}")


def driver_of(ifname: str) -> str:
    """The driver name of ``ifname`` (``ethtool -i``), e.g. ``vmxnet3``, ``veth``.

    Raises:
        OffloadError: the ioctl failed (no such interface, no ethtool support).
    """
    buf = array.array("B", struct.pack("I", _ETHTOOL_GDRVINFO) + bytes(_DRVINFO_SIZE - 4))
    ifreq = struct.pack("16sP", ifname.encode(), buf.buffer_info()[0]).ljust(40, b"\0")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            fcntl.ioctl(sock.fileno(), _SIOCETHTOOL, ifreq)
        except OSError as exc:
            raise OffloadError(f"{ifname}: cannot read its driver: {exc.strerror}") from exc
    return bytes(buf[4:36]).split(b"\0", 1)[0].decode(errors="replace")


def handle(node_ip: str, drivers: tuple[str, ...] = DEFAULT_DRIVERS) -> list[str]:
    """Turn :data:`FEATURES` off on the interface of ``node_ip`` when its driver is one of
    ``drivers``; the result lines.

    Raises:
        OffloadError: as :func:`interface_of` / :func:`driver_of`, or the change was refused.
    """
    ifname = interface_of(node_ip)
    driver = driver_of(ifname)
    if driver not in drivers:
        return [f"{ifname} (driver {driver}): not one of {', '.join(drivers)}; left alone"]
    tool = Ethtool()
    try:
        current = tool.get_features(ifname)
        changed = []
        for name in FEATURES:
            feature = current.features.get(name)
            if feature is None or not feature.available or not feature.enable:
                continue
            feature.enable = False
            changed.append(name)
        if changed:
            tool.set_features(ifname, current)
    except OSError as exc:
        raise OffloadError(f"{ifname}: cannot change its offload features: {exc}") from exc
    finally:
        tool.close()
    if not changed:
        return [f"{ifname} (driver {driver}): {', '.join(FEATURES)} already off or absent"]
    return [f"{ifname} (driver {driver}): turned off {', '.join(changed)}"]
