"""Policy audit mode in bpf/bpf_lxc.c through BPF_PROG_TEST_RUN: an endpoint whose map
entry has ``policy_audit`` set forwards what its policy would drop (default deny and an
explicit deny rule alike), reports each such new flow once as a policy-verdict event with
verdict AUDIT, and counts nothing as dropped; cleared, the same packets drop.

Uses cilia_agent.testing.bpf (bpf_lxc.o loaded with libbpf, maps pinned under
/sys/fs/bpf/cilia-test-<rand>, removed afterwards; the program sees ifindex 1).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from cilia_agent.hubble import events
from cilia_agent.hubble.metrics import read_counters
from cilia_agent.testing import bpf as bpf_harness
from cilia_testkit import skips

pytestmark = pytest.mark.privileged

BACKEND_IP, FRONTEND_IP, OTHER_IP = "10.251.0.10", "10.251.0.20", "10.251.0.30"
EP_ID, BACKEND, FRONTEND, OTHER = 42, 1001, 1000, 1002
TO = "cil_to_container"


@pytest.fixture
def dp() -> Iterator[Any]:
    skips.require_bpf("BPF_PROG_TEST_RUN")
    datapath = bpf_harness.load()
    try:
        yield datapath
    finally:
        bpf_harness.unload(datapath)


def _drops(dp: Any) -> dict[int, int]:
    return {c.reason: sum(c.packets) for c in read_counters(dp.agent.metrics_map) if c.reason}


def test_audit_forwards_would_be_drops_reports_audit_once_and_enforces_when_cleared(
    dp: Any,
) -> None:
    h = bpf_harness
    for ip, ident in ((FRONTEND_IP, FRONTEND), (OTHER_IP, OTHER)):
        dp.agent.ipcache_map[h.IpcacheKey(32, h.ip_to_map(ip))] = h.IpcacheValue(ident, 0)
    h.endpoint(dp, EP_ID, BACKEND, BACKEND_IP, ingress=True, audit=True)
    h.rule(dp, EP_ID, FRONTEND, h.DIR_INGRESS, 6, 8080)
    h.rule(dp, EP_ID, OTHER, h.DIR_INGRESS, deny=True)

    pkt = h.packet
    assert dp.run(TO, pkt(FRONTEND_IP, BACKEND_IP, sport=1, dport=8080)) == h.TC_ACT_OK
    assert dp.run(TO, pkt(FRONTEND_IP, BACKEND_IP, sport=2, dport=9090)) == h.TC_ACT_OK
    assert dp.run(TO, pkt(OTHER_IP, BACKEND_IP, sport=3, dport=8080)) == h.TC_ACT_OK
    # the audited flow's next packet passes through conntrack: no second AUDIT
    assert dp.run(TO, pkt(FRONTEND_IP, BACKEND_IP, sport=2, dport=9090)) == h.TC_ACT_OK
    audits = [
        (e.sport, e.drop_reason, e.direction)
        for e in dp.events
        if e.verdict == events.VERDICT_AUDIT
    ]
    assert audits == [(2, 133, h.DIR_INGRESS), (3, 181, h.DIR_INGRESS)]
    assert all(
        e.event_type == events.EVENT_POLICY_VERDICT
        for e in dp.events
        if e.verdict == events.VERDICT_AUDIT
    )
    assert not [e for e in dp.events if e.verdict == events.VERDICT_DROPPED]
    assert _drops(dp) == {}, "nothing counted as dropped while auditing"

    # audit cleared (the agent restarted with --policy-audit-mode false): the same kinds of
    # new flows drop with the reasons they were audited with
    h.endpoint(dp, EP_ID, BACKEND, BACKEND_IP, ingress=True, audit=False)
    dp.events.clear()
    assert dp.run(TO, pkt(FRONTEND_IP, BACKEND_IP, sport=11, dport=8080)) == h.TC_ACT_OK
    assert dp.run(TO, pkt(FRONTEND_IP, BACKEND_IP, sport=12, dport=9090)) == h.TC_ACT_SHOT
    assert dp.run(TO, pkt(OTHER_IP, BACKEND_IP, sport=13, dport=8080)) == h.TC_ACT_SHOT
    assert [(e.sport, e.drop_reason) for e in dp.events if e.verdict == 2] == [
        (12, 133),
        (13, 181),
    ]
    assert not [e for e in dp.events if e.verdict == events.VERDICT_AUDIT]
    assert _drops(dp) == {133: 1, 181: 1}
