"""Kubernetes Services in the operator: the kinds (``v1 Service``, ``discovery.k8s.io/v1
EndpointSlice``, ``networking.k8s.io/v1 ServiceCIDR``), their validation, ClusterIP and
NodePort allocation from the ServiceCIDRs (standalone mode, what kube-apiserver does), and
the controller that keeps EndpointSlices from the endpoints the operator knows and releases
deleted ServiceCIDRs (standalone mode, what kube-controller-manager does).

Modules: :mod:`.model` (kinds, schema rules, defaults, record helpers), :mod:`.allocation`
(the Apply-transaction step: defaults, immutable fields, ClusterIP/NodePort allocation,
ServiceCIDR checks), :mod:`.controller` (EndpointSlices, ServiceCIDR release).
"""
