"""``--operator-max-message-bytes``: the agent's receive limit on its operator channel, a
named flag whose default is grpcio's own (4 MiB), which the operator's
``--watch-max-message-bytes`` pages every stream to (issue 31)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from cilia_agent.config import Config
from cilia_agent.controlplane import reconnect_options


def test_the_channel_takes_messages_up_to_the_flag_and_defaults_to_grpcios_limit() -> None:
    assert Config(node_name="n1").operator_max_message_bytes == 4 * 1024 * 1024
    options = dict(reconnect_options(1.0, 30.0))
    assert options["grpc.max_receive_message_length"] == 4 * 1024 * 1024
    raised = dict(reconnect_options(1.0, 30.0, 16 * 1024 * 1024))
    assert raised["grpc.max_receive_message_length"] == 16 * 1024 * 1024


def test_a_limit_below_64_kib_is_refused() -> None:
    with pytest.raises(ValidationError, match="operator_max_message_bytes"):
        Config(node_name="n1", operator_max_message_bytes=1024)
