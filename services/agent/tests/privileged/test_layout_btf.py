"""``datapath.layout``'s ctypes mirrors agree with the compiled datapath's BTF.

The real ``build/bpf/bpf_lxc.o`` (``make bpf``) is loaded by the agent's loader (libbpf, into
a pin dir of its own); each map the agent reads or writes is read back with bpftool, and its
key and value types (the compiler's field names, byte offsets and sizes) must equal the
mirror's. ``struct flow_event`` and ``struct lxc_config`` (``CONFIG``) are no map's key or
value: ``lxc_config`` is found by name in the same loaded BTF object, ``flow_event`` (a local
variable only, which clang keeps no BTF for) in a probe compiled from ``lib/common.h`` with
the flags of ``make bpf``, and both are compared the same way;
hubble's decoder must read a mirrored record back field by field. Needs root, bpffs and
bpftool.
"""

from __future__ import annotations

import ctypes
import json
import os
import pathlib
import shutil
import socket
import subprocess
import uuid
from collections.abc import Iterator

import pytest

from cilia_agent.datapath import layout
from cilia_agent.datapath.bpffs import ensure_bpffs
from cilia_agent.datapath.btf import Btf, btf_of_map, ctypes_layout, layout_diff
from cilia_agent.datapath.loader import Datapath, DatapathConfig, remove_pins
from cilia_agent.datapath.objects import default_bpf_dir
from cilia_agent.hubble import events
from cilia_testkit import skips

pytestmark = pytest.mark.privileged

BPF_CC = "clang-14"  # as the Makefile's BPF_CC
PROBED = ("flow_event",)  # common.h structs no global of bpf_lxc.c has (others: object_btf)


def _skip_reason() -> str | None:
    if os.geteuid() != 0:
        return "needs root to load BPF programs and read their BTF"
    if shutil.which("bpftool") is None:
        return "needs bpftool (Debian bpftool) to dump BTF"
    return None


@pytest.fixture(scope="module")
def datapath() -> Iterator[Datapath]:
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    pin_dir = pathlib.Path(f"/sys/fs/bpf/cilia-test-btf-{uuid.uuid4().hex[:8]}")
    ensure_bpffs(pin_dir)
    config = DatapathConfig(
        bpf_dir=default_bpf_dir(), pin_dir=pin_dir, ipcache_max=64, ct_max=64, endpoints_max=64
    )
    dp = Datapath.load(config)
    try:
        yield dp
    finally:
        dp.close()
        remove_pins(pin_dir)
        if pin_dir.exists():
            pin_dir.rmdir()


@pytest.fixture(scope="module")
def object_btf(datapath: Datapath) -> Btf:
    """The loaded object's BTF (all of ``bpf_lxc.o``'s types, through one of its maps)."""
    return btf_of_map(pinned=datapath.config.pin_dir / "cilia_policy")


@pytest.fixture(scope="module")
def probe_btf(tmp_path_factory: pytest.TempPathFactory) -> Btf:
    """BTF of ``bpf/lib/common.h``'s structs that only live in local variables (clang keeps
    no BTF for those): one global per struct, compiled with the flags of ``make bpf``."""
    skips.require_binary(BPF_CC, BPF_CC)
    out = tmp_path_factory.mktemp("btf")
    source = out / "probe.c"
    source.write_text(
        '#include "lib/common.h"\n'
        + "".join(f"struct {name} probe_{name};\n" for name in PROBED)
        + 'char _license[] SEC("license") = "GPL";\n'
    )
    bpf_src = pathlib.Path(__file__).resolve().parents[4] / "bpf"
    subprocess.run(
        [BPF_CC, "-O2", "-g", "-target", "bpf", "-I", str(bpf_src),
         f"-I/usr/include/{os.uname().machine}-linux-gnu", "-c", str(source),
         "-o", str(out / "probe.o")],
        check=True, capture_output=True,
    )  # fmt: skip
    dump = subprocess.run(
        ["bpftool", "-j", "btf", "dump", "file", str(out / "probe.o")],
        check=True, capture_output=True, text=True,
    )  # fmt: skip
    return Btf(json.loads(dump.stdout))


@pytest.mark.parametrize("map_name", sorted(layout.MAP_LAYOUTS))
def test_map_key_and_value_mirrors_match_the_compiled_types(
    datapath: Datapath, map_name: str
) -> None:
    btf = btf_of_map(pinned=datapath.config.pin_dir / map_name)
    key, value = btf.map_key_value(map_name)
    key_mirror, value_mirror = layout.MAP_LAYOUTS[map_name]
    assert key.size > 0 and value.size > 0
    assert layout_diff(key, ctypes_layout(key_mirror)) == []
    assert layout_diff(value, ctypes_layout(value_mirror)) == []


@pytest.mark.parametrize("struct_name", sorted(layout.STRUCT_LAYOUTS))
def test_struct_mirrors_match_the_compiled_types(
    request: pytest.FixtureRequest, struct_name: str
) -> None:
    btf: Btf = request.getfixturevalue("probe_btf" if struct_name in PROBED else "object_btf")
    compiled = btf.layout(btf.find(struct_name))
    assert compiled.fields, compiled
    assert layout_diff(compiled, ctypes_layout(layout.STRUCT_LAYOUTS[struct_name])) == []


def test_hubble_decodes_a_mirrored_flow_event_field_by_field() -> None:
    record = layout.FlowEvent(
        ts_ns=123456789012,
        saddr=layout.ip_to_map("10.0.0.1"),
        daddr=layout.ip_to_map("10.0.0.2"),
        sport=socket.htons(40000),
        dport=socket.htons(80),
        proto=6,
        event_type=1,
        verdict=2,
        drop_reason=133,
        src_identity=256,
        dst_identity=70000,
        ep_id=7,
        ifindex=12,
        len=1500,
        dir=1,
        is_reply=1,
        tcp_flags=0x12,
    )
    assert ctypes.sizeof(record) == events.FLOW_EVENT_SIZE
    decoded = events.decode(bytes(record))
    assert (decoded.ts_ns, decoded.saddr, decoded.daddr) == (123456789012, "10.0.0.1", "10.0.0.2")
    assert (decoded.sport, decoded.dport, decoded.proto) == (40000, 80, 6)
    assert (decoded.event_type, decoded.verdict, decoded.drop_reason) == (1, 2, 133)
    assert (decoded.src_identity, decoded.dst_identity) == (256, 70000)
    assert (decoded.ep_id, decoded.ifindex, decoded.length) == (7, 12, 1500)
    assert (decoded.direction, decoded.is_reply, decoded.tcp_flags) == (1, True, 0x12)


class _DriftedPolicyKey(ctypes.Structure):
    """A copy of ``layout.PolicyKey`` with ``dport`` widened to 32 bits (a drifted mirror)."""

    _fields_ = [
        ("prefixlen", ctypes.c_uint32),
        ("ep_id", ctypes.c_uint32),
        ("sec_label", ctypes.c_uint32),
        ("egress", ctypes.c_uint8),
        ("protocol", ctypes.c_uint8),
        ("dport", ctypes.c_uint32),
    ]


class _RenamedEndpointInfo(ctypes.Structure):
    """A copy of ``layout.EndpointInfo`` with one field renamed (same offsets and sizes)."""

    _fields_ = [
        ("ep_id", ctypes.c_uint32),
        ("identity", ctypes.c_uint32),
        ("ipv4", ctypes.c_uint32),
        ("enforce_ingress", ctypes.c_uint8),
        ("enforce_egress", ctypes.c_uint8),
        ("policy_audit", ctypes.c_uint8),
        ("pad", ctypes.c_uint8),
    ]


def test_a_drifted_mirror_is_reported(datapath: Datapath) -> None:
    policy_btf = btf_of_map(pinned=datapath.config.pin_dir / "cilia_policy")
    key, _ = policy_btf.map_key_value("cilia_policy")
    problems = layout_diff(key, ctypes_layout(_DriftedPolicyKey))
    assert "policy_key vs _DriftedPolicyKey: size 16 in BTF, 20 in the mirror" in problems
    assert (
        "policy_key.dport: offset 14 size 2 in BTF, offset 16 size 4 in _DriftedPolicyKey"
        in problems
    )

    endpoints_btf = btf_of_map(pinned=datapath.config.pin_dir / "cilia_endpoints")
    _, value = endpoints_btf.map_key_value("cilia_endpoints")
    problems = layout_diff(value, ctypes_layout(_RenamedEndpointInfo))
    assert problems == [
        "endpoint_info vs _RenamedEndpointInfo: sec_identity (offset 4) missing in the mirror",
        "endpoint_info vs _RenamedEndpointInfo: identity is in the mirror but not in BTF",
    ]
