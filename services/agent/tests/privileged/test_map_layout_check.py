"""A pinned map whose key or value size is not the agent's layout is refused in one line.

``cilia-agent bpf ipcache list`` (and every other reader of a pin) copies the map's
``key_size``/``value_size`` bytes into ctypes buffers of the agent's layout; a pin of another
layout under the expected name (left by another version or program) made it write past them
and die of SIGSEGV. Needs root and bpffs.
"""

from __future__ import annotations

import ctypes
import os
import pathlib
import subprocess
import sys
import uuid
from collections.abc import Iterator

import pytest

from cilia_agent.datapath.bpffs import BPFFS_ROOT
from cilia_agent.datapath.layout import IpcacheKey, IpcacheValue
from cilia_agent.datapath.libbpf import LibbpfError, PinnedMap, libbpf, obj_pin
from cilia_testkit import skips

pytestmark = pytest.mark.privileged

BIN = pathlib.Path(sys.executable).parent / "cilia-agent"
KEY, VALUE = 256, 1024  # much larger than IpcacheKey/IpcacheValue (8/8 bytes)


@pytest.fixture
def pin_dir() -> Iterator[pathlib.Path]:
    skips.require(skips.bpf_missing("a pinned BPF map"))
    path = pathlib.Path(BPFFS_ROOT) / f"cilia-tk-layout-{uuid.uuid4().hex[:8]}"
    path.mkdir()
    try:
        yield path
    finally:
        for pin in path.iterdir():
            pin.unlink()
        path.rmdir()


def _pin_foreign_map(path: pathlib.Path) -> None:
    """A hash map of 256-byte keys and 1 KiB values with 8 entries, pinned at ``path``."""
    lib = libbpf()
    lib.bpf_map_create.argtypes = [
        ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32, ctypes.c_uint32, ctypes.c_uint32,
        ctypes.c_void_p,
    ]  # fmt: skip
    lib.bpf_map_create.restype = ctypes.c_int
    fd = lib.bpf_map_create(1, b"foreign", KEY, VALUE, 16, None)
    assert fd >= 0, os.strerror(ctypes.get_errno())
    try:
        for i in range(8):
            key = (ctypes.c_ubyte * KEY)(*([i + 1] * KEY))
            value = (ctypes.c_ubyte * VALUE)(*([0xFF] * VALUE))
            assert lib.bpf_map_update_elem(fd, ctypes.byref(key), ctypes.byref(value), 0) == 0
        obj_pin(fd, path)
    finally:
        os.close(fd)


def test_a_pin_of_another_layout_is_refused_not_read_past_its_buffers(
    pin_dir: pathlib.Path,
) -> None:
    _pin_foreign_map(pin_dir / "cilia_ipcache")
    with pytest.raises(LibbpfError, match="256-byte keys and 1024-byte values") as err:
        PinnedMap(pin_dir / "cilia_ipcache", IpcacheKey, IpcacheValue)
    assert "IpcacheKey/IpcacheValue are 8/8 bytes" in str(err.value)

    proc = subprocess.run(
        [str(BIN), "bpf", "ipcache", "list", "--bpf-pin-dir", str(pin_dir)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 1, proc  # was -11 (SIGSEGV)
    assert proc.stdout == ""
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        f"cilia-agent: map {pin_dir / 'cilia_ipcache'} has 256-byte keys"
    ), proc.stderr
    assert (pin_dir / "cilia_ipcache").exists()  # left as it was
