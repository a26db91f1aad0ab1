"""The first mainline kernel of each BPF feature the objects may use, as data.

Versions are the release that added the helper, map type, program type or attach type
(the kernel's git history; the same table as bcc's "BPF Features by Linux Kernel Version").
Names are the kernel's own: helpers without the ``bpf_`` prefix as in ``__BPF_FUNC_MAPPER``
of ``include/uapi/linux/bpf.h``, map types as ``BPF_MAP_TYPE_*`` lower-cased without the
prefix. Numbers are not restated here: ``test_object_features`` reads them from the uapi
header installed on the build host (linux-libc-dev), the one the objects are compiled with.

A feature an object uses that is missing here fails the test: add it with its kernel.
"""

from __future__ import annotations

HELPERS: dict[str, tuple[int, int]] = {
    "map_lookup_elem": (3, 19),
    "map_update_elem": (3, 19),
    "map_delete_elem": (3, 19),
    "probe_read": (4, 1),
    "ktime_get_ns": (4, 1),
    "trace_printk": (4, 1),
    "get_prandom_u32": (4, 1),
    "get_smp_processor_id": (4, 1),
    "skb_store_bytes": (4, 1),
    "l3_csum_replace": (4, 1),
    "l4_csum_replace": (4, 1),
    "tail_call": (4, 2),
    "clone_redirect": (4, 2),
    "get_cgroup_classid": (4, 3),
    "skb_vlan_push": (4, 3),
    "skb_vlan_pop": (4, 3),
    "skb_get_tunnel_key": (4, 3),
    "skb_set_tunnel_key": (4, 3),
    "redirect": (4, 4),
    "perf_event_output": (4, 4),
    "skb_load_bytes": (4, 5),
    "csum_diff": (4, 6),
    "skb_change_proto": (4, 8),
    "skb_change_type": (4, 8),
    "get_hash_recalc": (4, 8),
    "skb_change_tail": (4, 9),
    "skb_pull_data": (4, 9),
    "csum_update": (4, 9),
    "set_hash_invalid": (4, 9),
    "skb_change_head": (4, 10),
    "get_socket_cookie": (4, 12),
    "get_socket_uid": (4, 12),
    "skb_adjust_room": (4, 13),
    "redirect_map": (4, 14),
    "fib_lookup": (4, 18),
    "skb_load_bytes_relative": (4, 18),
    "skb_cgroup_id": (4, 18),
    "get_current_cgroup_id": (4, 18),
    "sk_lookup_tcp": (4, 20),
    "sk_lookup_udp": (4, 20),
    "sk_release": (4, 20),
    "sk_fullsock": (5, 1),
    "tcp_sock": (5, 1),
    "skb_ecn_set_ce": (5, 1),
    "get_listener_sock": (5, 1),
    "skc_lookup_tcp": (5, 2),
    "jiffies64": (5, 5),
    "get_netns_cookie": (5, 7),
    "sk_assign": (5, 7),
    "ringbuf_output": (5, 8),
    "ringbuf_reserve": (5, 8),
    "ringbuf_submit": (5, 8),
    "ringbuf_discard": (5, 8),
    "ringbuf_query": (5, 8),
    "redirect_neigh": (5, 10),
    "redirect_peer": (5, 10),
    "per_cpu_ptr": (5, 10),
    "this_cpu_ptr": (5, 10),
    "check_mtu": (5, 12),
    "ktime_get_coarse_ns": (5, 11),
    "get_retval": (5, 18),
    "set_retval": (5, 18),
}

MAP_TYPES: dict[str, tuple[int, int]] = {
    "hash": (3, 19),
    "array": (3, 19),
    "prog_array": (4, 2),
    "perf_event_array": (4, 3),
    "percpu_hash": (4, 6),
    "percpu_array": (4, 6),
    "lru_hash": (4, 10),
    "lru_percpu_hash": (4, 10),
    "lpm_trie": (4, 11),
    "array_of_maps": (4, 12),
    "hash_of_maps": (4, 12),
    "devmap": (4, 14),
    "sockhash": (4, 18),
    "ringbuf": (5, 8),
}

#: libbpf's ELF section names (its ``section_defs``) → (program type, kernel), and for
#: the sections that carry one, the expected attach type and its kernel.
SECTIONS: dict[str, tuple[str, tuple[int, int], str, tuple[int, int]]] = {
    "tc": ("sched_cls", (4, 1), "", (0, 0)),
    "classifier": ("sched_cls", (4, 1), "", (0, 0)),
    "xdp": ("xdp", (4, 8), "", (0, 0)),
    "cgroup/connect4": ("cgroup_sock_addr", (4, 17), "cgroup_inet4_connect", (4, 17)),
    "cgroup/connect6": ("cgroup_sock_addr", (4, 17), "cgroup_inet6_connect", (4, 17)),
    "cgroup/sendmsg4": ("cgroup_sock_addr", (4, 17), "cgroup_udp4_sendmsg", (4, 18)),
    "cgroup/sendmsg6": ("cgroup_sock_addr", (4, 17), "cgroup_udp6_sendmsg", (4, 18)),
    "cgroup/recvmsg4": ("cgroup_sock_addr", (4, 17), "cgroup_udp4_recvmsg", (5, 2)),
    "cgroup/recvmsg6": ("cgroup_sock_addr", (4, 17), "cgroup_udp6_recvmsg", (5, 2)),
    "cgroup/getpeername4": ("cgroup_sock_addr", (4, 17), "cgroup_inet4_getpeername", (5, 8)),
    "cgroup/getpeername6": ("cgroup_sock_addr", (4, 17), "cgroup_inet6_getpeername", (5, 8)),
    "cgroup/post_bind4": ("cgroup_sock", (4, 10), "cgroup_inet4_post_bind", (4, 17)),
    "cgroup/sock_release": ("cgroup_sock", (4, 10), "cgroup_inet_sock_release", (5, 9)),
}

#: Calls newer than the floor that an object makes only where the agent probed the kernel
#: for them: object → {helper: how the agent keeps it from older kernels}. Nothing else may
#: be newer than the floor.
PROBE_GATED: dict[str, dict[str, str]] = {
    "bpf_lxc.o": {
        "ktime_get_coarse_ns": "behind CONFIG.ct_clock_coarse (.rodata), set only when the "
        "agent's probe finds the helper; the verifier prunes the call otherwise",
    },
    "bpf_sock.o": {
        "set_retval": "loaded only where the probe finds it (--bpf-sock-variant auto); "
        "bpf_sock_compat.o, built without it, otherwise",
    },
}

#: The oldest kernel every default feature must run on (upstream Cilium's floor).
FLOOR = (5, 10)
