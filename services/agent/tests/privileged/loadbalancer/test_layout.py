"""``loadbalancer.layout``'s ctypes mirrors agree with the BTF of the compiled ``bpf_sock.c``
maps (field names, offsets, sizes), read back from the pins with bpftool."""

from __future__ import annotations

import pytest

from cilia_agent.datapath.btf import btf_of_map, ctypes_layout, layout_diff
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
