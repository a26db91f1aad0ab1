"""datapath.objects: libbpf loads bpf_lxc.o with its CONFIG and map sizes, pins its maps, and
a second load reuses the pins (an agent restart keeps the maps' contents)."""

from __future__ import annotations

import ctypes
import pathlib
import uuid
from collections.abc import Iterator

import pytest

from cilia_agent.datapath.layout import EndpointInfo, LxcConfig
from cilia_agent.datapath.objects import BpfObject, BpfUnavailable, default_bpf_dir, object_path
from cilia_testkit import skips

pytestmark = pytest.mark.privileged

PINNED = {
    "cilia_ipcache",
    "cilia_endpoints",
    "cilia_policy",
    "cilia_ct",
    "cilia_metrics",
    "cilia_lxc",
}


@pytest.fixture
def pin_dir() -> Iterator[pathlib.Path]:
    skips.require_bpf("libbpf object load")
    path = pathlib.Path(f"/sys/fs/bpf/cilia-test-{uuid.uuid4().hex[:8]}")
    yield path
    if path.exists():
        for pinned in path.iterdir():
            pinned.unlink()
        path.rmdir()


def test_load_configures_pins_and_reuses(pin_dir: pathlib.Path) -> None:
    path = object_path(default_bpf_dir(), "bpf_lxc")
    config = LxcConfig(monitor_aggregation=0, events_wakeup_events=4)
    sizes = {"cilia_ipcache": 64, "cilia_endpoints": 32, "cilia_ct": 128}
    with BpfObject.load(path, pin_dir=pin_dir, config=config, max_entries=sizes) as first:
        assert {p.name for p in pin_dir.iterdir()} == PINNED
        assert first.max_entries("cilia_ipcache") == 64
        assert first.max_entries("cilia_policy") == 16384  # the C default
        assert first.prog_fd("cil_from_container") >= 0
        with pytest.raises(KeyError):
            first.prog_fd("nope")
        # CONFIG landed in the frozen .rodata the programs read.
        rodata = next(n for n in ("bpf_lxc.rodata", ".rodata") if _has_map(first, n))
        with first.map(rodata, ctypes.c_uint32, LxcConfig) as ro:
            value = ro.lookup(ctypes.c_uint32(0))
        assert value is not None
        assert (value.monitor_aggregation, value.events_wakeup_events) == (0, 4)
        assert value.monitor_aggregation_interval_ns == 0
        with first.map("cilia_endpoints", ctypes.c_uint32, EndpointInfo) as eps:
            eps.update(ctypes.c_uint32(5), EndpointInfo(ep_id=42))
    # The programs are gone with the object, the pins are not: a reload reuses them.
    with (
        BpfObject.load(path, pin_dir=pin_dir, max_entries=sizes) as second,
        second.map("cilia_endpoints", ctypes.c_uint32, EndpointInfo) as eps,
    ):
        found = eps.lookup(ctypes.c_uint32(5))
        assert found is not None and found.ep_id == 42
    # Another size than the pin's is refused with libbpf's reason.
    with pytest.raises(BpfUnavailable, match="cilia_endpoints"):
        BpfObject.load(path, pin_dir=pin_dir, max_entries={**sizes, "cilia_endpoints": 16})


def test_missing_object_names_make_bpf(tmp_path: pathlib.Path) -> None:
    with pytest.raises(BpfUnavailable, match="make bpf"):
        object_path(tmp_path, "bpf_lxc")


def _has_map(obj: BpfObject, name: str) -> bool:
    try:
        obj.map_fd(name)
    except KeyError:
        return False
    return True


def test_a_pin_of_another_size_is_refused_naming_both_sizes_and_kept(
    pin_dir: pathlib.Path,
) -> None:
    """A map-size flag changed since the pins were made (--bpf-policy-map-max 1024 against a
    65536-entry pin) was refused with libbpf's bare "parameter mismatch"."""
    path = object_path(default_bpf_dir(), "bpf_lxc")
    sizes = {"cilia_ipcache": 64, "cilia_endpoints": 32, "cilia_ct": 128, "cilia_policy": 256}
    with (
        BpfObject.load(path, pin_dir=pin_dir, max_entries=sizes) as first,
        first.map("cilia_endpoints", ctypes.c_uint32, EndpointInfo) as eps,
    ):
        eps.update(ctypes.c_uint32(5), EndpointInfo(ep_id=42))
    with pytest.raises(BpfUnavailable) as err:
        BpfObject.load(path, pin_dir=pin_dir, max_entries={**sizes, "cilia_policy": 1024})
    assert str(err.value) == (
        f"pinned map {pin_dir}/cilia_policy has 256 entries, this start asks 1024: start with "
        "the size it was made with, or, to apply the new one (the endpoints' maps start "
        "empty), stop the agent and remove the pins (cilia-agent init clean-state "
        f"--bpf-state --bpf-pin-dir {pin_dir})"
    )
    with (
        BpfObject.load(path, pin_dir=pin_dir, max_entries=sizes) as again,
        again.map("cilia_endpoints", ctypes.c_uint32, EndpointInfo) as eps,
    ):
        found = eps.lookup(ctypes.c_uint32(5))
        assert found is not None and found.ep_id == 42  # the pins were left as they were
    assert not err.value.kernel  # a flag fixes it: no --enable-bpf=false hint


def test_a_failed_first_load_leaves_no_pin_dir_and_a_verifier_refusal_is_the_kernels(
    pin_dir: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    """A garbage object is refused as the build's fault (no --enable-bpf=false hint) and
    the pin directory this start created is removed again; a pin directory that cannot be
    created (bpffs) is the host's side, where the hint applies."""
    garbage = tmp_path / "bpf_lxc.o"
    garbage.write_bytes(b"\x7fELF not really")
    fresh = pin_dir / "fresh"
    with pytest.raises(BpfUnavailable) as err:
        BpfObject.load(garbage, pin_dir=fresh)
    assert not err.value.kernel
    assert not fresh.exists()
    not_bpffs = tmp_path / "file"
    not_bpffs.write_text("")
    with pytest.raises(BpfUnavailable) as err:
        BpfObject.load(object_path(default_bpf_dir(), "bpf_lxc"), pin_dir=not_bpffs / "pins")
    assert err.value.kernel and "is bpffs mounted?" in str(err.value)
