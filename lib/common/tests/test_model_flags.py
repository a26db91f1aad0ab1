"""Flags generated from a pydantic model: name, help, default and range written once."""

from __future__ import annotations

import argparse
import pathlib
from typing import Annotated, Literal

import pytest
from pydantic import BaseModel, ConfigDict, Field, field_validator

from cilia_common.flags import (
    Duration,
    Flag,
    FlagError,
    GoDuration,
    add_model_flags,
    config_from_args,
    given_flags,
    parse_bool,
)


class Config(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    listen: str = Field(default="127.0.0.1:4250", description="gRPC listen address")
    mtu: int = Field(default=1500, ge=68, le=65535, description="MTU of pod veths")
    ratio: float = Field(default=0.5, gt=0, description="a ratio")
    gc_interval: Duration = Field(default=900.0, ge=0, description="GC period; 0 disables")
    dial_timeout: GoDuration = Field(default=5.0, gt=0, description="dial timeout")
    log_level: Literal["debug", "info"] = Field(default="info", description="log level")
    enable_gc: bool = Field(default=False, description="run the GC")
    cidr: list[str] = Field(default_factory=lambda: ["10.96.0.0/12"], description="CIDRs")
    pin_dir: Annotated[pathlib.Path, Flag(aliases=("--bpf-root",))] = Field(
        default=pathlib.Path("/sys/fs/bpf/cilia"), description="pin directory, 100% bpffs"
    )
    node: str = Field(default="", description="node name", json_schema_extra=None)
    host: Annotated[str, Flag(default_text="hostname")] = Field(
        default_factory=lambda: "computed", description="host"
    )

    @field_validator("listen")
    @classmethod
    def _listen(cls, value: str) -> str:
        if ":" not in value:
            raise ValueError(f"{value!r} is not HOST:PORT")
        return value


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cilia-test")
    add_model_flags(parser, Config, exclude=("node",))
    return parser


def test_defaults_come_from_the_model_and_nothing_given_builds_the_default_config() -> None:
    args = _parser().parse_args([])
    assert (args.mtu, args.ratio, args.gc_interval, args.log_level) == (1500, 0.5, 900.0, "info")
    assert args.cidr is None and args.host is None  # computed at construction
    assert not hasattr(args, "node")
    assert given_flags(args) == {}
    assert config_from_args(Config, args) == Config()


def test_given_flags_are_converted_and_validated_into_the_model() -> None:
    args = _parser().parse_args(
        [
            "--mtu", "9000", "--gc-interval", "1h30m", "--dial-timeout", "250ms",
            "--enable-gc", "--cidr", "10.0.0.0/8", "--cidr", "192.168.0.0/16",
            "--bpf-root", "/tmp/pins", "--log-level", "debug", "--ratio", "2",
        ]
    )  # fmt: skip
    config = config_from_args(Config, args)
    assert config.mtu == 9000 and config.gc_interval == 5400.0 and config.dial_timeout == 0.25
    assert config.enable_gc is True and config.ratio == 2.0
    assert config.cidr == ["10.0.0.0/8", "192.168.0.0/16"]  # replaces the default
    assert config.pin_dir == pathlib.Path("/tmp/pins") and config.log_level == "debug"
    assert given_flags(args)["cidr"] == ["10.0.0.0/8", "192.168.0.0/16"]
    assert given_flags(args)["pin_dir"] == "/tmp/pins"


@pytest.mark.parametrize(
    ("argv", "value"),
    [(["--enable-gc"], True), (["--enable-gc=false"], False), (["--enable-gc", "no"], False)],
)
def test_a_bool_flag_is_a_switch_or_takes_a_value(argv: list[str], value: bool) -> None:
    assert config_from_args(Config, _parser().parse_args(argv)).enable_gc is value


@pytest.mark.parametrize(
    ("argv", "line"),
    [
        (["--mtu", "big"], "cilia-test: --mtu: 'big' is not an integer"),
        (["--gc-interval", "soon"], "cilia-test: --gc-interval: 'soon' is not a duration"),
        (["--gc-interval", "-1"], "cilia-test: --gc-interval: '-1' is negative"),
        (["--dial-timeout", "1"], "cilia-test: --dial-timeout: '1' is not a duration"),
        (["--ratio", "nan"], "cilia-test: --ratio: 'nan' is not a finite number"),
    ],
)
def test_a_value_of_the_wrong_type_exits_2_with_one_line(
    argv: list[str], line: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        _parser().parse_args(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(line), err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--mtu", "67"], "--mtu: Input should be greater than or equal to 68"),
        (["--ratio", "0"], "--ratio: Input should be greater than 0"),
        (["--listen", "nowhere"], "--listen: 'nowhere' is not HOST:PORT"),
        (["--log-level", "loud"], "--log-level: Input should be 'debug' or 'info'"),
        (
            ["--enable-gc=maybe"],
            "--enable-gc: Input should be a valid boolean, unable to interpret input",
        ),
    ],
)
def test_a_value_the_model_refuses_is_a_flag_error_naming_the_flag(
    argv: list[str], message: str
) -> None:
    with pytest.raises(FlagError) as err:
        config_from_args(Config, _parser().parse_args(argv))
    assert str(err.value) == message
    assert err.value.flag == message.split(":")[0]


def test_help_shows_description_range_and_default_once() -> None:
    text = " ".join(_parser().format_help().split())
    assert "--mtu N MTU of pod veths (68..65535; default: 1500)" in text
    assert "--gc-interval DURATION" in text
    assert "GC period; 0 disables (>= 0; default: 15m)" in text
    assert "dial timeout (> 0; default: 5s)" in text
    assert "--log-level {debug,info}" in text and "log level (default: info)" in text
    assert "--enable-gc [BOOL] run the GC (default: false)" in text
    assert "CIDRs (default: 10.96.0.0/12)" in text
    assert "--pin-dir PIN_DIR, --bpf-root PIN_DIR" in text
    assert "pin directory, 100% bpffs (default: /sys/fs/bpf/cilia)" in text
    assert "host (default: hostname)" in text


def test_overrides_and_model_level_errors() -> None:
    args = _parser().parse_args([])
    assert config_from_args(Config, args, node="n1").node == "n1"
    with pytest.raises(FlagError) as err:
        config_from_args(Config, args, unknown=1)
    assert str(err.value) == "--unknown: Extra inputs are not permitted"


@pytest.mark.parametrize(("text", "value"), [("TRUE", True), ("1", True), ("off", False)])
def test_parse_bool(text: str, value: bool) -> None:
    assert parse_bool(text) is value
