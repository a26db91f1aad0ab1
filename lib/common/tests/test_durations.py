"""The one duration grammar: Go's time.ParseDuration, non-negative, plus bare seconds."""

from __future__ import annotations

import argparse

import pytest

from cilia_common.durations import duration_arg, format_seconds, go_duration_arg, parse_duration


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("300ms", 0.3),
        ("1.5s", 1.5),
        ("2m30s", 150.0),
        ("1h", 3600.0),
        ("1h30m", 5400.0),
        ("30m0s", 1800.0),
        ("15m", 900.0),
        ("500ms", 0.5),
        ("250us", 0.00025),
        ("250µs", 0.00025),
        ("100ns", 1e-7),
        (".5s", 0.5),
        ("0", 0.0),
        ("0s", 0.0),
        (" 10s ", 10.0),
        ("0.5", 0.5),
        ("10", 10.0),
        ("2.5", 2.5),
    ],
)
def test_go_durations_and_bare_seconds_are_parsed(text: str, seconds: float) -> None:
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["", "m", "15 m", "-1s", "-1", "1d", "1.2.3s", "s1", "inf", "nan"])
def test_bad_durations_are_refused(text: str) -> None:
    with pytest.raises(ValueError, match=r"duration|negative"):
        parse_duration(text)


def test_the_error_names_the_flag() -> None:
    with pytest.raises(ValueError) as err:
        parse_duration("-1", flag="--identity-gc-interval")
    assert str(err.value).startswith("--identity-gc-interval: '-1' is negative")
    with pytest.raises(ValueError) as err:
        parse_duration("soon", flag="--dial-timeout")
    assert str(err.value).startswith("--dial-timeout: 'soon' is not a duration")


def test_go_strict_grammar_refuses_a_bare_number_except_zero() -> None:
    assert parse_duration("0", bare_seconds=False) == 0.0
    assert parse_duration("1s", bare_seconds=False) == 1.0
    with pytest.raises(ValueError, match="is not a duration"):
        parse_duration("1", bare_seconds=False)


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(900.0, "15m"), (5.0, "5s"), (0.5, "500ms"), (0.0, "0s"), (5400.0, "1h30m"), (3600, "1h")],
)
def test_seconds_format_back_as_the_shortest_duration(seconds: float, text: str) -> None:
    assert format_seconds(seconds) == text
    assert parse_duration(text) == seconds


def test_argparse_types_use_the_grammar_and_exit_2_naming_the_flag(
    capsys: pytest.CaptureFixture[str],
) -> None:
    parser = argparse.ArgumentParser(prog="cilia-x")
    parser.add_argument("--timeout", type=duration_arg(positive=True), default=10.0)
    parser.add_argument("--grace", type=duration_arg(bare_seconds=False))
    parser.add_argument("--alias-grace-period", type=go_duration_arg)
    args = parser.parse_args(["--timeout", "1m30s", "--grace", "0", "--alias-grace-period", "2h"])
    assert (args.timeout, args.grace, args.alias_grace_period) == (90.0, 0.0, "2h")
    assert parser.parse_args(["--timeout", "2.5"]).timeout == 2.5
    for argv, reason in [
        (["--timeout", "0s"], "must be a duration > 0"),
        (["--timeout", "1d"], "is not a duration"),
        (["--grace", "10"], "is not a duration"),  # Go's grammar: a unit is needed
        (["--alias-grace-period=-1h"], "is negative"),
    ]:
        with pytest.raises(SystemExit) as exit_info:
            parser.parse_args(argv)
        assert exit_info.value.code == 2
        err = capsys.readouterr().err
        assert f"argument {argv[0].split('=')[0]}" in err and reason in err, err
