"""``loadbalancer.layout``'s ctypes mirrors agree with the BTF of the compiled ``bpf_sock.c``
maps (field names, offsets, sizes), read back from the pins with bpftool, and with
``bpf_host.o``'s ``struct host_config`` (its ``CONFIG``)."""

from __future__ import annotations

import json
import subprocess

import pytest

from cilia_agent.datapath.btf import Btf, btf_of_map, ctypes_layout, layout_diff
from cilia_agent.datapath.objects import default_bpf_dir, object_path
from cilia_agent.loadbalancer import layout, socklb
from cilia_testkit import skips


@pytest.fixture
def pinned(sock_config: socklb.SockConfig) -> socklb.SockConfig:
    skips.require(skips.binary_missing("bpftool", "bpftool"))
    socklb.create_maps(sock_config)
    return sock_config


def test_every_map_is_mirrored() -> None:
    assert set(layout.MAP_LAYOUTS) == set(layout.MAPS)


@pytest.mark.parametrize("map_name", sorted(layout.MAP_LAYOUTS))
def test_lb_map_mirrors_match_the_compiled_types(pinned: socklb.SockConfig, map_name: str) -> None:
    btf = btf_of_map(pinned=pinned.pin_dir / map_name)
    key, value = btf.map_key_value(map_name)
    key_mirror, value_mirror = layout.MAP_LAYOUTS[map_name]
    assert key.size > 0 and value.size > 0
    assert layout_diff(key, ctypes_layout(key_mirror)) == []
    assert layout_diff(value, ctypes_layout(value_mirror)) == []


def test_host_program_config_mirror_matches_the_object() -> None:
    skips.require(skips.binary_missing("bpftool", "bpftool"))
    path = object_path(default_bpf_dir(), "bpf_host")
    dump = subprocess.run(["bpftool", "-j", "btf", "dump", "file", str(path)],
                          check=True, capture_output=True, text=True)  # fmt: skip
    btf = Btf(json.loads(dump.stdout))
    compiled = btf.layout(btf.find("host_config"))
    assert compiled.fields, compiled
    assert layout_diff(compiled, ctypes_layout(layout.HostProgramConfig)) == []
