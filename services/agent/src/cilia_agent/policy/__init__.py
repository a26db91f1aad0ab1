"""Agent-side network policy: manifests → per-endpoint policy-map entries.

Layers (each imports only the ones above it):
    (the manifests' models and parser, ``parse_policy``/``judge_policy``, are shared with
    the operator: ``cilia_common.policy``)
    selector    label selectors with upstream semantics (source-less keys match any source).
    rules       manifest → ``CompiledPolicy`` (namespace restriction, ports, entities).
    compiler    (endpoint, policies, identity cache) → ``EndpointPolicy`` (entries + enforce).
    maps        ctypes layouts of ``struct policy_key/policy_value`` (bpf/lib/common.h),
                ``diff`` and ``PolicyMapWriter`` for the pinned ``cilia_policy`` LPM trie.
    repository  current policies fed by ``PolicyService.WatchPolicies``; revision; which
                endpoints need recompiling after a policy or identity change.
"""
