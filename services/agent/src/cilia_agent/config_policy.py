"""The agent's policy enforcement flags (one group of ``cilia-agent serve``'s configuration):
when a direction of an endpoint is enforced, and audit mode. :class:`cilia_agent.config.Config`
inherits them, so every field is still ``cfg.<name>`` and one ``serve`` flag (upstream names:
``--enable-policy``, ``--policy-audit-mode``).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class PolicyConfig(BaseModel):
    """Validated policy enforcement flags (a base of the agent's ``Config``).

    Raises (on construction):
        pydantic.ValidationError: a field is malformed; the message names the field.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    enable_policy: Literal["default", "always", "never"] = Field(
        default="default",
        description="default (enforce a direction once a policy selects the endpoint for it), always (enforce both directions on every endpoint) or never",
    )
    policy_audit_mode: bool = Field(
        default=False,
        description="audit mode (upstream policy-audit-mode): a packet the policy would drop is forwarded and reported as a Hubble flow with verdict AUDIT; nothing is dropped by policy (source-address checks still drop); applies to every endpoint and is re-applied on restart",
    )
