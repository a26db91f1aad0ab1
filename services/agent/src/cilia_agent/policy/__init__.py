"""Agent-side network policy: manifests → per-endpoint policy-map entries.

Layers (each imports only the ones above it):
    model       pydantic models of CiliumNetworkPolicy (cilium.io/v2) and NetworkPolicy
                (networking.k8s.io/v1), ``parse_policy``; depends on pydantic + stdlib only.
    selector    label selectors with upstream semantics (source-less keys match any source).
    rules       manifest → ``CompiledPolicy`` (namespace restriction, ports, entities).
    compiler    (endpoint, policies, identity cache) → ``EndpointPolicy`` (entries + enforce).
    maps        ctypes layouts of ``struct policy_key/policy_value`` (bpf/lib/common.h),
                ``diff`` and ``PolicyMapWriter`` for the pinned ``cilia_policy`` LPM trie.
    repository  current policies fed by ``PolicyService.WatchPolicies``; revision; which
                endpoints need recompiling after a policy or identity change.

This ``__init__`` imports nothing so ``cilia_agent.policy.model`` stays importable
without the agent's runtime dependencies.
"""
