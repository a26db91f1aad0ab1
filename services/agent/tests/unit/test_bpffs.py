"""bpffs detection: which mount holds the pin directory."""

from __future__ import annotations

import pathlib

import pytest

from cilia_agent.datapath.bpffs import BpffsUnavailable, ensure_bpffs, mount_point

MOUNTS = """\
/dev/root / ext4 rw 0 0
sysfs /sys sysfs rw 0 0
bpf /sys/fs/bpf bpf rw 0 0
tmpfs /sys/fs/bpf-other tmpfs rw 0 0
"""


def test_longest_mount_prefix_wins_and_sibling_names_do_not_match() -> None:
    assert mount_point(pathlib.Path("/sys/fs/bpf/cilia"), MOUNTS) == ("/sys/fs/bpf", "bpf")
    assert mount_point(pathlib.Path("/sys/fs/bpf"), MOUNTS) == ("/sys/fs/bpf", "bpf")
    assert mount_point(pathlib.Path("/sys/fs/bpf-other/x"), MOUNTS) == (
        "/sys/fs/bpf-other",
        "tmpfs",
    )
    assert mount_point(pathlib.Path("/sys/fs/bpfx"), MOUNTS) == ("/sys", "sysfs")


def test_pin_dir_outside_bpffs_and_sys_fs_bpf_is_refused(tmp_path: pathlib.Path) -> None:
    with pytest.raises(BpffsUnavailable, match="not on a BPF filesystem"):
        ensure_bpffs(tmp_path / "pins")
