"""datapath.objects.object_path: where the agent finds a compiled BPF object, and the clear
refusal of a missing one or, in a checkout, of one older than its sources."""

from __future__ import annotations

import os
import pathlib

import pytest

from cilia_agent.datapath.objects import BpfUnavailable, object_path


def checkout(root: pathlib.Path) -> pathlib.Path:
    """``<root>/bpf/bpf_x.c``, ``<root>/bpf/lib/common.h`` and ``<root>/build/bpf``."""
    (root / "bpf" / "lib").mkdir(parents=True)
    (root / "bpf" / "bpf_x.c").write_text("")
    (root / "bpf" / "lib" / "common.h").write_text("")
    (root / "build" / "bpf").mkdir(parents=True)
    return root / "build" / "bpf"


def age(path: pathlib.Path, seconds: float) -> None:
    when = path.stat().st_mtime - seconds
    os.utime(path, (when, when))


def test_missing_object_names_make_bpf(tmp_path: pathlib.Path) -> None:
    with pytest.raises(BpfUnavailable, match=r"no compiled BPF object .*bpf_x\.o: run `make bpf`"):
        object_path(checkout(tmp_path), "bpf_x")


def test_object_older_than_a_header_is_refused_and_a_rebuilt_one_is_used(
    tmp_path: pathlib.Path,
) -> None:
    build = checkout(tmp_path)
    obj = build / "bpf_x.o"
    obj.write_bytes(b"")
    age(tmp_path / "bpf" / "bpf_x.c", 120)
    age(obj, 60)  # newer than its .c, older than common.h
    with pytest.raises(BpfUnavailable, match=r"older than .*common\.h: run `make bpf`"):
        object_path(build, "bpf_x")
    obj.touch()  # rebuilt
    assert object_path(build, "bpf_x") == obj


def test_outside_a_checkout_only_presence_counts(tmp_path: pathlib.Path) -> None:
    (tmp_path / "bpf_x.o").write_bytes(b"")
    assert object_path(tmp_path, "bpf_x") == tmp_path / "bpf_x.o"


def test_an_object_that_is_not_elf_is_refused_with_libbpfs_own_error_text(
    tmp_path: pathlib.Path,
) -> None:
    """libbpf's own error numbers (4000 and up, here 4001) are described by libbpf, not as Python's
    "Unknown error 4001"; the load fails before any kernel call."""
    from cilia_agent.datapath.libbpf import LibbpfError, libbpf
    from cilia_agent.datapath.objects import BpfObject

    try:
        libbpf()
    except LibbpfError as exc:
        pytest.skip(str(exc))  # no libbpf.so.1: nothing to open the object with
    garbage = tmp_path / "bpf_x.o"
    garbage.write_text("not an ELF object\n")
    with pytest.raises(BpfUnavailable) as err:
        BpfObject.load(garbage, pin_dir=tmp_path / "pins")
    message = str(err.value)
    assert message.startswith(f"cannot open {garbage}: BPF object format invalid"), message
    assert "Unknown error" not in message
