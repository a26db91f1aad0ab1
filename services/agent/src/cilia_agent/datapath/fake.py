"""An in-memory stand-in for the loaded datapath (``loader.Datapath``), for tests of the layers
above it: what they write to the BPF maps lands in dicts the test reads. No kernel, no root."""

from __future__ import annotations

import ctypes
from collections.abc import Iterator
from typing import Any


class FakeTable:
    """A pinned map as a dict keyed by the key's bytes (``key``/``value`` ctypes structs kept)."""

    def __init__(self) -> None:
        self.data: dict[bytes, tuple[Any, Any]] = {}

    def __setitem__(self, key: Any, value: Any) -> None:
        self.data[bytes(key)] = (key, value)

    def __delitem__(self, key: Any) -> None:
        del self.data[bytes(key)]

    def items(self) -> Iterator[tuple[Any, Any]]:
        return iter(list(self.data.values()))


class FakeDatapath:
    """The loader's :class:`~cilia_agent.datapath.loader.Datapath` as far as endpoint
    regeneration uses it, in dicts: endpoint map entries by ifindex (copied), the ipcache by
    ``"ip/plen"``, attached ifindexes, the ``cilia_policy`` map (:class:`FakeTable`) and the
    order of calls (``calls``). ``fail_attach`` makes :meth:`attach` raise OSError."""

    def __init__(self) -> None:
        self.policy = FakeTable()
        self.eps: dict[int, Any] = {}
        self.ipcache: dict[str, tuple[int, str]] = {}
        self.attached: set[int] = set()
        self.calls: list[str] = []
        self.fail_attach = False

    def table(self, name: str) -> FakeTable:
        assert name == "cilia_policy"
        return self.policy

    def set_endpoint(self, ifindex: int, info: Any) -> None:
        self.calls.append(f"set_endpoint {ifindex}")
        copy = type(info)()
        ctypes.memmove(ctypes.byref(copy), ctypes.byref(info), ctypes.sizeof(info))
        self.eps[ifindex] = copy

    def delete_endpoint(self, ifindex: int) -> None:
        self.eps.pop(ifindex, None)

    def endpoints(self) -> dict[int, Any]:
        return dict(self.eps)

    def upsert_ipcache(self, ip: str, plen: int, identity: int, node_ip: str = "") -> None:
        self.ipcache[f"{ip}/{plen}"] = (identity, node_ip)

    def delete_ipcache(self, ip: str, plen: int) -> None:
        self.ipcache.pop(f"{ip}/{plen}", None)

    def attach(self, ifindex: int) -> None:
        if self.fail_attach:
            raise OSError("attach failed (test)")
        self.calls.append(f"attach {ifindex}")
        self.attached.add(ifindex)

    def detach(self, ifindex: int) -> None:
        self.attached.discard(ifindex)
