"""``cilia-cni`` under load and under SIGKILL, against the real stack (issue 4, "Must show").

- 50 parallel ADDs then 50 parallel DELs with distinct container ids: no address twice and
  nothing left behind (endpoints, pool usage, host veths, state files, BPF endpoint map and
  ipcache entries read with Debian's ``bpftool``).
- ADD/DEL cycles (up to 1,000; no new one after the time budget) from several workers,
  with random SIGKILLs of the plugin (at a random point of its run) and of the agent
  (restarted as ``scripts/stack.sh`` does; each restart recompiles the datapath, ~10 s).
  The workers behave like containerd: a failed or killed ADD is followed by DEL, a failed
  DEL is retried. A DEL with the agent down is queued on disk and succeeds; the pod's
  interface then stays until the restarted agent replays the queue, so such netns are
  checked once the run is over. Some pods are kept (the survivors). Afterwards every
  survivor reaches the router and a peer, and the agent holds exactly the survivors
  (endpoints, addresses in use, host veths, state files, BPF endpoint map, ipcache).

Knobs (environment; the defaults keep the module within its budget on a 2-core host):

- ``CILIA_E2E_CHAOS_SEED``: RNG seed (default: random, printed);
- ``CILIA_E2E_CHAOS_CYCLES`` (1000): ADD/DEL cycles to run;
- ``CILIA_E2E_CHAOS_SECONDS`` (45): no new cycle starts after this many seconds (the test
  budget; the cycle count reached is printed and recorded as a junit property);
- ``CILIA_E2E_CHAOS_WORKERS`` (4): concurrent runtimes;
- ``CILIA_E2E_CHAOS_AGENT_KILLS`` (5): agent SIGKILLs, spread over the run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import ipaddress
import itertools
import os
import random
import statistics
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from support import POD_CIDR, NodeState, current_stack, dump_logs, node_state, router_ip

from cilia_testkit import cni, host, netns
from cilia_testkit.netns import NetnsRegistry
from cilia_testkit.stack import Stack, StackError

pytestmark = [pytest.mark.e2e, pytest.mark.privileged]

PARALLEL = 50
#: Seconds the node's ipcache may trail the DELs (the operator streams the deletions).
IPCACHE_TRAIL_SECONDS = 10.0
CHAOS_SEED = int(os.environ.get("CILIA_E2E_CHAOS_SEED") or random.SystemRandom().randrange(2**32))
CHAOS_CYCLES = int(os.environ.get("CILIA_E2E_CHAOS_CYCLES", "1000"))
CHAOS_SECONDS = float(os.environ.get("CILIA_E2E_CHAOS_SECONDS", "45"))
CHAOS_WORKERS = int(os.environ.get("CILIA_E2E_CHAOS_WORKERS", "4"))
CHAOS_AGENT_KILLS = int(os.environ.get("CILIA_E2E_CHAOS_AGENT_KILLS", "5"))
# Share of plugin execs SIGKILLed (ADD, DEL), at a uniform point of [0, KILL_WINDOW x the
# median ADD time] after exec.
PLUGIN_KILL_ADD = 0.15
PLUGIN_KILL_DEL = 0.10
KILL_WINDOW = 1.2
# The first FIRST_SURVIVORS successful ADDs keep their pod to the end (they live through
# every agent kill), then a share KEEP_RATE of the others, up to MAX_SURVIVORS pods.
FIRST_SURVIVORS = 4
KEEP_RATE = 0.03
MAX_SURVIVORS = 16
# A runtime retries a failing DEL this long (agent restarts take a few seconds) ...
DEL_RETRY_SECONDS = 90.0
DEL_RETRY_INTERVAL = 0.25
# After a failed ADD the runtime backs off this long before its next sandbox (kubelet does).
ADD_FAIL_BACKOFF = 0.5
# ... and the node may take this long to converge after the last cycle (queued DELs replayed).
SETTLE_SECONDS = 30.0
AGENT_START_SECONDS = 90.0
# An agent kill waits for this many successful ADDs since the previous restart (so every
# restarted agent serves pods before it dies again) ...
ADDS_BETWEEN_AGENT_KILLS = 3
# ... and cycles go on past CHAOS_SECONDS until every kill happened, at most this much longer.
KILL_GRACE_SECONDS = 90.0

_names = itertools.count(1)


def _netns_name(registry: NetnsRegistry, tag: str) -> str:
    return registry.name(f"{tag}{next(_names)}")


@pytest.fixture
def netns_pool(stack: Stack, pods_registry: NetnsRegistry) -> Iterator[Callable[[str], str]]:
    """Factory of fresh netns names (created); every one is deleted at teardown."""
    made: list[str] = []
    lock = threading.Lock()

    def make(tag: str) -> str:
        name = _netns_name(pods_registry, tag)
        netns.create_netns(name)
        with lock:
            made.append(name)
        return name

    yield make
    for name in made:
        netns.delete_netns(name)


def _leaks(
    before: NodeState, after: NodeState, gone_ifindexes: set[int], veths: set[str]
) -> list[str]:
    """What ``after`` holds beyond ``before`` (the pods in between, whose host veths are
    ``veths``, were all deleted). Host veths are matched by name: other test runs on this
    host (private agents) make ``lxc*`` links too."""
    problems = []
    left: dict[str, set[Any]] = {
        "endpoints": set(after.endpoints) - set(before.endpoints),
        "host veths": veths & after.lxc,
        "state files": set(after.state_files - before.state_files),
        "BPF endpoint map entries": set(after.bpf_endpoints) - set(before.bpf_endpoints),
        "BPF endpoint map entries of deleted veths": gone_ifindexes & set(after.bpf_endpoints),
        "ipcache entries": set(after.ipcache_pods) - set(before.ipcache_pods),
    }
    for what, extra in left.items():
        if extra:
            problems.append(f"{what} left: {sorted(extra, key=str)[:5]} ({len(extra)})")
    if after.used != before.used:
        problems.append(f"pool used {after.used}, was {before.used}")
    return problems


def test_fifty_parallel_adds_and_dels_hand_out_no_address_twice_and_leak_nothing(
    conflist: dict[str, Any], netns_pool: Callable[[str], str]
) -> None:
    before = node_state()
    with ThreadPoolExecutor(max_workers=16) as pool:
        names = list(pool.map(lambda _: netns_pool("par"), range(PARALLEL)))
    pods = [cni.Pod(name=n, labels={"app": "stress"}) for n in names]
    assert len({p.container_id for p in pods}) == PARALLEL

    try:
        with ThreadPoolExecutor(max_workers=PARALLEL) as pool:
            added = list(pool.map(lambda p: p.add(conflist), pods))
        failed = [(p.name, o.stdout) for p, o in zip(pods, added, strict=True) if o.returncode]
        assert not failed, f"{len(failed)} ADDs failed, first: {failed[:2]}\n{dump_logs()}"

        ips = [p.ip for p in pods]
        dupes = {ip for ip in ips if ips.count(ip) > 1}
        assert not dupes, f"address handed out twice: {sorted(dupes)}"
        assert all(ipaddress.ip_address(ip) in POD_CIDR for ip in ips), ips
        assert not set(ips) & set(before.endpoints.values()), "a live pod's address reused"
        during = node_state()
        keys = {(p.container_id, p.ifname) for p in pods}
        assert {k: during.endpoints[k] for k in keys} == {
            (p.container_id, p.ifname): p.ip for p in pods
        }, "agent's endpoints differ from the runtime's results"
        assert during.used == before.used + PARALLEL
        ifindexes = {host.link_ifindex(p.host_veth): p for p in pods}
        assert 0 not in ifindexes, "a host veth is missing"
        # The BPF check below is only meaningful if the maps hold the pods while they live.
        assert {i: during.bpf_endpoints[i]["ipv4"] for i in ifindexes} == {
            i: p.ip for i, p in ifindexes.items()
        }, during.bpf_endpoints
        assert {f"{ip}/32" for ip in ips} <= set(during.ipcache_pods)
    finally:
        with ThreadPoolExecutor(max_workers=PARALLEL) as pool:
            deleted = list(pool.map(lambda p: p.delete(conflist), pods))

    failed = [(p.name, o.stdout) for p, o in zip(pods, deleted, strict=True) if o.returncode]
    assert not failed, f"{len(failed)} DELs failed, first: {failed[:2]}\n{dump_logs()}"
    after = node_state()
    veths = {p.host_veth for p in pods}
    # everything the DEL itself removes is gone when it returns; the node's ipcache entries
    # come and go through the operator's WatchIPCache stream, so they may trail the DEL
    leaks = [x for x in _leaks(before, after, set(ifindexes), veths) if "ipcache" not in x]
    assert not leaks, leaks
    deadline = time.monotonic() + IPCACHE_TRAIL_SECONDS
    while (left := set(after.ipcache_pods) - set(before.ipcache_pods)) and (
        time.monotonic() < deadline
    ):
        time.sleep(0.2)
        after = node_state()
    assert not left, (
        f"ipcache entries left {IPCACHE_TRAIL_SECONDS} s after the DELs: {sorted(left)}"
    )
    assert not current_stack().agent.del_queue_files(), "a DEL was queued although the agent was up"
    for pod in pods:
        assert pod.ifname not in netns.netns_links(pod.name), f"{pod.name} keeps its eth0"


# ---------------------------------------------------------------------------------------
# ADD/DEL cycles under SIGKILL.


@dataclasses.dataclass
class Chaos:
    """Shared state of one chaos run (guarded by ``lock``)."""

    conflist: dict[str, Any]
    make_netns: Callable[[str], str]
    deadline: float
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)
    kills_finished: threading.Event = dataclasses.field(default_factory=threading.Event)
    next_cycle: int = 0
    done: int = 0
    add_ok: int = 0
    add_failed: int = 0
    plugin_kills: int = 0
    del_retries: int = 0
    agent_kills: list[int] = dataclasses.field(default_factory=list)
    survivors: list[cni.Pod] = dataclasses.field(default_factory=list)
    container_ids: list[str] = dataclasses.field(default_factory=list)
    parked: list[str] = dataclasses.field(default_factory=list)
    problems: list[str] = dataclasses.field(default_factory=list)
    add_seconds: list[float] = dataclasses.field(default_factory=list)

    def take_cycle(self) -> int | None:
        now = time.monotonic()
        with self.lock:
            if self.next_cycle >= CHAOS_CYCLES or now >= self.deadline + KILL_GRACE_SECONDS:
                return None
            if now >= self.deadline and self.kills_finished.is_set():
                return None
            self.next_cycle += 1
            return self.next_cycle - 1

    def kill_window(self) -> float:
        with self.lock:
            samples = self.add_seconds[-50:]
        median = statistics.median(samples) if len(samples) >= 5 else 0.4
        return KILL_WINDOW * median


def _exec(chaos: Chaos, rng: random.Random, pod: cni.Pod, command: str) -> cni.CniOutcome:
    rate = PLUGIN_KILL_ADD if command == "ADD" else PLUGIN_KILL_DEL
    kill_after = rng.uniform(0, chaos.kill_window()) if rng.random() < rate else None
    call = pod.add if command == "ADD" else pod.delete
    outcome = call(chaos.conflist, kill_after=kill_after)
    with chaos.lock:
        if outcome.killed:
            chaos.plugin_kills += 1
        elif command == "ADD" and outcome.returncode == 0:
            chaos.add_seconds.append(outcome.seconds)
    return outcome


def _cycle(chaos: Chaos, index: int, slot: str) -> str:
    """One sandbox's life in netns ``slot``; returns the slot to use next."""
    rng = random.Random(f"{CHAOS_SEED}/{index}")
    pod = cni.Pod(
        name=slot, labels={"app": "chaos"}, container_id=f"chaos-{os.getpid()}-{index:05d}"
    )
    with chaos.lock:
        chaos.container_ids.append(pod.container_id)
    added = _exec(chaos, rng, pod, "ADD")
    ok = added.returncode == 0 and not added.killed
    with chaos.lock:
        if ok:
            chaos.add_ok += 1
        else:
            chaos.add_failed += 1
        lucky = len(chaos.survivors) < FIRST_SURVIVORS or rng.random() < KEEP_RATE
        keep = ok and len(chaos.survivors) < MAX_SURVIVORS and lucky
        if keep:
            chaos.survivors.append(pod)
    if keep:
        return chaos.make_netns("chs")
    if not ok:
        pod.result = None  # the runtime caches only successful results
        time.sleep(ADD_FAIL_BACKOFF)
    # The runtime's teardown: DEL until it succeeds (containerd retries a failed DEL).
    give_up = time.monotonic() + DEL_RETRY_SECONDS
    while True:
        deleted = _exec(chaos, rng, pod, "DEL")
        if deleted.returncode == 0:
            break
        if time.monotonic() >= give_up:
            with chaos.lock:
                chaos.problems.append(
                    f"cycle {index}: DEL kept failing for {DEL_RETRY_SECONDS:g}s: "
                    f"{deleted.stdout.strip() or deleted.stderr.strip()[-300:]}"
                )
            return chaos.make_netns("chs")
        with chaos.lock:
            chaos.del_retries += 1
        time.sleep(DEL_RETRY_INTERVAL)
    if pod.ifname in netns.netns_links(slot):
        # DEL succeeded but the interface is still there: fine only while a queued DEL
        # waits for the agent; the netns is checked again once the run is over.
        with chaos.lock:
            chaos.parked.append(slot)
        return chaos.make_netns("chs")
    return slot


def _worker(chaos: Chaos) -> None:
    slot = chaos.make_netns("chs")
    while (index := chaos.take_cycle()) is not None:
        try:
            slot = _cycle(chaos, index, slot)
        except Exception as exc:  # recorded, the run goes on: the summary shows them all
            with chaos.lock:
                chaos.problems.append(f"cycle {index}: {type(exc).__name__}: {exc}")
            slot = chaos.make_netns("chs")
        with chaos.lock:
            chaos.done += 1


def _agent_killer(chaos: Chaos, stop: threading.Event, started: float) -> None:
    """SIGKILL the agent CHAOS_AGENT_KILLS times, evenly over cycles or time, and restart it."""
    try:
        _kill_agent_repeatedly(chaos, stop, started)
    finally:
        chaos.kills_finished.set()


def _kill_agent_repeatedly(chaos: Chaos, stop: threading.Event, started: float) -> None:
    rng = random.Random(f"{CHAOS_SEED}/agent")
    budget = chaos.deadline - started
    adds_at_restart = 0
    for k in range(1, CHAOS_AGENT_KILLS + 1):
        share = k / (CHAOS_AGENT_KILLS + 1)

        def due(share: float = share, since: int = adds_at_restart) -> bool:
            with chaos.lock:
                done, adds = chaos.done, chaos.add_ok
            if adds - since < ADDS_BETWEEN_AGENT_KILLS:
                return False
            return done >= CHAOS_CYCLES * share or time.monotonic() - started >= budget * share

        while not due():
            if stop.wait(0.1):
                return
        time.sleep(rng.uniform(0, 0.5))  # a random point of the ADDs/DELs in flight
        try:
            pid = current_stack().kill("agent")
        except RuntimeError as exc:
            with chaos.lock:
                chaos.problems.append(f"agent kill {k}: {exc}")
            continue
        with chaos.lock:
            chaos.agent_kills.append(pid)
        try:
            current_stack().agent.start(timeout=AGENT_START_SECONDS)
        except StackError as exc:
            with chaos.lock:
                chaos.problems.append(f"agent restart {k} failed:\n{str(exc)[-2000:]}")
            return
        with chaos.lock:
            adds_at_restart = chaos.add_ok


@pytest.mark.timeout(CHAOS_SECONDS + KILL_GRACE_SECONDS + 150)
def test_add_del_cycles_with_plugin_and_agent_sigkills_keep_survivors_working_and_exact(
    conflist: dict[str, Any],
    netns_pool: Callable[[str], str],
    record_property: Callable[[str, object], None],
) -> None:
    print(f"chaos seed {CHAOS_SEED} (CILIA_E2E_CHAOS_SEED={CHAOS_SEED} reproduces the choices)")
    before = node_state()
    started = time.monotonic()
    chaos = Chaos(conflist=conflist, make_netns=netns_pool, deadline=started + CHAOS_SECONDS)
    stop = threading.Event()
    killer = threading.Thread(target=_agent_killer, args=(chaos, stop, started), daemon=True)
    try:
        killer.start()
        with ThreadPoolExecutor(max_workers=CHAOS_WORKERS) as pool:
            list(pool.map(lambda _: _worker(chaos), range(CHAOS_WORKERS)))
        stop.set()
        killer.join(AGENT_START_SECONDS + 30)
        cycles_seconds = time.monotonic() - started
        if current_stack().pid("agent") is None:
            current_stack().agent.start(timeout=AGENT_START_SECONDS)
        summary = (
            f"chaos seed={CHAOS_SEED} cycles={chaos.done}/{CHAOS_CYCLES} "
            f"in {cycles_seconds:.1f}s workers={CHAOS_WORKERS} add_ok={chaos.add_ok} "
            f"add_failed={chaos.add_failed} plugin_kills={chaos.plugin_kills} "
            f"agent_kills={len(chaos.agent_kills)} del_retries={chaos.del_retries} "
            f"survivors={len(chaos.survivors)} parked_netns={len(chaos.parked)}"
        )
        print(summary)
        for name, value in (
            ("chaos_seed", CHAOS_SEED),
            ("chaos_cycles", chaos.done),
            ("chaos_plugin_kills", chaos.plugin_kills),
            ("chaos_agent_kills", len(chaos.agent_kills)),
            ("chaos_seconds", round(cycles_seconds, 1)),
        ):
            record_property(name, value)
        assert not chaos.problems, "\n".join([summary, *chaos.problems[:20]]) + dump_logs()
        assert chaos.plugin_kills > 0 and len(chaos.agent_kills) == CHAOS_AGENT_KILLS, summary

        _assert_exactly_the_survivors(before, chaos, summary)
        _assert_survivors_work(chaos.survivors)
    finally:
        stop.set()
        killer.join(AGENT_START_SECONDS + 30)
        if current_stack().pid("agent") is None:
            with contextlib.suppress(StackError):
                current_stack().agent.start(timeout=AGENT_START_SECONDS)
        current = (
            current_stack().agent.conflist()
            if current_stack().agent.conflist_path.exists()
            else conflist
        )
        for pod in chaos.survivors:
            with contextlib.suppress(OSError, subprocess.SubprocessError):
                pod.delete(current, timeout=30)


def _assert_exactly_the_survivors(before: NodeState, chaos: Chaos, summary: str) -> None:
    survivors = {(p.container_id, p.ifname): p for p in chaos.survivors}
    expected_eps = dict(before.endpoints) | {k: p.ip for k, p in survivors.items()}
    # Host veths by name: other test runs on this host make lxc* links of their own.
    ours = {host.host_veth_name(cid) for cid in chaos.container_ids}
    expected_lxc = {p.host_veth for p in survivors.values()}
    expected_used = before.used + len(survivors)

    def converged() -> bool:
        now = node_state()
        return (
            now.endpoints == expected_eps
            and now.used == expected_used
            and now.lxc & ours == expected_lxc
            and len(now.state_files) == len(before.state_files) + len(survivors)
        )

    settled = host.wait_for(converged, SETTLE_SECONDS, interval=1.0)
    after = node_state()
    detail = f"{summary}\n{dump_logs()}"
    extra = set(after.endpoints) - set(expected_eps)
    missing = set(expected_eps) - set(after.endpoints)
    assert not extra, f"agent holds attachments no runtime has: {sorted(extra)[:10]}\n{detail}"
    assert not missing, f"agent lost surviving attachments: {sorted(missing)}\n{detail}"
    assert after.endpoints == expected_eps, "a survivor's address differs from its ADD result"
    assert after.used == expected_used, f"addresses in use {after.used} != {expected_used}"
    assert after.lxc & ours == expected_lxc, (
        f"orphan host veths {sorted((after.lxc & ours) - expected_lxc)[:10]}, "
        f"missing {sorted(expected_lxc - after.lxc)}"
    )
    assert len(after.state_files) == len(before.state_files) + len(survivors), after.state_files
    assert settled
    survivor_ifindexes = {host.link_ifindex(p.host_veth): p.ip for p in survivors.values()}
    new_bpf = {
        i: e["ipv4"] for i, e in after.bpf_endpoints.items() if i not in before.bpf_endpoints
    }
    assert new_bpf == survivor_ifindexes, f"BPF endpoint map {new_bpf} != {survivor_ifindexes}"
    new_ipcache = set(after.ipcache_pods) - set(before.ipcache_pods)
    assert new_ipcache == {f"{p.ip}/32" for p in survivors.values()}, sorted(new_ipcache)
    assert not current_stack().agent.del_queue_files(), (
        f"DELs never replayed: {current_stack().agent.del_queue_files()}"
    )
    leftover = {n: netns.netns_links(n) for n in chaos.parked}
    assert all(links == ["lo"] for links in leftover.values()), f"pod interfaces left {leftover}"


def _assert_survivors_work(survivors: list[cni.Pod]) -> None:
    assert survivors, "no pod survived: raise KEEP_RATE or the cycle count"
    gateway = router_ip()
    checks = [(p.name, gateway) for p in survivors]
    checks += [
        (a.name, b.ip) for a, b in zip(survivors, survivors[1:] + survivors[:1], strict=True)
    ]
    with ThreadPoolExecutor(max_workers=8) as pool:
        results = list(pool.map(lambda c: netns.ping(c[0], c[1], count=2), checks))
    unreachable = [c for c, ok in zip(checks, results, strict=True) if not ok]
    assert not unreachable, f"surviving pods cannot reach {unreachable}"
