"""Test support for the agent, beside the code it exercises (never imported by the agent itself).

- :mod:`cilia_agent.testing.bpf`: loads ``bpf/bpf_lxc.c`` with the agent's own loader and map
  layouts and runs crafted packets through ``BPF_PROG_TEST_RUN`` (used by ``bpf/tests`` and the
  agent's privileged datapath tests). Needs root, bpffs and Debian's libbpf.

The import contracts keep it the top layer of the agent (``.importlinter``, ``agent-layers``):
it may import every layer, and no agent module imports it. Plain fakes of one class live beside
that class instead (``datapath/fake.py``, ``identity/fake.py``).
"""
