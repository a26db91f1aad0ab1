/* Service load-balancing maps of the Cilia socket-LB (bpf_sock.c) and NodePort (bpf_host.c).
 *
 * Layouts follow upstream's IPv4 load-balancer maps (pkg/loadbalancer/maps,
 * bpf/lib/lb.h), so a Cilium engineer reads them as the ones they know. They
 * are mirrored in Python by the agent's loadbalancer/layout.py; change both
 * together. Addresses and ports are in network byte order.
 *
 * Compiled ahead of time with clang (libbpf's BTF map definitions); the agent loads the
 * objects with libbpf. Every map is pinned by name under the agent's --bpf-pin-dir (the
 * loader sets each map's pin path), so bpf_sock.o and bpf_host.o share the maps both
 * define, and an agent restart reuses the maps of the previous run (libbpf checks type,
 * key and value sizes, max_entries and flags against the pinned map). The sizes below
 * are defaults only: the loader sets each map's max_entries from the agent's flags
 * before loading:
 *   CILIA_LB_MAP_MAX       65536    services/backends/rev-NAT/affinity/alias entries
 *                                   (upstream --bpf-lb-map-max)
 *   CILIA_LB_SOCK_REV_MAX  262144   socket reverse-translation entries, LRU
 *                                   (upstream --bpf-sock-rev-map-max)
 *   CILIA_LB_NAT_MAX       524288   NodePort translation entries of bpf_host.c, LRU
 *                                   (upstream --bpf-nat-global-max)
 */
#ifndef CILIA_LB_H
#define CILIA_LB_H

#include <linux/bpf.h>
#include <linux/in.h>
#include <bpf/bpf_helpers.h>

#define CILIA_LB_MAP_MAX 65536
#define CILIA_LB_SOCK_REV_MAX 262144
#define CILIA_LB_NAT_MAX 524288

#define NSEC_PER_SEC 1000000000ULL

/* Lookup scopes of the service key (upstream LB_LOOKUP_SCOPE_*). */
#define LB_LOOKUP_SCOPE_EXT 0
#define LB_LOOKUP_SCOPE_INT 1

/* Service flags (upstream enum: SVC_FLAG_*). */
#define SVC_FLAG_NODEPORT (1 << 1)        /* a NodePort frontend (the 0.0.0.0 surrogate) */
#define SVC_FLAG_EXT_LOCAL_SCOPE (1 << 2) /* externalTrafficPolicy Local */
#define SVC_FLAG_AFFINITY (1 << 4) /* sessionAffinity ClientIP */
#define SVC_FLAG_ROUTABLE (1 << 6) /* a ClusterIP or other VIP that is not HostPort */
/* flags2 (upstream enum: SVC_FLAG_*, second byte). */
#define SVC_FLAG_INT_LOCAL_SCOPE (1 << 4) /* internalTrafficPolicy Local */

/* Backend states in lb4_backend.flags (upstream BE_STATE_*). */
#define BE_STATE_ACTIVE 0
#define BE_STATE_TERMINATING 1

/* Service key: slot 0 is the master entry, 1..count the backends. */
struct lb4_key {
	__be32 address;
	__be16 dport;
	__u16 backend_slot;
	__u8 proto; /* IPPROTO_TCP / IPPROTO_UDP */
	__u8 scope;
	__u8 pad[2];
};

struct lb4_service {
	/* Slots 1..count: the backend. Slot 0: the ClientIP affinity timeout in
	 * seconds (upstream's union of backend_id and affinity_timeout). */
	__u32 backend_id;
	__u16 count; /* active backends in slots 1..count (slot 0 only) */
	__u16 rev_nat_index;
	__u8 flags;
	__u8 flags2;
	__u16 qcount;
};

struct lb4_backend {
	__be32 address;
	__be16 port;
	__u8 proto;
	__u8 flags; /* BE_STATE_* */
	__u16 cluster_id;
	__u8 zone;
	__u8 pad;
};

struct lb4_reverse_nat {
	__be32 address;
	__be16 port;
	__u16 pad;
};

/* Socket reverse translation: what a socket was sent to, per backend it reached. */
struct ipv4_revnat_tuple {
	__u64 cookie; /* socket cookie */
	__be32 address; /* backend */
	__be16 port;
	__u16 pad;
};

struct ipv4_revnat_entry {
	__be32 address; /* service VIP */
	__be16 port;
	__u16 rev_nat_index;
};

/* ClientIP affinity. Socket-LB has no client address at connect() time (the socket
 * is not bound yet), so the client is its network namespace: one pod = one netns =
 * one pod IP, the host = the node's address (upstream keys socket-LB affinity by
 * netns cookie the same way). */
struct lb4_affinity_key {
	__u64 client_cookie; /* netns cookie */
	__u16 rev_nat_id;
	__u8 netns; /* 1: client_cookie is a netns cookie */
	__u8 pad1;
	__u32 pad2;
};

struct lb_affinity_val {
	__u64 last_used; /* bpf_ktime_get_ns() */
	__u32 backend_id;
	__u32 pad;
};

/* Which backends belong to which frontend, for affinity checks (upstream
 * cilium_lb_affinity_match): present = backend_id is active in rev_nat_id. */
struct lb_affinity_match {
	__u32 backend_id;
	__u16 rev_nat_id;
	__u16 pad;
};

/* NodePort translation state of bpf_host.c (cilium_snat_v4_external): one LRU map holds
 * both directions of every translated flow, keyed by the tuple as a packet carries it
 * (upstream keeps its SNAT entries the same way, a tuple per direction):
 *
 *   NAT_DIR_FWD    client -> node:nodePort, seen on from-netdev: to_daddr/to_dport = the
 *                  backend; to_saddr/to_sport = node:NAT port when SNATed, else 0
 *   NAT_DIR_REPLY  backend -> client (local backend, seen on to-netdev): to_saddr/to_sport
 *                  = node:nodePort, to_daddr = 0;
 *                  backend -> node:NAT port (remote backend, seen on from-netdev):
 *                  to_saddr/to_sport = node:nodePort, to_daddr/to_dport = the client
 *
 * and, flagged NAT_F_MASQ, the masqueraded pod flows (BPF masquerade):
 *
 *   NAT_DIR_FWD    pod -> outside, seen on to-netdev: to_saddr/to_sport = node:NAT port
 *   NAT_DIR_REPLY  outside -> node:NAT port, seen on from-netdev: to_daddr/to_dport = the pod
 *
 * For ICMP echo the echo identifier stands for the port: the request's source port, the
 * reply's destination port (the other port of the tuple is 0).
 */
#define NAT_DIR_FWD 0
#define NAT_DIR_REPLY 1

struct lb4_nat_tuple {
	__be32 daddr;
	__be32 saddr;
	__be16 dport;
	__be16 sport;
	__u8 nexthdr; /* IPPROTO_TCP / IPPROTO_UDP */
	__u8 flags;   /* NAT_DIR_* */
	__u16 pad;
};

struct lb4_nat_entry {
	__be32 to_saddr; /* 0: source kept */
	__be32 to_daddr; /* 0: destination kept */
	__be16 to_sport;
	__be16 to_dport;
	__u32 backend_id; /* NAT_DIR_FWD: the backend chosen */
	__u16 rev_nat_index;
	__u16 flags;   /* NAT_F_*: 0 = a NodePort flow */
	__u64 created; /* bpf_ktime_get_ns() */
};

/* lb4_nat_entry.flags: the entry belongs to a masqueraded pod flow (bpf_host.c, BPF
 * masquerade), not to a NodePort flow. Both share cilium_snat_v4_external and its NAT ports,
 * as upstream's NodePort SNAT and masquerade share their map: a reply tuple is never handed
 * to two flows (BPF_NOEXIST on the reply entry). The field was padding, always 0 before. */
#define NAT_F_MASQ 1

/* The maps both programs use (the other maps are defined by the program that uses
 * them). Hash maps are created without preallocation, as the agent has always created
 * them: the pins of an older agent keep being reused. */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__type(key, struct lb4_key);
	__type(value, struct lb4_service);
	__uint(max_entries, CILIA_LB_MAP_MAX);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} cilium_lb4_services_v2 SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__type(key, __u32);
	__type(value, struct lb4_backend);
	__uint(max_entries, CILIA_LB_MAP_MAX);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} cilium_lb4_backends_v3 SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__type(key, struct lb4_affinity_key);
	__type(value, struct lb_affinity_val);
	__uint(max_entries, CILIA_LB_MAP_MAX);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} cilium_lb4_affinity SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__type(key, struct lb_affinity_match);
	__type(value, __u8);
	__uint(max_entries, CILIA_LB_MAP_MAX);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} cilium_lb_affinity_match SEC(".maps");

/* The backend remembered in *akey (a client and frontend) for svc, if still usable: younger
 * than the Service's ClientIP timeout (slot 0's backend_id, seconds) at now
 * (bpf_ktime_get_ns), still in the Service (cilium_lb_affinity_match) and active. 0: none
 * (a stale entry is deleted). */
static __always_inline __u32 affinity_backend(const struct lb4_service *svc,
					      struct lb4_affinity_key *akey, __u64 now)
{
	struct lb_affinity_val *val = bpf_map_lookup_elem(&cilium_lb4_affinity, akey);
	struct lb_affinity_match match = {};
	struct lb4_backend *backend;

	if (!val)
		return 0;
	if (val->last_used + (__u64)svc->backend_id * NSEC_PER_SEC <= now)
		goto stale;
	match.backend_id = val->backend_id;
	match.rev_nat_id = svc->rev_nat_index;
	if (!bpf_map_lookup_elem(&cilium_lb_affinity_match, &match))
		goto stale;
	backend = bpf_map_lookup_elem(&cilium_lb4_backends_v3, &val->backend_id);
	if (!backend || backend->flags != BE_STATE_ACTIVE)
		goto stale;
	return val->backend_id;
stale:
	bpf_map_delete_elem(&cilium_lb4_affinity, akey);
	return 0;
}

#endif /* CILIA_LB_H */
