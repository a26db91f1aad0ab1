"""The conntrack GC's pure rules: the timeout of each entry state and the dynamic interval."""

from __future__ import annotations

import pytest

from cilia_agent.config import Config
from cilia_agent.conntrack.gc import ConntrackGC, Timeouts, next_interval
from cilia_agent.datapath.layout import CT_REPLY_SEEN, CT_RX_FIN, CT_TX_FIN, CtKey, CtValue


@pytest.mark.parametrize(
    ("proto", "flags", "ct_flags", "timeout"),
    [
        (6, 0x02, 0, 60.0),  # SYN, no reply yet
        (6, 0x12, CT_REPLY_SEEN, 21600.0),  # established
        (6, 0x13, CT_REPLY_SEEN | CT_TX_FIN, 21600.0),  # half-closed: still established
        (6, 0x13, CT_REPLY_SEEN | CT_RX_FIN, 21600.0),  # ... either way
        (6, 0x13, CT_REPLY_SEEN | CT_TX_FIN | CT_RX_FIN, 10.0),  # FIN both ways
        (6, 0x06, 0, 10.0),  # RST
        (6, 0x16, CT_REPLY_SEEN, 10.0),  # RST on an established connection
        (17, 0, CT_REPLY_SEEN, 60.0),  # UDP
        (1, 0, 0, 60.0),  # ICMP
    ],
)
def test_timeout_follows_the_entry_state(
    proto: int, flags: int, ct_flags: int, timeout: float
) -> None:
    key = CtKey(proto=proto)
    assert Timeouts().of(key, CtValue(tcp_flags_seen=flags, ct_flags=ct_flags)) == timeout


@pytest.mark.parametrize(
    ("previous", "ratio", "maximum", "want"),
    [
        (300.0, 0.0, 0.0, 300.0),  # nothing deleted: kept
        (300.0, 0.1, 0.0, 300.0),  # between 5 % and 25 %: kept
        (300.0, 0.01, 0.0, 450.0),  # under 5 %: x 1.5
        (40000.0, 0.01, 0.0, 43200.0),  # ... up to 12 h by default
        (600.0, 0.01, 700.0, 700.0),  # ... or --conntrack-gc-max-interval
        (300.0, 0.0, 60.0, 60.0),  # the maximum bounds a kept interval too
        (40000.0, 0.01, 90000.0, 43200.0),  # and is never more than 12 h
        (300.0, 0.5, 0.0, 150.0),  # over 25 %: x (1 - ratio)
        (300.0, 0.99, 0.0, 30.0),  # ratio capped at 0.9
        (20.0, 0.9, 0.0, 10.0),  # never under 10 s
    ],
)
def test_dynamic_interval(previous: float, ratio: float, maximum: float, want: float) -> None:
    assert next_interval(previous, ratio, maximum) == want


def test_flags_set_timeouts_and_a_fixed_interval() -> None:
    cfg = Config(
        bpf_ct_timeout_regular_tcp_fin="30s",  # type: ignore[arg-type]
        conntrack_gc_interval="1m",  # type: ignore[arg-type]
    )
    gc = ConntrackGC.from_config(cfg, ct_map=None)  # type: ignore[arg-type]
    assert gc.timeouts == Timeouts(regular_tcp_fin=30.0)
    assert gc.next_wait == 60.0
    assert gc.max_entries == cfg.bpf_ct_global_max
    bounded = Config(conntrack_gc_max_interval=60)
    capped = ConntrackGC.from_config(bounded, ct_map=None)  # type: ignore[arg-type]
    assert capped.next_wait == 60.0  # the starting 5 min, bounded by the maximum
    with pytest.raises(ValueError, match="bpf_ct_timeout_regular_tcp"):
        Config(bpf_ct_timeout_regular_tcp=0)
    with pytest.raises(ValueError, match="at least 1s"):
        Config(conntrack_gc_interval="1ms")  # type: ignore[arg-type]
