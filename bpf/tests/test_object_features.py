"""The BPF features each shipped object uses, read from the compiled objects, against the
kernel that introduced each (``kernel_versions``); nothing newer than 5.10 in any default
path (issue 32).

Read from every ``build/bpf/*.o`` (what ``make bpf`` builds and the agent image ships):

- **helpers**: every ``call`` instruction with source register 0 in an executable section
  (eBPF encodes the helper number in the immediate; source 1 is a call to a BPF function,
  2 a kfunc), named through ``__BPF_FUNC_MAPPER`` of the uapi header the objects are
  compiled against;
- **program and attach types**: the ELF names of the program sections (libbpf decides the
  program type and the expected attach type from them, see ``kernel_versions.SECTIONS``);
- **map types**: the BTF of the ``.maps`` section (each map is a variable whose struct has
  a ``type`` member declared as ``int (*)[TYPE]``: the array length is the map type),
  named through ``enum bpf_map_type``.

No root needed: this only reads files.
"""

from __future__ import annotations

import pathlib
import re
import struct
from dataclasses import dataclass, field

import kernel_versions as kv
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
OBJECT_DIR = ROOT / "build" / "bpf"
UAPI = pathlib.Path("/usr/include/linux/bpf.h")
SHF_EXECINSTR = 0x4
BPF_CALL_OPCODE = 0x85  # BPF_JMP | BPF_CALL
BPF_LD_IMM64_OPCODE = 0x18  # two instruction slots
BTF_MAGIC = 0xEB9F


# --- the uapi header: numbers → names ----------------------------------------------------


def helper_names(header: str) -> dict[int, str]:
    """``{helper id: name}`` from ``__BPF_FUNC_MAPPER`` (``FN(name)`` in id order from 0,
    or ``FN(name, id, ...)`` in headers that number them)."""
    body = header.split("#define __BPF_FUNC_MAPPER", 1)[1].split("\n\n", 1)[0]
    out: dict[int, str] = {}
    for i, m in enumerate(re.finditer(r"FN\((\w+)(?:,\s*(\d+))?", body)):
        out[int(m.group(2)) if m.group(2) else i] = m.group(1)
    return out


def map_type_names(header: str) -> dict[int, str]:
    """``{map type: name}`` from ``enum bpf_map_type`` (aliases ``A = B`` take B's value)."""
    body = header.split("enum bpf_map_type {", 1)[1].split("};", 1)[0]
    body = re.sub(r"/\*.*?\*/", "", body, flags=re.S)
    values: dict[str, int] = {}
    nxt = 0
    for entry in (e.strip() for e in body.split(",")):
        if not entry:
            continue
        name, _, value = (p.strip() for p in entry.partition("="))
        nxt = values[value] if value in values else (int(value, 0) if value else nxt)
        values[name] = nxt
        nxt += 1
    out: dict[int, str] = {}
    for name, value in values.items():
        out.setdefault(value, name.removeprefix("BPF_MAP_TYPE_").lower())
    return out


# --- ELF and BTF -------------------------------------------------------------------------


@dataclass
class Section:
    """One ELF section: name, flags and bytes."""

    name: str
    flags: int
    data: bytes


def sections(path: pathlib.Path) -> list[Section]:
    """Every section of an ELF64 little-endian relocatable object.

    Raises:
        AssertionError: not such a file.
    """
    raw = path.read_bytes()
    assert raw[:4] == b"\x7fELF" and raw[4] == 2 and raw[5] == 1, f"{path}: not ELF64 LSB"
    (shoff,) = struct.unpack_from("<Q", raw, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", raw, 0x3A)
    heads = []
    for i in range(shnum):
        name, _type, flags, _addr, offset, size = struct.unpack_from(
            "<IIQQQQ", raw, shoff + i * shentsize
        )
        heads.append((name, flags, offset, size))
    str_off, str_size = heads[shstrndx][2], heads[shstrndx][3]
    strtab = raw[str_off : str_off + str_size]
    out = []
    for name, flags, offset, size in heads:
        label = strtab[name : strtab.index(b"\0", name)].decode()
        out.append(Section(label, flags, raw[offset : offset + size]))
    return out


def helper_calls(code: bytes) -> set[int]:
    """Helper numbers called in one section of eBPF instructions."""
    out: set[int] = set()
    i = 0
    while i + 8 <= len(code):
        opcode, regs = code[i], code[i + 1]
        if opcode == BPF_CALL_OPCODE and regs >> 4 == 0:
            out.add(struct.unpack_from("<i", code, i + 4)[0])
        i += 16 if opcode == BPF_LD_IMM64_OPCODE else 8
    return out


# BTF kinds (include/uapi/linux/btf.h) and the bytes that follow each btf_type
_KIND_PTR, _KIND_ARRAY, _KIND_STRUCT, _KIND_VAR, _KIND_DATASEC = 2, 3, 4, 14, 15
_EXTRA = {1: lambda v: 4, 3: lambda v: 12, 4: lambda v: 12 * v, 5: lambda v: 12 * v,
          6: lambda v: 8 * v, 13: lambda v: 8 * v, 14: lambda v: 4, 15: lambda v: 12 * v,
          17: lambda v: 4, 19: lambda v: 12 * v}  # fmt: skip


@dataclass
class BtfType:
    """One BTF type: kind, name, the size/type field and its trailing records' bytes."""

    kind: int
    name: str
    size_or_type: int
    vlen: int
    extra: bytes = field(repr=False)


@dataclass
class Btf:
    """A ``.BTF`` section: its types indexed by type id (0 is void: None) and strings."""

    types: list[BtfType | None]
    strings: bytes

    def string(self, offset: int) -> str:
        return self.strings[offset : self.strings.index(b"\0", offset)].decode()


def read_btf(data: bytes) -> Btf:
    """Parse a ``.BTF`` section.

    Raises:
        AssertionError: not BTF, or a kind this reader does not know.
    """
    magic, _version, _flags, hdr_len, type_off, type_len, str_off, str_len = struct.unpack_from(
        "<HBBIIIII", data, 0
    )
    assert magic == BTF_MAGIC, "not BTF"
    raw = data[hdr_len + type_off : hdr_len + type_off + type_len]
    btf = Btf([None], data[hdr_len + str_off : hdr_len + str_off + str_len])
    i = 0
    while i < len(raw):
        name_off, info, size_or_type = struct.unpack_from("<III", raw, i)
        kind, vlen = (info >> 24) & 0x1F, info & 0xFFFF
        assert 1 <= kind <= 19, f"unknown BTF kind {kind}"
        n = _EXTRA.get(kind, lambda v: 0)(vlen)
        btf.types.append(
            BtfType(kind, btf.string(name_off), size_or_type, vlen, raw[i + 12 : i + 12 + n])
        )
        i += 12 + n
    return btf


def map_types(btf: Btf) -> dict[str, int]:
    """``{map name: map type number}`` of every map in the ``.maps`` DATASEC."""
    out: dict[str, int] = {}
    t = btf.types
    for sec in t:
        if sec is None or sec.kind != _KIND_DATASEC or sec.name != ".maps":
            continue
        for j in range(sec.vlen):
            var_id, _off, _size = struct.unpack_from("<III", sec.extra, 12 * j)
            var = t[var_id]
            assert var is not None and var.kind == _KIND_VAR
            st = t[var.size_or_type]
            assert st is not None and st.kind == _KIND_STRUCT, var.name
            for k in range(st.vlen):
                m_name, m_type, _bits = struct.unpack_from("<III", st.extra, 12 * k)
                if btf.string(m_name) != "type":
                    continue
                ptr = t[m_type]
                assert ptr is not None and ptr.kind == _KIND_PTR, var.name
                arr = t[ptr.size_or_type]
                assert arr is not None and arr.kind == _KIND_ARRAY, var.name
                out[var.name] = struct.unpack_from("<III", arr.extra, 0)[2]
    return out


# --- what each object uses ---------------------------------------------------------------


@dataclass(frozen=True)
class Use:
    """One feature an object uses: kind, name, first kernel."""

    kind: str
    name: str
    since: tuple[int, int]

    def __str__(self) -> str:
        return f"{self.kind} {self.name} ({self.since[0]}.{self.since[1]})"


def features(path: pathlib.Path, helpers: dict[int, str], maps: dict[int, str]) -> list[Use]:
    """Every helper, program type, attach type and map type ``path`` uses.

    Raises:
        AssertionError: a feature missing from ``kernel_versions`` (add it), or an object
            without BTF.
    """
    secs = sections(path)
    uses: set[Use] = set()
    unknown: list[str] = []
    for sec in secs:
        if not sec.flags & SHF_EXECINSTR or not sec.data:
            continue
        if sec.name != ".text":
            known = kv.SECTIONS.get(sec.name)
            if known is None:
                unknown.append(f"section {sec.name}")
            else:
                prog, since, attach, attach_since = known
                uses.add(Use("program type", prog, since))
                if attach:
                    uses.add(Use("attach type", attach, attach_since))
        for number in helper_calls(sec.data):
            name = helpers.get(number, f"#{number}")
            if name in kv.HELPERS:
                uses.add(Use("helper", name, kv.HELPERS[name]))
            else:
                unknown.append(f"helper {name}")
    btf_sec = next((s for s in secs if s.name == ".BTF"), None)
    assert btf_sec is not None, f"{path.name} has no BTF (compile with -g)"
    for number in map_types(read_btf(btf_sec.data)).values():
        name = maps.get(number, f"#{number}")
        if name in kv.MAP_TYPES:
            uses.add(Use("map type", name, kv.MAP_TYPES[name]))
        else:
            unknown.append(f"map type {name}")
    assert not unknown, f"{path.name}: not in bpf/tests/kernel_versions.py: {unknown}"
    return sorted(uses, key=lambda u: (u.since, u.kind, u.name))


@pytest.fixture(scope="module")
def names() -> tuple[dict[int, str], dict[int, str]]:
    header = UAPI.read_text()
    return helper_names(header), map_type_names(header)


def shipped_objects() -> list[pathlib.Path]:
    objects = sorted(OBJECT_DIR.glob("*.o"))
    assert {p.name for p in objects} >= {
        "bpf_lxc.o",
        "bpf_host.o",
        "bpf_sock.o",
        "bpf_sock_compat.o",
    }, f"run `make bpf` ({objects})"
    return objects


def test_the_readers_see_known_numbers(names: tuple[dict[int, str], dict[int, str]]) -> None:
    helpers, maps = names
    assert (helpers[1], helpers[130], helpers[187]) == (
        "map_lookup_elem",
        "ringbuf_output",
        "set_retval",
    )
    assert (maps[1], maps[9], maps[11], maps[27]) == ("hash", "lru_hash", "lpm_trie", "ringbuf")
    # a call to helper 5 and a BPF-to-BPF call (source register 1) after a 16-byte ld_imm64
    code = bytes([0x18, 0x01, 0, 0, 1, 0, 0, 0]) + bytes(8)
    code += bytes([0x85, 0x00, 0, 0, 5, 0, 0, 0]) + bytes(
        [0x85, 0x10, 0, 0, 0xFF, 0xFF, 0xFF, 0xFF]
    )
    assert helper_calls(code) == {5}


def test_every_object_lists_its_features_and_none_is_newer_than_5_10_unless_probed(
    names: tuple[dict[int, str], dict[int, str]],
) -> None:
    helpers, maps = names
    report = []
    too_new: dict[str, list[str]] = {}
    for path in shipped_objects():
        uses = features(path, helpers, maps)
        assert uses, path
        gated = kv.PROBE_GATED.get(path.name, {})
        report.append(f"{path.name}:")
        for use in uses:
            mark = ""
            if use.since > kv.FLOOR:
                if use.kind == "helper" and use.name in gated:
                    mark = f"   [newer than 5.10: {gated[use.name]}]"
                else:
                    too_new.setdefault(path.name, []).append(str(use))
                    mark = "   [NEWER THAN 5.10]"
            report.append(f"  {use}{mark}")
    print("\n" + "\n".join(report))
    assert not too_new, f"features newer than 5.10 outside a probe: {too_new}"


def test_the_compat_socket_lb_object_uses_nothing_newer_than_5_10(
    names: tuple[dict[int, str], dict[int, str]],
) -> None:
    helpers, maps = names
    full = features(OBJECT_DIR / "bpf_sock.o", helpers, maps)
    compat = features(OBJECT_DIR / "bpf_sock_compat.o", helpers, maps)
    # the reader does see the call the compat build leaves out
    assert Use("helper", "set_retval", (5, 18)) in full
    assert [u for u in compat if u.since > kv.FLOOR] == []
    # the same programs, hooks and maps otherwise
    assert set(full) - set(compat) == {Use("helper", "set_retval", (5, 18))}


def test_the_agents_start_check_probes_every_helper_and_map_type_the_objects_use(
    names: tuple[dict[int, str], dict[int, str]],
) -> None:
    """``cilia-agent init check-kernel`` (preflight.kernel.FEATURES) must probe what the
    objects use, or an old kernel passes the check and fails at load."""
    from cilia_agent.preflight import kernel

    helpers, maps = names
    numbers = {"helper": helpers, "map type": maps}
    for f in kernel.FEATURES:  # the hand-written numbers are the header's
        if f.kind in numbers:
            assert numbers[f.kind][f.number] == f.name.removeprefix("bpf_"), f
    probed = {(f.kind, f.name.removeprefix("bpf_")) for f in kernel.FEATURES}
    missing = []
    for path in shipped_objects():
        for use in features(path, helpers, maps):
            gated = use.name in kv.PROBE_GATED.get(path.name, {})
            kind_probed = use.kind in ("helper", "map type")
            if kind_probed and (use.kind, use.name) not in probed and not gated:
                missing.append(f"{path.name}: {use}")
    assert not missing, f"used but not probed at start (preflight/kernel.py FEATURES): {missing}"
