import ipaddress

import pytest

from cilia_operator.__main__ import build_parser
from cilia_operator.config import Config
from cilia_operator.ipam.flags import PoolFlagError, parse_auto_create_pools


def test_single_pool_in_upstream_syntax_is_parsed() -> None:
    pools = parse_auto_create_pools(["default=ipv4-cidrs:10.200.0.0/16;ipv4-mask-size:24"])
    spec = pools["default"]
    assert spec.cidrs == (ipaddress.IPv4Network("10.200.0.0/16"),)
    assert spec.mask_size == 24
    assert not spec.allow_first_ip and not spec.allow_last_ip


def test_several_pools_separated_by_spaces_and_repeated_flags_are_parsed() -> None:
    pools = parse_auto_create_pools(
        [
            "a=ipv4-cidrs:10.1.0.0/24,10.2.0.0/24;ipv4-mask-size:26;allow-first-ip:true"
            " b=ipv4-cidrs:10.3.0.0/16;ipv4-mask-size:24;allow-last-ip:TRUE",
            "c=ipv4-cidrs:10.4.0.0/16;ipv4-mask-size:20",
        ]
    )
    assert list(pools) == ["a", "b", "c"]
    assert [str(c) for c in pools["a"].cidrs] == ["10.1.0.0/24", "10.2.0.0/24"]
    assert pools["a"].allow_first_ip and pools["b"].allow_last_ip


@pytest.mark.parametrize(
    ("value", "names"),
    [
        ("default", "entry 'default'"),
        ("p=ipv4-cidrs:10.0.0.0/16", "missing ipv4-mask-size"),
        ("p=ipv4-mask-size:24", "missing ipv4-cidrs"),
        ("p=ipv4-cidrs:10.0.0.0/16;ipv4-mask-size:x", "part 'ipv4-mask-size:x'"),
        ("p=ipv4-cidrs:10.0.0.0/16;ipv4-mask-size:24;allow-first-ip:yes", "allow-first-ip:yes"),
        ("p=ipv4-cidrs:10.0.0.0/16;ipv4-mask-size:24;colour:blue", "unknown key 'colour'"),
        ("p=ipv4-cidrs:10.0.0.0/16,;ipv4-mask-size:24", "empty CIDR"),
        ("p=ipv4-cidrs:10.0.0.1/16;ipv4-mask-size:24", "spec.ipv4.cidrs[0]"),
        ("p=ipv4-cidrs:10.0.0.0/16;ipv4-mask-size:8", "spec.ipv4.maskSize"),
        ("p=ipv4-cidrs:10.0.0.0/16;ipv4-mask-size:33", "spec.ipv4.maskSize"),
        ("p=ipv6-cidrs:fd00::/64;ipv6-mask-size:120", "IPv6"),
        (
            "p=ipv4-cidrs:10.0.0.0/16;ipv4-mask-size:24 p=ipv4-cidrs:10.1.0.0/16;ipv4-mask-size:24",
            "given twice",
        ),
        (
            "a=ipv4-cidrs:10.0.0.0/16;ipv4-mask-size:24 b=ipv4-cidrs:10.0.4.0/24;ipv4-mask-size:26",
            "overlaps pool 'b' CIDR 10.0.4.0/24",
        ),
    ],
)
def test_bad_pool_flag_is_rejected_naming_the_part(value: str, names: str) -> None:
    with pytest.raises(PoolFlagError) as err:
        parse_auto_create_pools([value])
    assert names in str(err.value)
    assert "--auto-create-cilium-pod-ip-pools" in str(err.value)


def test_serve_flags_from_the_brief_parse_into_a_config() -> None:
    args = build_parser().parse_args(
        [
            "serve",
            "--store",
            "redis://127.0.0.1:6390/0",
            "--listen",
            "127.0.0.1:4250",
            "--prometheus-serve-addr",
            ":9963",
            "--auto-create-cilium-pod-ip-pools",
            "default=ipv4-cidrs:10.200.0.0/16;ipv4-mask-size:24",
            "--ipam-default-ip-pool",
            "default",
            "--log-level",
            "info",
        ]
    )
    config = Config(
        store=args.store,
        listen=args.listen,
        prometheus_serve_addr=args.prometheus_serve_addr,
        auto_create_cilium_pod_ip_pools=args.auto_create_cilium_pod_ip_pools,
        ipam_default_ip_pool=args.ipam_default_ip_pool,
        log_level=args.log_level,
    )
    assert config.auto_create_pools["default"].mask_size == 24
    assert args.store_event_history == 10000


def test_serve_with_bad_flag_exits_2_with_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    from cilia_operator.__main__ import main

    status = main(
        ["serve", "--auto-create-cilium-pod-ip-pools", "x=ipv4-cidrs:bad;ipv4-mask-size:24"]
    )
    err = capsys.readouterr().err
    assert status == 2
    assert err.count("\n") == 1 and "Traceback" not in err
    assert "pool 'x'" in err and "spec.ipv4.cidrs[0]" in err


def test_serve_with_bad_store_url_names_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    from cilia_operator.__main__ import main

    assert main(["serve", "--store", "http://x"]) == 2
    assert "--store" in capsys.readouterr().err


def test_version_flag_prints_the_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.startswith("cilia-operator 0.1.0")


def test_identity_flags_default_to_upstream_values_and_take_go_durations() -> None:
    defaults = build_parser().parse_args(["serve"])
    assert defaults.identity_gc_interval == 900.0
    assert defaults.identity_heartbeat_timeout == 1800.0
    assert defaults.identity_gc_rate_interval == 60.0
    assert defaults.identity_gc_rate_limit == 2500
    assert defaults.identity_max_id == 65535
    args = build_parser().parse_args(
        ["serve", "--identity-gc-interval", "0", "--identity-heartbeat-timeout", "1h30m"]
    )
    assert (args.identity_gc_interval, args.identity_heartbeat_timeout) == (0.0, 5400.0)


def test_bad_identity_flags_exit_2_naming_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    from cilia_operator.__main__ import main

    assert main(["serve", "--identity-max-id", "255"]) == 2
    assert "--identity-max-id" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        main(["serve", "--identity-gc-interval", "soon"])
    assert exit_.value.code == 2
    assert "--identity-gc-interval" in capsys.readouterr().err


def test_mask_leaving_no_pod_address_exits_2_naming_the_flag(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from cilia_operator.__main__ import main

    cluster = ["serve", "--ipam", "cluster-pool", "--cluster-pool-ipv4-cidr", "10.0.0.0/16"]
    assert main([*cluster, "--cluster-pool-ipv4-mask-size", "32"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert "--cluster-pool-ipv4-mask-size: 32" in err and "no pod address left" in err
    pools = [
        "serve",
        "--auto-create-cilium-pod-ip-pools",
        "default=ipv4-cidrs:10.0.0.0/24;ipv4-mask-size:32",
    ]
    assert main(pools) == 2
    err = capsys.readouterr().err
    assert "pool 'default'" in err and "spec.ipv4.maskSize: 32" in err and "router IP" in err


def test_store_and_shutdown_times_take_go_durations_and_bare_seconds() -> None:
    args = build_parser().parse_args(
        ["serve", "--shutdown-timeout", "5s", "--shutdown-grace-period", "1m",
         "--store-request-timeout", "2.5", "--store-connect-timeout", "500ms"]
    )  # fmt: skip
    assert (args.shutdown_timeout, args.shutdown_grace_period) == (5.0, 60.0)
    assert (args.store_request_timeout, args.store_connect_timeout) == (2.5, 0.5)
    defaults = build_parser().parse_args(["serve"])
    assert (defaults.shutdown_timeout, defaults.store_retry_interval) == (5.0, 1.0)
