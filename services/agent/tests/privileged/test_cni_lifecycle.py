"""Check, GC, release keyed by (container id, ifname), abandoned Adds, DEL queue replay,
cni-exclusive/uninstall: the real gRPC server, real netns and veths.

Netns names start with ``cilia-b1-`` (cleaned by the ``env`` fixture).
"""

from __future__ import annotations

import asyncio
import json
import pathlib
import secrets
import subprocess
import sys
import threading
import time
from collections.abc import Awaitable, Callable

import grpc
import pytest

from cilia.agent.v1 import agent_pb2
from cilia_agent.datapath import host_ifname
from cilia_agent.endpoint import EndpointRecord
from cilia_testkit import skips

from .conftest import Env, sh


def netns(env: Env) -> str:
    name = f"cilia-b1-{secrets.token_hex(4)}"
    subprocess.run(["ip", "netns", "add", name], check=True)
    env.netns.append(name)
    return f"/var/run/netns/{name}"


def add_req(ns: str, cid: str, ifname: str = "eth0", **kw: object) -> agent_pb2.AddRequest:
    return agent_pb2.AddRequest(container_id=cid, ifname=ifname, netns=ns, **kw)  # type: ignore[arg-type]


def link_exists(name: str) -> bool:
    return subprocess.run(["ip", "link", "show", name], capture_output=True).returncode == 0


def state_files(env: Env) -> list[pathlib.Path]:
    return sorted((env.state_dir / "endpoints").glob("*.json"))


def wait_for(cond: Callable[[], bool], what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def held_ips(env_agent: object) -> dict[str, str]:
    return {str(a): o for a, o in env_agent.agent.ipam.allocated().items()}  # type: ignore[attr-defined]


class GateHooks:
    """Enforcement hooks whose ``create`` waits until the test opens the gate."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.gate = threading.Event()
        self.deleted: list[int] = []

    async def create(
        self,
        rec: EndpointRecord,
        ifindex: int | Awaitable[int],
        on_identity: Callable[[int], Awaitable[None]] | None = None,
    ) -> int:
        if on_identity is not None:
            await on_identity(4242)
        if not isinstance(ifindex, int):
            await ifindex  # the veth exists from here on (as for the real hooks)
        self.entered.set()
        while not self.gate.is_set():
            await asyncio.sleep(0.01)
        return 4242

    async def delete(self, rec: EndpointRecord, *, veth_deleted_next: bool = False) -> None:
        self.deleted.append(rec.id)

    async def health(self, rec: EndpointRecord) -> list[str]:
        return []


# --- Check ---------------------------------------------------------------------------------


def test_check_passes_then_lists_every_difference(env: Env) -> None:
    a = env.start_agent()
    ns = netns(env)
    name = ns.rsplit("/", 1)[1]
    r = a.attach.Add(add_req(ns, "chk"), timeout=10)
    ok = a.attach.Check(agent_pb2.CheckRequest(container_id="chk", ifname="eth0", netns=ns))
    assert ok.endpoint_id == r.endpoint_id
    full = agent_pb2.CheckRequest(
        container_id="chk",
        ifname="eth0",
        netns=ns,
        addresses=[r.ips[0].address],
        routes=list(r.routes),
        mac=r.interfaces[1].mac.upper(),
    )
    assert a.attach.Check(full).endpoint_id == r.endpoint_id

    ip = r.ips[0].address
    sh("ip", "-n", name, "route", "del", "default")
    sh("ip", "-n", name, "addr", "del", ip, "dev", "eth0")
    wrong_mac = dict(mac="02:00:00:00:00:01")
    with pytest.raises(grpc.RpcError) as err:
        a.attach.Check(agent_pb2.CheckRequest(container_id="chk", ifname="eth0", **wrong_mac))
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    msg = err.value.details() or ""
    assert f"address {ip} missing" in msg
    assert "route 0.0.0.0/0 via" in msg
    assert "mac: expected 02:00:00:00:00:01" in msg

    sh("ip", "-n", name, "link", "del", "eth0")  # takes the host veth with it
    with pytest.raises(grpc.RpcError) as err:
        a.attach.Check(agent_pb2.CheckRequest(container_id="chk", ifname="eth0"))
    msg = err.value.details() or ""
    assert "interface eth0 not found" in msg and f"host veth {host_ifname('chk', 'eth0')}" in msg


def test_check_fails_on_a_changed_mtu_and_on_addresses_without_the_assigned_one(env: Env) -> None:
    a = env.start_agent()
    ns = netns(env)
    name = ns.rsplit("/", 1)[1]
    r = a.attach.Add(add_req(ns, "chkmtu"), timeout=10)
    ip = r.ips[0].address
    other = agent_pb2.CheckRequest(
        container_id="chkmtu", ifname="eth0", netns=ns, addresses=["10.255.255.1/32"]
    )
    with pytest.raises(grpc.RpcError) as err:
        a.attach.Check(other)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert f"address {ip} assigned at Add is not in the request's addresses" in (
        err.value.details() or ""
    )
    configured = a.agent.pod_mtu  # --mtu 0: the MTU detected from the host
    sh("ip", "-n", name, "link", "set", "eth0", "mtu", str(configured - 100))
    with pytest.raises(grpc.RpcError) as err:
        a.attach.Check(agent_pb2.CheckRequest(container_id="chkmtu", ifname="eth0", netns=ns))
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert f"mtu: expected {configured}, eth0 has {configured - 100}" in (err.value.details() or "")
    sh("ip", "-n", name, "link", "set", "eth0", "mtu", str(configured))
    ok = agent_pb2.CheckRequest(container_id="chkmtu", ifname="eth0", netns=ns, addresses=[ip])
    assert a.attach.Check(ok).endpoint_id == r.endpoint_id


def test_add_refuses_a_5000_char_container_id_quoting_only_its_start(env: Env) -> None:
    a = env.start_agent()
    long_id = "a" * 5000
    with pytest.raises(grpc.RpcError) as err:
        a.attach.Add(add_req(netns(env), long_id), timeout=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    msg = err.value.details() or ""
    assert "container_id:" in msg and "(5000 chars)" in msg and len(msg) < 300


def test_check_unknown_attachment_is_not_found_and_creating_is_unavailable(env: Env) -> None:
    a = env.start_agent()
    with pytest.raises(grpc.RpcError) as err:
        a.attach.Check(agent_pb2.CheckRequest(container_id="nope", ifname="eth0"))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    assert "unknown attachment (nope, eth0)" in (err.value.details() or "")
    hooks = GateHooks()
    a.agent.endpoints.hooks = hooks
    ns = netns(env)
    fut = a.attach.Add.future(add_req(ns, "slow"), timeout=30)
    assert hooks.entered.wait(10)
    with pytest.raises(grpc.RpcError) as err:
        a.attach.Check(agent_pb2.CheckRequest(container_id="slow", ifname="eth0"))
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "creating" in (err.value.details() or "")
    # the identity is persisted as soon as it exists: a crash now lets the restore release it
    [creating] = [json.loads(f.read_text()) for f in state_files(env)]
    assert (creating["state"], creating["identity"]) == ("creating", 4242)
    hooks.gate.set()
    assert fut.result().endpoint_id
    a.attach.Check(agent_pb2.CheckRequest(container_id="slow", ifname="eth0"))
    eps = a.debug.ListEndpoints(agent_pb2.ListEndpointsRequest()).endpoints
    assert [(e.identity, e.chained) for e in eps] == [(4242, False)]
    out = sh(
        sys.executable,
        "-m",
        "cilia_agent",
        "endpoint",
        "list",
        "-o",
        "json",
        "--socket",
        str(a.config.socket),
        "--bpf-pin-dir",
        str(env.pin_dir),
    )
    assert [(e["container_id"], e["identity"], e["chained"]) for e in json.loads(out)] == [
        ("slow", 4242, False)
    ]


# --- GC ------------------------------------------------------------------------------------


def test_gc_releases_everything_not_valid_but_never_an_add_in_progress(env: Env) -> None:
    a = env.start_agent()
    ns = {c: netns(env) for c in ("keep", "gone1", "gone2", "adding")}
    ips = {
        c: a.attach.Add(add_req(ns[c], c), timeout=10).ips[0].address[:-3]
        for c in ns
        if c != "adding"
    }
    hooks = GateHooks()
    hooks.gate.set()  # the three above are done; gate the next Add only
    a.agent.endpoints.hooks = hooks
    hooks.gate.clear()
    fut = a.attach.Add.future(add_req(ns["adding"], "adding"), timeout=30)
    assert hooks.entered.wait(10)

    resp = a.attach.GC(
        agent_pb2.GCRequest(
            valid_attachments=[agent_pb2.Attachment(container_id="keep", ifname="eth0")]
        )
    )
    assert sorted((x.container_id, x.ifname) for x in resp.released) == [
        ("gone1", "eth0"),
        ("gone2", "eth0"),
    ]
    hooks.gate.set()
    added = fut.result()
    held = held_ips(a)
    assert ips["keep"] in held and ips["gone1"] not in held and ips["gone2"] not in held
    assert added.ips[0].address[:-3] in held
    for c in ("gone1", "gone2"):
        assert not link_exists(host_ifname(c, "eth0"))
        assert "eth0" not in sh("ip", "-n", ns[c].rsplit("/", 1)[1], "link")
    assert link_exists(host_ifname("keep", "eth0")) and link_exists(host_ifname("adding", "eth0"))
    eps = a.debug.ListEndpoints(agent_pb2.ListEndpointsRequest()).endpoints
    assert sorted(e.container_id for e in eps) == ["adding", "keep"]
    assert len(state_files(env)) == 2
    # a second GC with both valid releases nothing
    again = a.attach.GC(
        agent_pb2.GCRequest(
            valid_attachments=[
                agent_pb2.Attachment(container_id=c, ifname="eth0") for c in ("keep", "adding")
            ]
        )
    )
    assert list(again.released) == []


# --- release keyed by (container id, ifname) -----------------------------------------------


def test_stale_del_of_old_sandbox_never_frees_the_new_sandbox_address(env: Env) -> None:
    a = env.start_agent()
    pod = dict(pod_namespace="team", pod_name="web-0")
    old_ns, new_ns = netns(env), netns(env)
    old = a.attach.Add(add_req(old_ns, "sandbox-old", **pod), timeout=10)
    a.attach.Del(agent_pb2.DelRequest(container_id="sandbox-old", ifname="eth0", netns=old_ns))
    new = a.attach.Add(add_req(new_ns, "sandbox-new", **pod), timeout=10)
    new_ip = new.ips[0].address[:-3]
    # the runtime repeats the old sandbox's DEL (with and without its netns) after the new ADD
    for netns_path in (old_ns, "", new_ns):
        d = a.attach.Del(
            agent_pb2.DelRequest(container_id="sandbox-old", ifname="eth0", netns=netns_path)
        )
        assert d.deleted is False
    assert held_ips(a).get(new_ip) == "sandbox-new/eth0"
    assert link_exists(host_ifname("sandbox-new", "eth0"))
    a.attach.Check(agent_pb2.CheckRequest(container_id="sandbox-new", ifname="eth0"))
    sh("ip", "netns", "exec", new_ns.rsplit("/", 1)[1], "ping", "-c1", "-W2", new.ips[0].gateway)
    # the address is not handed out again
    third = a.attach.Add(add_req(netns(env), "sandbox-third"), timeout=10)
    assert third.ips[0].address[:-3] != new_ip
    assert old.ips[0].address[:-3] not in held_ips(a)


def test_del_never_releases_an_address_another_attachment_holds(env: Env) -> None:
    a = env.start_agent()
    r = a.attach.Add(add_req(netns(env), "victim"), timeout=10)
    ip = r.ips[0].address[:-3]
    # a record of another attachment claims the same address (e.g. a stale state file)
    rec = a.agent.endpoints.get("victim", "eth0")
    assert rec is not None
    stale = rec.model_copy(
        update={"id": 999, "container_id": "stale", "host_ifname": host_ifname("stale", "eth0")}
    )
    a.agent.endpoints._endpoints[stale.key] = stale
    assert a.attach.Del(agent_pb2.DelRequest(container_id="stale", ifname="eth0")).deleted
    assert held_ips(a).get(ip) == "victim/eth0"
    a.attach.Check(agent_pb2.CheckRequest(container_id="victim", ifname="eth0"))


def test_durable_state_dir_add_and_del_write_and_remove_the_state_file(env: Env) -> None:
    # --state-fsync: state files are written in the worker pool (fsynced), not on the loop
    a = env.start_agent(state_fsync=True)
    hooks = GateHooks()
    a.agent.endpoints.hooks = hooks
    fut = a.attach.Add.future(add_req(netns(env), "durable"), timeout=30)
    assert hooks.entered.wait(10)
    [creating] = [json.loads(f.read_text()) for f in state_files(env)]
    assert (creating["state"], creating["identity"]) == ("creating", 4242)
    hooks.gate.set()
    assert fut.result().endpoint_id
    [ready] = [json.loads(f.read_text()) for f in state_files(env)]
    assert (ready["state"], ready["identity"], ready["container_id"]) == ("ready", 4242, "durable")
    assert a.attach.Del(agent_pb2.DelRequest(container_id="durable", ifname="eth0")).deleted
    assert state_files(env) == [] and hooks.deleted


# --- abandoned Add -------------------------------------------------------------------------


def test_add_whose_client_went_away_leaves_nothing(env: Env) -> None:
    a = env.start_agent()
    hooks = GateHooks()
    a.agent.endpoints.hooks = hooks
    ns = netns(env)
    used_before = a.debug.Status(agent_pb2.StatusRequest()).pools[0].used
    fut = a.attach.Add.future(add_req(ns, "killed"), timeout=30)
    assert hooks.entered.wait(10)  # IP allocated, veth plumbed, state file "creating"
    assert link_exists(host_ifname("killed", "eth0")) and len(state_files(env)) == 1
    fut.cancel()  # what the agent sees when the plugin is SIGKILLed: the RPC is cancelled
    time.sleep(0.2)
    hooks.gate.set()
    wait_for(lambda: not a.agent.endpoints.list(), "the abandoned endpoint to be deleted")
    assert hooks.deleted  # the enforcement of the finished endpoint was undone
    assert not link_exists(host_ifname("killed", "eth0"))
    assert state_files(env) == []
    assert a.debug.Status(agent_pb2.StatusRequest()).pools[0].used == used_before
    assert "eth0" not in sh("ip", "-n", ns.rsplit("/", 1)[1], "link")


# --- DEL queue replay ----------------------------------------------------------------------


def queue_del(directory: pathlib.Path, cid: str, ms: int, netns_path: str = "") -> pathlib.Path:
    directory.mkdir(parents=True, exist_ok=True)
    msg = agent_pb2.QueuedDel(
        request=agent_pb2.DelRequest(container_id=cid, ifname="eth0", netns=netns_path),
        queued_at_unix_ms=ms,
    )
    path = directory / f"{ms:013d}-{secrets.token_hex(8)}.del"
    path.write_bytes(msg.SerializeToString())
    return path


def test_queued_dels_are_replayed_before_serving(env: Env) -> None:
    a = env.start_agent()
    ns_gone, ns_kept = netns(env), netns(env)
    gone = a.attach.Add(add_req(ns_gone, "q-gone"), timeout=10)
    a.attach.Add(add_req(ns_kept, "q-newer"), timeout=10)
    a.stop()
    queue = env.tmp / "del-queue"
    now = int(time.time() * 1000)
    f1 = queue_del(queue, "q-gone", now, ns_gone)
    f2 = queue_del(queue, "q-never-added", now + 1)
    f3 = queue_del(queue, "q-newer", now - 3_600_000)  # queued before q-newer was created
    corrupt = queue / f"{now + 2:013d}-deadbeefdeadbeef.del"
    corrupt.write_bytes(b"\xff\xff not a protobuf")
    tmp = queue / ".0000000000001-abc.del.1.tmp"  # a plugin still writing
    tmp.write_bytes(b"")

    b = env.start_agent()
    # replayed before the socket served anything: the first RPC already sees the result
    eps = b.debug.ListEndpoints(agent_pb2.ListEndpointsRequest()).endpoints
    assert [e.container_id for e in eps] == ["q-newer"]
    assert not link_exists(host_ifname("q-gone", "eth0"))
    assert gone.ips[0].address[:-3] not in held_ips(b)
    assert not f1.exists() and not f2.exists() and not f3.exists()
    assert not corrupt.exists() and corrupt.with_name(corrupt.name + ".corrupt").exists()
    assert tmp.exists()
    report = b.agent.cni.del_queue_report
    assert (len(report.deleted), len(report.nothing), report.corrupt) == (1, 2, [corrupt.name])


# --- conflist ------------------------------------------------------------------------------


def test_cni_exclusive_moves_other_configs_aside_and_uninstall_restores_them(env: Env) -> None:
    conf = env.tmp / "net.d"
    conf.mkdir()
    others = {"10-bridge.conflist": "{}", "20-old.conf": "{}", "99-x.json": "{}"}
    for n, body in others.items():
        (conf / n).write_text(body)
    (conf / "README").write_text("not a config")
    a = env.start_agent(cni_exclusive=True, cni_uninstall=True)
    names = sorted(p.name for p in conf.iterdir())
    assert names == sorted(["05-cilia.conflist", "README", *(n + ".cilia_bak" for n in others)])
    doc = json.loads((conf / "05-cilia.conflist").read_text())
    assert doc["plugins"][0]["del-queue-dir"] == str(env.tmp / "del-queue")
    a.stop()
    assert sorted(p.name for p in conf.iterdir()) == sorted(["README", *others])


# --- stale DEL with the eBPF datapath and an operator --------------------------------------


def test_stale_del_keeps_the_new_sandbox_operator_record_ipcache_and_programs(env: Env) -> None:
    from cilia_agent.datapath.layout import ip_from_map

    from .fake_operator import FakeOperator

    skips.require_bpf("netns, tc, BPF")
    op = FakeOperator(env.cidr)
    try:
        a = env.start_agent(
            static={},
            enable_bpf=True,
            operator=op.address,
            operator_reconnect_min_backoff=0.1,
            operator_reconnect_max_backoff=0.5,
        )
        wait_for(lambda: a.debug.Status(agent_pb2.StatusRequest()).ready, "agent ready")
        pod = dict(pod_namespace="team", pod_name="web-0", labels={"app": "web"})
        a.attach.Add(add_req(netns(env), "sb-old", **pod), timeout=30)
        new = a.attach.Add(add_req(netns(env), "sb-new", **pod), timeout=30)
        assert op.endpoints[("team", "web-0")].container_id == "sb-new"
        new_ifindex = int(
            pathlib.Path(f"/sys/class/net/{new.interfaces[0].name}/ifindex").read_text()
        )
        # the old sandbox's DEL arrives after the new sandbox exists
        assert a.attach.Del(agent_pb2.DelRequest(container_id="sb-old", ifname="eth0")).deleted
        bpf = a.agent.bpf
        assert list(bpf.endpoints()) == [new_ifindex]
        prefixes = {f"{ip_from_map(int(k.ip))}/{int(k.prefixlen)}" for k in bpf.ipcache_map}
        assert new.ips[0].address in prefixes  # the new pod's /32 is still there
        a.attach.Check(agent_pb2.CheckRequest(container_id="sb-new", ifname="eth0"))
        # the new sandbox's own DEL is the only DeleteEndpoint the operator sees
        a.attach.Del(agent_pb2.DelRequest(container_id="sb-new", ifname="eth0"))
        wait_for(lambda: ("team", "web-0") not in op.endpoints, "the record to be deleted")
        assert op.deleted_endpoints == [("team", "web-0")]
    finally:
        env.cleanup()
        op.stop()


def test_a_del_queued_while_the_agent_serves_is_replayed_without_a_restart(env: Env) -> None:
    a = env.start_agent(cni_del_queue_replay_interval=0.05)
    ns_late, ns_newer = netns(env), netns(env)
    a.attach.Add(add_req(ns_late, "q-late"), timeout=10)
    a.attach.Add(add_req(ns_newer, "q-live"), timeout=10)
    queue = env.tmp / "del-queue"
    now = int(time.time() * 1000)
    stale = queue_del(queue, "q-live", now - 3_600_000)  # older than q-live's Add
    late = queue_del(queue, "q-late", now, ns_late)  # the plugin missed the start-up replay
    wait_for(lambda: not late.exists() and not stale.exists(), "the queue to be replayed")
    eps = a.debug.ListEndpoints(agent_pb2.ListEndpointsRequest()).endpoints
    assert [e.container_id for e in eps] == ["q-live"]
    assert not link_exists(host_ifname("q-late", "eth0"))


def test_a_retried_add_after_an_abandoned_one_gets_a_live_endpoint(env: Env) -> None:
    a = env.start_agent()
    hooks = GateHooks()
    a.agent.endpoints.hooks = hooks
    ns = netns(env)
    used_before = a.debug.Status(agent_pb2.StatusRequest()).pools[0].used
    first = a.attach.Add.future(add_req(ns, "retried"), timeout=30)
    assert hooks.entered.wait(10)
    first.cancel()
    # the runtime retries the ADD while the abandoned one still runs (it waits for the key)
    second = a.attach.Add.future(add_req(ns, "retried"), timeout=30)
    time.sleep(0.2)
    hooks.gate.set()
    r = second.result()
    assert hooks.deleted  # the abandoned endpoint was deleted before the retry saw it
    a.attach.Check(agent_pb2.CheckRequest(container_id="retried", ifname="eth0", netns=ns))
    eps = a.debug.ListEndpoints(agent_pb2.ListEndpointsRequest()).endpoints
    assert [(e.id, e.state) for e in eps] == [(r.endpoint_id, "ready")]
    assert a.debug.Status(agent_pb2.StatusRequest()).pools[0].used == used_before + 1
    assert len(state_files(env)) == 1


def test_a_second_interface_in_a_netns_with_our_eth0_is_refused_cleanly(env: Env) -> None:
    a = env.start_agent()
    ns = netns(env)
    name = ns.rsplit("/", 1)[1]
    a.attach.Add(add_req(ns, "two-if"), timeout=10)
    before = held_ips(a)
    with pytest.raises(grpc.RpcError) as err:
        a.attach.Add(add_req(ns, "two-if", ifname="net1"), timeout=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "already has a default route via eth0" in str(err.value.details())
    assert "second Cilia interface is not supported" in str(err.value.details())
    # Nothing of net1 left behind: no veth on either side, no address held, eth0 intact.
    assert not link_exists(host_ifname("two-if", "net1"))
    links = sh("ip", "-n", name, "-o", "link", "show")
    assert "net1" not in links and "eth0" in links
    assert held_ips(a) == before
    a.attach.Check(agent_pb2.CheckRequest(container_id="two-if", ifname="eth0", netns=ns))


def test_the_agents_own_network_namespace_is_refused_before_anything_is_created(
    env: Env,
) -> None:
    """CNI_NETNS naming the agent's own namespace (/proc/self/ns/net here, the agent runs in
    this process; /proc/1/ns/net on a node) was plumbed like a pod's: only a default route
    already there stopped it ("already has a default route via eth0"); on a host without
    one the pod's address and default route would have gone onto the host."""
    a = env.start_agent()
    before = held_ips(a)
    with pytest.raises(grpc.RpcError) as err:
        a.attach.Add(add_req("/proc/self/ns/net", "hostns"), timeout=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "is the agent's own (the host's), not a pod's" in str(err.value.details())
    assert not link_exists(host_ifname("hostns", "eth0"))
    assert held_ips(a) == before


def test_a_new_pod_waits_for_the_service_stream_and_fails_cleanly_without_it(env: Env) -> None:
    """After a (re)start the Service maps come from the operator's stream: a new pod's Add
    waits until it has synced (so its first connect to a ClusterIP finds the backends), and
    answers UNAVAILABLE, leaving nothing behind, when it does not sync in time."""
    from .fake_operator import FakeOperator

    skips.require_bpf("netns, tc, BPF")
    op = FakeOperator(env.cidr)
    op.services_ready.clear()  # the operator holds its Service listing back
    try:
        a = env.start_agent(
            static={},
            enable_bpf=True,
            operator=op.address,
            operator_reconnect_min_backoff=0.1,
            operator_reconnect_max_backoff=0.5,
            endpoint_service_wait_timeout=4.0,
        )
        wait_for(lambda: a.debug.Status(agent_pb2.StatusRequest()).ready, "agent ready")
        pod = dict(pod_namespace="team", pod_name="web-0", labels={"app": "web"})
        with pytest.raises(grpc.RpcError) as err:
            a.attach.Add(add_req(netns(env), "sb-early", **pod), timeout=30)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "Services not synced" in (err.value.details() or "")
        assert state_files(env) == [] and ("team", "web-0") not in op.endpoints

        result: dict[str, object] = {}

        def add() -> None:
            try:
                result["ok"] = a.attach.Add(add_req(netns(env), "sb-late", **pod), timeout=30)
            except grpc.RpcError as exc:
                result["error"] = exc

        thread = threading.Thread(target=add)
        thread.start()
        time.sleep(1.0)
        assert result == {} and state_files(env) == [], "the Add went on before Services synced"
        op.services_ready.set()
        thread.join(10)
        assert "ok" in result, result
        assert a.agent.lb is not None and a.agent.lb.watcher.synced
    finally:
        env.cleanup()
        op.stop()
