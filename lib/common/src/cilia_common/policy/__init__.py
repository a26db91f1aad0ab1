"""The one policy parser of Cilia, used by the operator and the agent alike.

    model   pydantic models of CiliumNetworkPolicy / CiliumClusterwideNetworkPolicy
            (cilium.io/v2) and NetworkPolicy (networking.k8s.io/v1), ``parse_policy``.
    judge   ``judge_policy``: enforced as written, enforced fail-closed (the rules Cilia
            cannot enforce make the selected endpoints default-deny in their direction),
            or refused.

Depends on pydantic and the standard library only.
"""
