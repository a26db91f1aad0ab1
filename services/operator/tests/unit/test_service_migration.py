"""ServiceCIDR migration (issue 13 item 4): the plan's refusals, the steps and their
resumption, and the release of idle aliases -- on in-memory snapshots, no store."""

from __future__ import annotations

import datetime
import ipaddress
import json
from typing import Any

import pytest

from cilia_operator.controlplane.service import service_message
from cilia_operator.service import aliases, allocation, migration, model
from cilia_operator.store import ListResult, Write

T0 = datetime.datetime(2026, 12, 2, 1, 0, tzinfo=datetime.UTC)
NET = ipaddress.IPv4Network


def svc(name: str, ip: str, ns: str = "default") -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Service",
            "metadata": {"name": name, "namespace": ns, "resourceVersion": "1"},
            "spec": {"clusterIP": ip, "clusterIPs": [ip], "type": "ClusterIP",
                     "ports": [{"port": 53, "protocol": "UDP", "targetPort": 53}]}}  # fmt: skip


def cidr(name: str, net: str) -> dict[str, Any]:
    return {"apiVersion": model.CIDR_API_VERSION, "kind": model.CIDR_KIND,
            "metadata": {"name": name, "resourceVersion": "1"}, "spec": {"cidrs": [net]}}  # fmt: skip


class World:
    """A stand-in store: objects by (kind, namespace, name); snapshots; writes applied."""

    def __init__(self, *objs: dict[str, Any]) -> None:
        self.objs: dict[tuple[str, str, str], dict[str, Any]] = {}
        for obj in objs:
            self.put(obj)

    def put(self, obj: dict[str, Any]) -> None:
        meta = obj["metadata"]
        self.objs[(obj["kind"], meta.get("namespace", ""), meta["name"])] = json.loads(
            json.dumps(obj)
        )

    def apply(self, writes: list[Write]) -> None:
        for w in writes:
            assert (
                w.op == "update" or (w.obj["kind"], "", w.obj["metadata"]["name"]) not in self.objs
            )
            self.put(w.obj)

    def snap(self) -> dict[str, ListResult]:
        out: dict[str, ListResult] = {}
        for (kind, _, _), obj in sorted(self.objs.items()):
            out.setdefault(kind, ListResult([], "1")).items.append(json.loads(json.dumps(obj)))
        return out

    def get(self, kind: str, name: str, ns: str = "") -> dict[str, Any]:
        return self.objs[(kind, ns, name)]


def dns_world() -> World:
    return World(
        cidr("kubernetes", "10.96.0.0/28"),
        svc("kube-dns", "10.96.0.10", "kube-system"),
        svc("web", "10.96.0.3"),
        svc("api", "10.96.0.4"),
        migration.migration_record(NET("10.100.0.0/24"), grace=60.0),
    )


@pytest.mark.parametrize(("target", "named"), [
    ("10.200.0.0/24", ["target 10.200.0.0/24", "pod pool 'default' CIDR 10.200.0.0/16"]),
    ("10.130.0.0/16", ["target 10.130.0.0/16", "cluster-pool pod CIDR 10.128.0.0/14"]),
    ("127.1.0.0/16", ["target 127.1.0.0/16", "special-purpose range 127.0.0.0/8 (loopback)"]),
    ("10.96.0.0/24", ["target 10.96.0.0/24", "ServiceCIDR kubernetes 10.96.0.0/28"]),
])  # fmt: skip
def test_a_target_overlapping_a_pod_range_or_special_range_is_refused_naming_both(
    target: str, named: list[str]
) -> None:
    pools = migration.pool_ranges([{"metadata": {"name": "default"},
                                    "spec": {"ipv4": {"cidrs": ["10.200.0.0/16"]}}}])  # fmt: skip
    with pytest.raises(migration.MigrationRefused) as err:
        migration.plan_migration(
            [svc("web", "10.96.0.3")], [cidr("kubernetes", "10.96.0.0/28")], NET(target),
            pools=pools, pod_cidrs=[NET("10.128.0.0/14")],
        )  # fmt: skip
    for text in named:
        assert text in str(err.value)


def test_a_refused_target_fails_the_record_and_writes_nothing_else() -> None:
    w = World(cidr("kubernetes", "10.96.0.0/28"), svc("web", "10.96.0.3"),
              {"kind": migration.POOL_KIND, "metadata": {"name": "p"},
               "spec": {"ipv4": {"cidrs": ["10.100.0.0/16"]}}},
              migration.migration_record(NET("10.100.0.0/24")))  # fmt: skip
    writes = migration.start_writes(w.snap(), T0)
    assert [x.obj["kind"] for x in writes] == [migration.KIND]
    status = writes[0].obj["status"]
    assert status["phase"] == "Failed" and "pod pool 'p' CIDR 10.100.0.0/16" in status["message"]


def test_moves_keep_the_offset_and_resume_after_an_interruption_with_the_same_plan() -> None:
    w = dns_world()
    planned = migration.plan_migration(
        [o for (k, _, _), o in w.objs.items() if k == "Service"],
        [w.get(model.CIDR_KIND, "kubernetes")], NET("10.100.0.0/24"),
    )  # fmt: skip
    want = {m.service: (str(m.old), str(m.new)) for m in planned.moves}
    assert want["kube-system/kube-dns"] == ("10.96.0.10", "10.100.0.10")
    w.apply(migration.start_writes(w.snap(), T0))
    target = w.get(model.CIDR_KIND, "migrated-10-100-0-0-24")
    assert target["metadata"]["annotations"][model.MIGRATED_FROM_ANNOTATION] == "10.96.0.0/28"
    assert model.cidr_terminating(w.get(model.CIDR_KIND, "kubernetes"))
    assert migration.start_writes(w.snap(), T0) == []  # idempotent
    writes, first = migration.move_writes(w.snap(), T0)
    assert first is not None
    w.apply(writes)
    # interrupted here: the next leader plans what is left from the store alone
    done = {first.service: (str(first.old), str(first.new))}
    while True:
        writes, move = migration.move_writes(w.snap(), T0 + datetime.timedelta(seconds=1))
        w.apply(writes)
        if move is None:
            break
        assert move.service not in done  # never moved twice
        done[move.service] = (str(move.old), str(move.new))
    assert done == want
    record = w.get(migration.KIND, migration.NAME)
    assert migration.phase(record) == "Aliased"
    assert {k: (v["old"], v["new"]) for k, v in record["status"]["services"].items()} == want
    dns = w.get("Service", "kube-dns", "kube-system")
    assert dns["spec"]["clusterIP"] == "10.100.0.10"
    assert list(model.alias_ips(dns)) == [ipaddress.IPv4Address("10.96.0.10")]
    message = service_message(dns, [])
    assert message is not None
    assert list(message.cluster_ips) == ["10.100.0.10"] and list(message.alias_ips) == [
        "10.96.0.10"
    ]
    # the old range stays terminating while aliases hold addresses in it
    services = [o for (k, _, _), o in w.objs.items() if k == "Service"]
    cidrs = [o for (k, _, _), o in w.objs.items() if k == model.CIDR_KIND]
    old = w.get(model.CIDR_KIND, "kubernetes")
    assert len(allocation.cidr_holders(old, services, cidrs)) == 3


def test_an_alias_is_released_only_after_the_grace_period_without_use_anywhere() -> None:
    w = dns_world()
    w.apply(migration.start_writes(w.snap(), T0))
    while (step := migration.move_writes(w.snap(), T0))[1] is not None:
        w.apply(step[0])
    w.apply(step[0])
    # node-b used the DNS alias 10 s before T0+50 s; node-a reported nothing used
    w.put(aliases.record_use(None, "node-a", [("10.96.0.10", False, 0)],
                             T0 + datetime.timedelta(seconds=50)))  # fmt: skip
    w.put(aliases.record_use(None, "node-b", [("10.96.0.10", True, 10_000)],
                             T0 + datetime.timedelta(seconds=50)))  # fmt: skip
    # an older report of a use never moves the time back
    later = aliases.record_use(w.get(aliases.USE_KIND, "node-b"), "node-b",
                               [("10.96.0.10", True, 3_600_000)],
                               T0 + datetime.timedelta(seconds=55))  # fmt: skip
    assert later["status"]["lastUsed"]["10.96.0.10"] == model.rfc3339(
        T0 + datetime.timedelta(seconds=40)
    )
    w.put(later)
    # at T0+59 s nothing is idle for the record's 60 s
    writes, released = migration.release_writes(w.snap(), T0 + datetime.timedelta(seconds=59), 1)
    assert released == []
    # at T0+61 s web and api (never used) go; kube-dns (used at T0+40 s) stays
    writes, released = migration.release_writes(w.snap(), T0 + datetime.timedelta(seconds=61), 1)
    assert sorted(v.service for v in released) == ["default/api", "default/web"]
    w.apply(writes)
    assert model.alias_ips(w.get("Service", "web", "default")) == {}
    entries = w.get(migration.KIND, migration.NAME)["status"]["services"]
    assert entries["default/web"]["released"] is True
    assert entries["kube-system/kube-dns"]["released"] is False
    assert entries["kube-system/kube-dns"]["lastUsed"] == model.rfc3339(
        T0 + datetime.timedelta(seconds=40)
    )
    writes, released = migration.release_writes(w.snap(), T0 + datetime.timedelta(seconds=101), 1)
    assert [v.service for v in released] == ["kube-system/kube-dns"]
    w.apply(writes)
    # the old ServiceCIDR is held by nothing now; once the controller deleted it: Done
    assert migration.phase(w.get(migration.KIND, migration.NAME)) == "Aliased"
    del w.objs[(model.CIDR_KIND, "", "kubernetes")]
    writes, _ = migration.release_writes(w.snap(), T0 + datetime.timedelta(seconds=102), 1)
    w.apply(writes)
    assert migration.phase(w.get(migration.KIND, migration.NAME)) == "Done"


def test_a_finished_migration_retires_the_flag_range_and_updates_keep_their_aliases() -> None:
    new = cidr("migrated", "10.100.0.0/24")
    new["metadata"]["annotations"] = {model.MIGRATED_FROM_ANNOTATION: "10.96.0.0/28"}
    active, _ = allocation.service_cidr_ranges([new], [NET("10.96.0.0/28")])
    assert active == [("migrated", NET("10.100.0.0/24"))]
    stored = model.with_aliases(svc("web", "10.100.0.3"), {ipaddress.IPv4Address("10.96.0.3"): ""})
    snap = {"Service": ListResult([stored], "1"), model.CIDR_KIND: ListResult([new], "1")}
    update = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "web", "namespace": "default"},
              "spec": {"ports": [{"port": 80}], "selector": {"app": "web"}}}  # fmt: skip
    other = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "x", "namespace": "default"},
             "spec": {"clusterIP": "10.96.0.3", "ports": [{"port": 80}], "selector": {"a": "b"}}}  # fmt: skip
    docs = [allocation.ServiceDoc(0, "Service", "default", "web", update),
            allocation.ServiceDoc(1, "Service", "default", "x", other)]  # fmt: skip
    errors = allocation.prepare(docs, snap, allocation.ServiceSettings((NET("10.96.0.0/28"),)))
    assert list(model.alias_ips(update)) == [ipaddress.IPv4Address("10.96.0.3")]
    assert [(i, e.path) for i, e in errors] == [(1, "spec.clusterIP")]  # the alias is held


def test_a_moved_service_deleted_before_its_release_does_not_hold_the_migration() -> None:
    w = dns_world()
    w.apply(migration.start_writes(w.snap(), T0))
    while (step := migration.move_writes(w.snap(), T0))[1] is not None:
        w.apply(step[0])
    w.apply(step[0])
    for name, ns in (("web", "default"), ("api", "default"), ("kube-dns", "kube-system")):
        del w.objs[("Service", ns, name)]
    del w.objs[(model.CIDR_KIND, "", "kubernetes")]  # released by the controller: unheld
    writes, released = migration.release_writes(w.snap(), T0 + datetime.timedelta(seconds=1), 1)
    w.apply(writes)
    record = w.get(migration.KIND, migration.NAME)
    assert released == [] and migration.phase(record) == "Done"
    assert all(e["released"] for e in record["status"]["services"].values())


def test_a_hand_written_alias_list_is_served_as_alias_ips_and_never_judged_idle() -> None:
    """With --store kubernetes the migration cannot move ``default/kubernetes``; an alias
    listed by hand on the re-created Service is served from the datapath, and not released
    automatically (it has no time it became an alias)."""
    api = svc("kubernetes", "10.112.0.1")
    api["metadata"]["annotations"] = {model.ALIAS_ANNOTATION: '["10.96.0.1"]'}
    message = service_message(api, [])
    assert message is not None and list(message.alias_ips) == ["10.96.0.1"]
    (verdict,) = aliases.judge([api], [], T0, 1.0)
    assert verdict.release is False and verdict.ip == ipaddress.IPv4Address("10.96.0.1")


@pytest.mark.parametrize("command", ["get", "delete"])
def test_get_and_delete_help_list_the_service_kinds(command: str) -> None:
    from cilia_operator.__main__ import build_parser

    sub = next(a for a in build_parser()._actions if a.dest == "command")
    assert isinstance(sub.choices, dict)
    text = sub.choices[command].format_help()
    for kind in ("services|svc", "endpointslices", "servicecidrs", "ciliaservicecidrmigrations"):
        assert kind in " ".join(text.split()), text


def test_ctrl_c_on_migrate_says_the_operator_carries_on(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from cilia_operator import cli
    from cilia_operator.__main__ import main

    def interrupted(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "servicecidr_migrate", interrupted)
    code = main(["servicecidr", "migrate", "--to", "10.200.0.0/16", "--server", "127.0.0.1:1"])
    assert code == 130
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert "the operator carries on" in err and "servicecidr status" in err
