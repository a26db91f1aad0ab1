"""DEL with the agent unreachable: queued on disk in the ``QueuedDel`` format of
agent.proto (the agent replays the queue at start), bounded by ``del-queue-max``."""

from __future__ import annotations

import os
import re
import socket

from cni_testlib import assert_cni_error, cni_env, exec_cni, netconf

from cilia.agent.v1 import agent_pb2

NAME = re.compile(r"\d{13}-[0-9a-f]{16}\.del")


def _queued(directory: str) -> list[agent_pb2.QueuedDel]:
    names = sorted(os.listdir(directory))
    assert all(NAME.fullmatch(n) for n in names), names  # no temporary file left
    out = []
    for name in names:
        with open(os.path.join(directory, name), "rb") as f:
            out.append(agent_pb2.QueuedDel.FromString(f.read()))
    return out


def test_del_with_agent_absent_is_queued_and_succeeds(absent_socket: str, short_tmp: str) -> None:
    queue = os.path.join(short_tmp, "q")
    conf = netconf(absent_socket, **{"del-queue-dir": queue})
    run = exec_cni(cni_env("DEL", container_id="gone-1", CNI_NETNS=""), conf)
    assert (run.returncode, run.stdout, run.stderr) == (0, "", "")
    (entry,) = _queued(queue)
    assert (entry.request.container_id, entry.request.ifname, entry.request.netns) == (
        "gone-1",
        "eth0",
        "",
    )
    assert entry.queued_at_unix_ms > 0
    # A repeated DEL for the same attachment is not queued twice.
    assert exec_cni(cni_env("DEL", container_id="gone-1"), conf).returncode == 0
    assert len(_queued(queue)) == 1


def test_del_with_socket_refusing_is_queued(short_tmp: str) -> None:
    path = os.path.join(short_tmp, "dead.sock")
    queue = os.path.join(short_tmp, "q")
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(path)
        run = exec_cni(cni_env("DEL"), netconf(path, **{"del-queue-dir": queue}))
    assert run.returncode == 0, run
    assert [e.request.container_id for e in _queued(queue)] == ["c0ffee01"]


def test_full_del_queue_fails_with_code_11_and_queues_nothing(
    absent_socket: str, short_tmp: str
) -> None:
    queue = os.path.join(short_tmp, "q")
    conf = netconf(absent_socket, **{"del-queue-dir": queue, "del-queue-max": 2})
    for cid in ("a1", "a2"):
        assert exec_cni(cni_env("DEL", container_id=cid), conf).returncode == 0
    run = exec_cni(cni_env("DEL", container_id="a3"), conf)
    assert_cni_error(run, 11, "full", "`del-queue-max`", queue)
    assert sorted(e.request.container_id for e in _queued(queue)) == ["a1", "a2"]


def test_unusable_del_queue_dir_fails_with_code_11(absent_socket: str, short_tmp: str) -> None:
    blocker = os.path.join(short_tmp, "file")
    with open(blocker, "w"):
        pass
    conf = netconf(absent_socket, **{"del-queue-dir": blocker + "/q"})
    assert_cni_error(exec_cni(cni_env("DEL"), conf), 11, "`del-queue-dir`")
