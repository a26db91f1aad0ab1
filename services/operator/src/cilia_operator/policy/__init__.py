"""Network policies: CiliumNetworkPolicy (``cilium.io/v2``) and NetworkPolicy
(``networking.k8s.io/v1``), validated against OpenAPI v3 schemas kept as package data.

Files:
    crds/ciliumnetworkpolicies.yaml   the CRD (canonical; deploy/helm/cilia/files/crds/ holds a copy)
    schemas/networkpolicies.yaml      NetworkPolicy subset schema
    validation.py                     jsonschema validation with field paths
"""
