"""Masquerade: the flags, the chain a plan gives, the ip-masq-agent file."""

from __future__ import annotations

import pathlib

import pytest
from pydantic import ValidationError

from cilia_agent.config import Config
from cilia_agent.masquerade import ctstats, ipmasq
from cilia_agent.masquerade.rules import chain_rules, make_plan, restore_input


def test_flags_default_as_upstream_and_bad_values_are_refused_with_the_flag_named() -> None:
    c = Config()
    assert c.enable_ipv4_masquerade is True
    assert c.enable_bpf_masquerade is False
    assert c.ipv4_native_routing_cidr == "" and c.egress_masquerade_interfaces == []
    assert c.ip_masq_agent_config_path == pathlib.Path("/etc/config/ip-masq-agent")
    c = Config(ipv4_native_routing_cidr="10.0.0.0/8", egress_masquerade_interfaces="eth0,bond+")
    assert c.ipv4_native_routing_cidr == "10.0.0.0/8"
    assert c.egress_masquerade_interfaces == ["eth0", "bond+"]
    for field, value, words in (
        ("ipv4_native_routing_cidr", "10.0.0.1/8", "ipv4-native-routing-cidr"),
        ("ipv4_native_routing_cidr", "fd00::/64", "ipv4-native-routing-cidr"),
        ("egress_masquerade_interfaces", "eth 0", "egress-masquerade-interfaces"),
        ("enable_ipv4_masquerade", "maybe", "enable_ipv4_masquerade"),
    ):
        with pytest.raises(ValidationError, match=words):
            Config(**{field: value})


def test_bpf_masquerade_needs_the_nodeport_programs_and_its_own_devices() -> None:
    c = Config(enable_bpf_masquerade="true")
    assert c.bpf_masquerade_enabled and c.nat_port_range == (32768, 65535)
    assert c.bpf_nat_masquerade_timeout == 600.0 and c.bpf_masquerade_gc_interval == 30.0
    assert not Config(
        enable_bpf_masquerade=True, enable_ipv4_masquerade=False
    ).bpf_masquerade_enabled
    for kw, words in (
        ({"enable_node_port": False}, "turn on --enable-node-port"),
        ({"kube_proxy_replacement": "false"}, "turn on --kube-proxy-replacement"),
        ({"enable_bpf": False, "bpf_lb_sock": False}, "turn on --enable-bpf, --bpf-lb-sock"),
        ({"egress_masquerade_interfaces": ["eth0"]}, "BPF masquerade runs on --devices"),
    ):
        with pytest.raises(ValidationError, match=words):
            Config(enable_bpf_masquerade=True, **kw)  # type: ignore[arg-type]
    # without masquerade at all the BPF flag asks for nothing
    Config(enable_bpf_masquerade=True, enable_ipv4_masquerade=False, enable_node_port=False)


@pytest.mark.parametrize("value", ["1000-65535", "40000-30000", "40000", "a-b", "60000-60100"])
def test_a_bad_nat_port_range_is_refused_with_the_flag_named(value: str) -> None:
    with pytest.raises(ValidationError, match="--bpf-nat-port-range"):
        Config(bpf_nat_port_range=value)
    assert Config(bpf_nat_port_range=" 40000-50000").nat_port_range == (40000, 50000)


def test_plan_collapses_and_orders_exclusions_before_masquerade_rules() -> None:
    plan = make_plan(
        ["10.1.1.0/24", "10.1.0.0/24", "fd00::/64"],
        ["10.1.0.0/24", "10.1.1.0/24", "10.2.0.0/24", "10.0.0.0/8", "bad"],
        ["eth0", "eth1", "eth0"],
    )
    assert plan.sources == ("10.1.0.0/23",)
    assert plan.exclusions == ("10.0.0.0/8",)  # everything else lies inside it
    assert plan.devices == ("eth0", "eth1")
    assert chain_rules(plan) == [
        ["-d", "10.0.0.0/8", "-m", "comment", "--comment", "cilia: no masquerade", "-j", "RETURN"],
        ["-s", "10.1.0.0/23", "-o", "eth0", "-m", "comment", "--comment", "cilia: masquerade",
         "-j", "MASQUERADE", "--random-fully"],
        ["-s", "10.1.0.0/23", "-o", "eth1", "-m", "comment", "--comment", "cilia: masquerade",
         "-j", "MASQUERADE", "--random-fully"],
    ]  # fmt: skip


def test_no_device_masquerades_on_every_device_and_no_source_gives_only_exclusions() -> None:
    rules = chain_rules(make_plan(["10.1.0.0/24"], [], []))
    assert rules == [["-s", "10.1.0.0/24", "-m", "comment", "--comment", "cilia: masquerade",
                      "-j", "MASQUERADE", "--random-fully"]]  # fmt: skip
    assert chain_rules(make_plan([], ["10.9.0.0/16"], ["eth0"]))[0][:2] == ["-d", "10.9.0.0/16"]
    assert len(chain_rules(make_plan([], ["10.9.0.0/16"], ["eth0"]))) == 1


def test_restore_input_empties_the_chain_and_refills_it_in_one_commit() -> None:
    text = restore_input("CILIA_POST_nat", [["-s", "10.1.0.0/24", "-m", "comment", "--comment",
                                              "cilia: masquerade", "-j", "MASQUERADE"]])  # fmt: skip
    assert text.splitlines() == [
        "*nat",
        ":CILIA_POST_nat - [0:0]",
        '-A CILIA_POST_nat -s 10.1.0.0/24 -m comment --comment "cilia: masquerade" -j MASQUERADE',
        "COMMIT",
    ]


def test_ip_masq_agent_file_absent_empty_or_listed(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "ip-masq-agent"
    conf = ipmasq.load(path)
    assert conf.non_masquerade_cidrs == ipmasq.DEFAULT_NON_MASQ_CIDRS
    assert "169.254.0.0/16" in conf.exclusions() and "absent" in conf.source
    path.write_text("nonMasqueradeCIDRs: []\nmasqLinkLocal: true\n")
    conf = ipmasq.load(path)
    assert conf.non_masquerade_cidrs == ipmasq.DEFAULT_NON_MASQ_CIDRS
    assert "169.254.0.0/16" not in conf.exclusions()
    path.write_text('{"nonMasqueradeCIDRs": ["192.0.2.7/32", "10.8.0.1/16", "fd00::/8"]}')
    conf = ipmasq.load(path)
    assert conf.non_masquerade_cidrs == ("192.0.2.7/32", "10.8.0.0/16")
    assert conf.exclusions() == ("192.0.2.7/32", "10.8.0.0/16", "169.254.0.0/16")


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("- 10.0.0.0/8\n", "expected a mapping"),
        ("nonMasqueradeCIDRs: [10.0.0.0/33]\n", "10.0.0.0/33"),
        ("nonMasqueradeCIDRs: 10.0.0.0/8\n", "must be a list"),
        ("masqLinkLocal: yes please\n", "masqLinkLocal"),
        ("nonMasqCIDRs: [10.0.0.0/8]\n", "unknown keys"),
        ("nonMasqueradeCIDRs: [\n", "not YAML"),
    ],
)
def test_ip_masq_agent_file_errors_name_the_problem(
    tmp_path: pathlib.Path, text: str, words: str
) -> None:
    path = tmp_path / "ip-masq-agent"
    path.write_text(text)
    with pytest.raises(ipmasq.IPMasqConfigError, match=words):
        ipmasq.load(path)


STAT = """entries  clashres found new invalid ignore delete chainlength insert insert_failed drop early_drop icmp_error  expect_new expect_create expect_delete search_restart
000003fa  00000000 00000000 00000000 00000001 00000000 00000000 00000000 00000000 0000000a 00000003 00000001 00000000  00000000 00000000 00000000 00000000
000003fa  00000000 00000000 00000000 00000000 00000000 00000000 00000000 00000000 00000010 00000002 00000000 00000000  00000000 00000000 00000000 00000000
"""


def test_conntrack_failure_counters_sum_the_cpus_and_a_missing_file_gives_none(
    tmp_path: pathlib.Path,
) -> None:
    from prometheus_client import CollectorRegistry

    totals = ctstats.parse(STAT)
    assert (totals["insert_failed"], totals["drop"], totals["early_drop"]) == (26, 5, 1)
    path = tmp_path / "nf_conntrack"
    path.write_text(STAT)
    registry = CollectorRegistry()
    registry.register(ctstats.NfConntrackStats(path))
    assert registry.get_sample_value("cilia_nf_conntrack_insert_failed_total") == 26
    assert registry.get_sample_value("cilia_nf_conntrack_drop_total") == 5
    path.unlink()
    assert registry.get_sample_value("cilia_nf_conntrack_drop_total") is None
    with pytest.raises(ValueError, match="entries"):
        ctstats.parse("garbage 1 2\n")
