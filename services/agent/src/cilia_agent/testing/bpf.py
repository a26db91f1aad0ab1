"""The BPF test harness: load bpf_lxc.o (``make bpf``) through the agent's loader and run crafted
packets through BPF_PROG_TEST_RUN.

Map keys and values come from the agent's own ``cilia_agent.datapath.layout``
and ring-buffer events are decoded by the agent's ``cilia_agent.hubble.events``
(what runs in production), so a mismatch with ``bpf/lib/common.h`` shows up
here as wrong verdicts or a decode error. The independent mirror of
``struct flow_event`` checked against ``common.h`` lives in the Hubble unit tests. Packets are built with the stdlib (Ethernet +
IPv4 + TCP/UDP/ICMP), checksums are not verified by the program.

``BPF_PROG_TEST_RUN`` is reached through Debian's ``libbpf.so.1``
(``bpf_prog_test_run_opts``; kernel Documentation/bpf/bpf_prog_run.rst).
"""

from __future__ import annotations

import ctypes
import pathlib
import socket
import struct
import uuid
from dataclasses import dataclass
from typing import Any

from cilia_agent.datapath.layout import (  # noqa: F401  (re-exported for the tests)
    DIR_EGRESS,
    DIR_INGRESS,
    IDENTITY_WORLD,
    TRACE_FROM_LXC,
    TRACE_TO_LXC,
    TRACE_TO_STACK,
    EndpointInfo,
    IpcacheKey,
    IpcacheValue,
    PolicyKey,
    PolicyValue,
    ip_from_map,
    ip_to_map,
    policy_key,
    port_to_map,
)
from cilia_agent.datapath.libbpf import libbpf
from cilia_agent.datapath.loader import Datapath as AgentDatapath
from cilia_agent.datapath.loader import DatapathConfig, remove_pins
from cilia_agent.datapath.objects import RingBuffer, default_bpf_dir
from cilia_agent.hubble.events import FlowEvent, decode

#: The compiled objects (the checkout's ``build/bpf``, or ``$CILIA_BPF_DIR``), as the agent
#: finds them.
BPF_DIR = default_bpf_dir()
TC_ACT_OK = 0
TC_ACT_SHOT = 2


class _TestRunOpts(ctypes.Structure):
    """struct bpf_test_run_opts of libbpf 1.x."""

    _fields_ = [
        ("sz", ctypes.c_size_t),
        ("data_in", ctypes.c_void_p),
        ("data_out", ctypes.c_void_p),
        ("data_size_in", ctypes.c_uint32),
        ("data_size_out", ctypes.c_uint32),
        ("ctx_in", ctypes.c_void_p),
        ("ctx_out", ctypes.c_void_p),
        ("ctx_size_in", ctypes.c_uint32),
        ("ctx_size_out", ctypes.c_uint32),
        ("retval", ctypes.c_uint32),
        ("repeat", ctypes.c_int),
        ("duration", ctypes.c_uint32),
        ("flags", ctypes.c_uint32),
        ("cpu", ctypes.c_uint32),
        ("batch_size", ctypes.c_uint32),
    ]


TCP_SYN, TCP_ACK = 0x02, 0x10


def packet(
    src: str,
    dst: str,
    proto: str = "tcp",
    sport: int = 40000,
    dport: int = 8080,
    flags: int = TCP_SYN,
    icmp_type: int = 8,
    icmp_id: int = 7,
) -> bytes:
    """An Ethernet/IPv4 frame carrying a TCP, UDP, SCTP (common header, checksum 0) or
    ICMP header (payload 16 bytes); ``proto``: ``tcp``, ``udp``, ``sctp`` or ``icmp``."""
    payload = b"\x00" * 16
    if proto == "tcp":
        l4 = struct.pack("!HHIIBBHHH", sport, dport, 1, 0, 5 << 4, flags, 65535, 0, 0)
        number = 6
    elif proto == "udp":
        l4 = struct.pack("!HHHH", sport, dport, 8 + len(payload), 0)
        number = 17
    elif proto == "sctp":
        l4 = struct.pack("!HHII", sport, dport, 1, 0)
        number = 132
    else:
        l4 = struct.pack("!BBHHH", icmp_type, 0, 0, icmp_id, 1)
        number = 1
    total = 20 + len(l4) + len(payload)
    ip = struct.pack(
        "!BBHHHBBH4s4s",
        0x45,
        0,
        total,
        1,
        0,
        64,
        number,
        0,
        socket.inet_aton(src),
        socket.inet_aton(dst),
    )
    eth = b"\x02\x00\x00\x00\x00\x02" + b"\x02\x00\x00\x00\x00\x01" + b"\x08\x00"
    return eth + ip + l4 + payload


@dataclass
class Datapath:
    """The loaded programs (``agent``: the agent's own :class:`AgentDatapath`, whose typed
    maps the tests read and write), and the events they emitted (read from ``ring``, then
    ``rescue``: the ring taking what the main one refused)."""

    agent: AgentDatapath
    pin_dir: pathlib.Path
    progs: dict[str, int]
    events: list[FlowEvent]
    ring: RingBuffer
    rescue: RingBuffer

    def run(self, prog: str, frame: bytes, repeat: int = 1, *, consume: bool = True) -> int:
        """Run one frame through ``prog`` (``repeat`` times), then (``consume``) read both ring
        buffers whether or not the programs woke the reader; returns the tc verdict
        (TC_ACT_*)."""
        buf = ctypes.create_string_buffer(frame, len(frame))
        opts = _TestRunOpts(
            sz=ctypes.sizeof(_TestRunOpts),
            data_in=ctypes.cast(buf, ctypes.c_void_p),
            data_size_in=len(frame),
            repeat=repeat,
        )
        rc = _test_run(self.progs[prog], ctypes.byref(opts))
        if rc != 0:
            raise OSError(ctypes.get_errno(), f"BPF_PROG_TEST_RUN failed for {prog}")
        if consume:
            self.ring.consume()
            self.rescue.consume()
        return int(opts.retval)


def endpoint(
    dp: Datapath,
    ep_id: int,
    identity: int,
    ip: str,
    *,
    ifindex: int = 1,
    ingress: bool = False,
    egress: bool = False,
    audit: bool = False,
) -> None:
    """Program a local endpoint as the agent does: behind host veth ``ifindex`` (under
    BPF_PROG_TEST_RUN the packet's ifindex is 1), with policy enforced on ``ingress`` /
    ``egress``, in audit mode when ``audit`` (``--policy-audit-mode``), and its address in
    the ipcache."""
    dp.agent.set_endpoint(
        ifindex,
        EndpointInfo(
            ep_id=ep_id,
            sec_identity=identity,
            ipv4=ip_to_map(ip),
            enforce_ingress=int(ingress),
            enforce_egress=int(egress),
            policy_audit=int(audit),
        ),
    )
    dp.agent.ipcache_map[IpcacheKey(32, ip_to_map(ip))] = IpcacheValue(identity, 0)


def rule(
    dp: Datapath,
    ep_id: int,
    peer: int,
    direction: int,
    proto: int = 0,
    port: int = 0,
    *,
    deny: bool = False,
) -> None:
    """A policy entry of endpoint ``ep_id`` for identity ``peer`` (0: any) in ``direction``
    (DIR_INGRESS / DIR_EGRESS), ``proto`` and ``port`` (0: any), allowing or denying."""
    dp.agent.policy_map[policy_key(ep_id, peer, direction, proto, port)] = PolicyValue(
        flags=1 if deny else 0
    )


def _test_run(prog_fd: int, opts: Any) -> int:
    fn = libbpf().bpf_prog_test_run_opts
    fn.argtypes = [ctypes.c_int, ctypes.c_void_p]
    fn.restype = ctypes.c_int
    return int(fn(prog_fd, opts))


def load(pin_root: pathlib.Path = pathlib.Path("/sys/fs/bpf"), **options: Any) -> Datapath:
    """Load bpf_lxc.o through the agent's loader (the production configuration path), with
    maps pinned under a fresh directory of bpffs and small map sizes; ``options`` are further
    :class:`DatapathConfig` fields (e.g. ``monitor_aggregation=0``)."""
    pin_dir = pin_root / f"cilia-test-{uuid.uuid4().hex[:8]}"
    config = DatapathConfig(
        bpf_dir=BPF_DIR, pin_dir=pin_dir, ipcache_max=1024, ct_max=1024, **options
    )
    try:
        loaded = AgentDatapath.load(config)
    except Exception:
        remove_pins(pin_dir)
        raise
    progs = {name: loaded.prog_fd(name) for name in ("cil_from_container", "cil_to_container")}
    events: list[FlowEvent] = []
    ring = loaded.ring_buffer(lambda record: events.append(decode(record)))
    rescue = loaded.ring_buffer(lambda record: events.append(decode(record)), rescue=True)
    return Datapath(
        agent=loaded, pin_dir=pin_dir, progs=progs, events=events, ring=ring, rescue=rescue
    )


def unload(dp: Datapath) -> None:
    """Close the ring buffer and the object, and remove the pins."""
    dp.ring.close()
    dp.rescue.close()
    dp.agent.close()
    remove_pins(dp.pin_dir)
