"""Masquerade of pod traffic leaving the cluster (upstream enable-ipv4-masquerade).

- ``rules``: the nat chain ``CILIA_POST_nat`` (what it holds; read, rebuild, remove);
- ``ipmasq``: the ip-masq-agent file (nonMasqueradeCIDRs);
- ``manager``: keeps the chain in step with IPAM, the node stream and the file.

Only the iptables mode exists; ``--enable-bpf-masquerade=true`` is refused by the config.
"""
