"""Test support for ``bpf/``: :mod:`cilia_bpf_testing.harness` loads ``bpf/bpf_lxc.c`` with
the agent's loader and runs crafted packets through ``BPF_PROG_TEST_RUN``.

Used by ``bpf/tests`` and by the agent's datapath tests (an installed module, never reached
through an edited import path). Needs ``cilia_agent`` (its map layouts and loader) and libbpf; kept apart
from :mod:`cilia_testkit`, which stays standard library + pytest only.
"""
