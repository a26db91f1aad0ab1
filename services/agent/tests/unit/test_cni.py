"""DEL queue replay, conflist exclusive/uninstall and prevResult parsing (temp dirs only)."""

from __future__ import annotations

import asyncio
import json
import pathlib

import pytest

from cilia.agent.v1 import agent_pb2
from cilia_agent.cni import conflist_document, uninstall, write_conflist
from cilia_agent.cni.delqueue import replay
from cilia_agent.endpoint import InvalidRequest
from cilia_agent.endpoint.chaining import parse_prev_result


class Recorder:
    """A Del path that records its calls; ``fail`` container ids raise, ``exists`` return True."""

    def __init__(self, exists: set[str], fail: frozenset[str] = frozenset()) -> None:
        self.calls: list[tuple[str, str, str, int]] = []
        self.exists = exists
        self.fail = fail

    async def __call__(
        self, container_id: str, ifname: str, netns: str = "", *, not_after_ms: int = 0
    ) -> bool:
        self.calls.append((container_id, ifname, netns, not_after_ms))
        if container_id in self.fail:
            raise OSError("netlink busy")
        if container_id == "bad id!":
            raise InvalidRequest("container_id", "invalid")
        return container_id in self.exists


def put(d: pathlib.Path, name: str, cid: str, ms: int, ifname: str = "eth0") -> pathlib.Path:
    d.mkdir(exist_ok=True)
    path = d / name
    msg = agent_pb2.QueuedDel(
        request=agent_pb2.DelRequest(container_id=cid, ifname=ifname, netns="/run/netns/x"),
        queued_at_unix_ms=ms,
    )
    path.write_bytes(msg.SerializeToString())
    return path


def test_replay_in_name_order_deletes_files_and_keeps_failures(tmp_path: pathlib.Path) -> None:
    q = tmp_path / "q"
    put(q, "0000000000003-c.del", "third", 3)
    put(q, "0000000000001-a.del", "first", 1)
    put(q, "0000000000002-b.del", "second", 2)
    put(q, "0000000000004-d.del", "flaky", 4)
    rec = Recorder(exists={"first"}, fail={"flaky"})
    report = asyncio.run(replay(q, rec))
    assert [c[0] for c in rec.calls] == ["first", "second", "third", "flaky"]
    assert rec.calls[0] == ("first", "eth0", "/run/netns/x", 1)
    assert report.deleted == ["0000000000001-a.del"]
    assert report.nothing == ["0000000000002-b.del", "0000000000003-c.del"]
    assert report.failed == ["0000000000004-d.del"]
    assert sorted(p.name for p in q.iterdir()) == ["0000000000004-d.del"]


def test_corrupt_and_invalid_files_are_moved_aside_not_fatal(tmp_path: pathlib.Path) -> None:
    q = tmp_path / "q"
    q.mkdir()
    (q / "0000000000001-x.del").write_bytes(b"\x0a\xff\xff\xff")
    (q / "0000000000002-y.del").write_bytes(
        agent_pb2.QueuedDel(queued_at_unix_ms=5).SerializeToString()
    )
    put(q, "0000000000003-z.del", "bad id!", 3)
    put(q, "0000000000004-w.del", "ok", 4)
    (q / ".0000000000005-v.del.77.tmp").write_bytes(b"partial")
    (q / "README").write_text("ignored")
    rec = Recorder(exists={"ok"})
    report = asyncio.run(replay(q, rec))
    assert report.corrupt == ["0000000000001-x.del", "0000000000002-y.del", "0000000000003-z.del"]
    assert report.deleted == ["0000000000004-w.del"]
    assert sorted(p.name for p in q.iterdir()) == [
        ".0000000000005-v.del.77.tmp",
        "0000000000001-x.del.corrupt",
        "0000000000002-y.del.corrupt",
        "0000000000003-z.del.corrupt",
        "README",
    ]


def test_missing_queue_dir_is_nothing_to_do(tmp_path: pathlib.Path) -> None:
    report = asyncio.run(replay(tmp_path / "absent", Recorder(set())))
    assert report.deleted == report.nothing == report.failed == report.corrupt == []


def test_conflist_names_socket_and_del_queue(tmp_path: pathlib.Path) -> None:
    doc = conflist_document(tmp_path / "s.sock", "", tmp_path / "q")
    assert doc["plugins"] == [
        {
            "type": "cilia-cni",
            "agent-socket": str(tmp_path / "s.sock"),
            "del-queue-dir": str(tmp_path / "q"),
        }
    ]


def test_exclusive_moves_aside_and_uninstall_restores_except_rewritten(
    tmp_path: pathlib.Path,
) -> None:
    conf = tmp_path / "net.d"
    conf.mkdir()
    for name in ("10-a.conflist", "20-b.conf", "30-c.json"):
        (conf / name).write_text(json.dumps({"name": name}))
    (conf / ".hidden.conf").write_text("{}")
    (conf / "notes.txt").write_text("x")
    path = write_conflist(conf, "05-cilia.conflist", tmp_path / "s.sock", exclusive=True)
    assert json.loads(path.read_text())["name"] == "cilia"
    assert oct(path.stat().st_mode & 0o777) == "0o644"
    assert sorted(p.name for p in conf.iterdir()) == [
        ".hidden.conf",
        "05-cilia.conflist",
        "10-a.conflist.cilia_bak",
        "20-b.conf.cilia_bak",
        "30-c.json.cilia_bak",
        "notes.txt",
    ]
    # rewriting (a second ready) keeps the backups and never backs up our own file
    write_conflist(conf, "05-cilia.conflist", tmp_path / "s.sock", exclusive=True)
    assert not (conf / "05-cilia.conflist.cilia_bak").exists()
    (conf / "20-b.conf").write_text("{}")  # another installer rewrote it meanwhile
    restored = uninstall(conf, "05-cilia.conflist")
    assert sorted(p.name for p in restored) == ["10-a.conflist", "30-c.json"]
    assert sorted(p.name for p in conf.iterdir()) == [
        ".hidden.conf",
        "10-a.conflist",
        "20-b.conf",
        "20-b.conf.cilia_bak",
        "30-c.json",
        "notes.txt",
    ]
    assert json.loads((conf / "10-a.conflist").read_text()) == {"name": "10-a.conflist"}


def test_without_exclusive_other_configs_stay(tmp_path: pathlib.Path) -> None:
    conf = tmp_path / "net.d"
    conf.mkdir()
    (conf / "10-a.conflist").write_text("{}")
    write_conflist(conf, "05-cilia.conflist", tmp_path / "s.sock")
    assert sorted(p.name for p in conf.iterdir()) == ["05-cilia.conflist", "10-a.conflist"]
    assert not list(conf.glob(".*tmp*"))


PREV_031 = {
    "cniVersion": "0.3.1",
    "interfaces": [
        {"name": "veth1234", "mac": "aa:bb:cc:dd:ee:ff"},
        {"name": "eth0", "mac": "02:00:00:00:00:02", "sandbox": "/var/run/netns/p"},
    ],
    "ips": [
        {"version": "6", "address": "fd00::5/64", "interface": 1},
        {"version": "4", "address": "10.1.2.5/24", "gateway": "10.1.2.1", "interface": 1},
    ],
    "routes": [{"dst": "0.0.0.0/0"}],
}


def test_prev_result_picks_the_ipv4_of_the_container_interface() -> None:
    prev = parse_prev_result(json.dumps(PREV_031), "eth0")
    assert str(prev.address) == "10.1.2.5/24" and prev.gateway == "10.1.2.1"
    assert prev.routes == [{"dst": "0.0.0.0/0", "gw": ""}]
    assert [i["name"] for i in prev.interfaces] == ["veth1234", "eth0"]
    no_index = {"ips": [{"address": "10.9.9.9/32"}]}
    assert str(parse_prev_result(json.dumps(no_index), "eth0").address) == "10.9.9.9/32"


@pytest.mark.parametrize(
    "text",
    [
        "",
        "[]",
        '{"ips": {}}',
        '{"ips": [{"address": 5}]}',
        '{"ips": [{"address": "nope"}]}',
        '{"ips": [{"address": "10.0.0.1/24", "interface": "1"}]}',
        json.dumps({**PREV_031, "ips": [PREV_031["ips"][0]]}),  # type: ignore[index]
        json.dumps({**PREV_031, "interfaces": [{"name": "eth1", "sandbox": "/x"}]}),
    ],
)
def test_unusable_prev_result_names_the_field(text: str) -> None:
    with pytest.raises(InvalidRequest) as err:
        parse_prev_result(text, "eth0")
    assert err.value.field == "prev_result"


def test_portmap_chaining_appends_the_portmap_plugin_with_port_mappings(
    tmp_path: pathlib.Path,
) -> None:
    path = write_conflist(tmp_path, "05-cilia.conflist", tmp_path / "s.sock",
                          chaining_mode="portmap")  # fmt: skip
    plugins = json.loads(path.read_text())["plugins"]
    assert [p["type"] for p in plugins] == ["cilia-cni", "portmap"]
    assert plugins[1]["capabilities"] == {"portMappings": True}
    none = conflist_document(tmp_path / "s.sock", chaining_mode="none")
    assert [p["type"] for p in none["plugins"]] == ["cilia-cni"]


def test_unknown_chaining_mode_is_refused_and_nothing_written(tmp_path: pathlib.Path) -> None:
    with pytest.raises(ValueError, match="flannel"):
        write_conflist(tmp_path, "05-cilia.conflist", tmp_path / "s.sock", chaining_mode="flannel")
    assert list(tmp_path.iterdir()) == []
