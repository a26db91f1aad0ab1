/* Cilia socket load balancer: cgroup v2 sock_addr programs (upstream's socket-LB).
 *
 *   cil_sock4_connect      connect() of a TCP or UDP socket       (BPF_CGROUP_INET4_CONNECT)
 *   cil_sock4_sendmsg      sendmsg()/sendto() of a UDP socket     (BPF_CGROUP_UDP4_SENDMSG)
 *   cil_sock4_recvmsg      recvmsg()/recvfrom() of a UDP socket   (BPF_CGROUP_UDP4_RECVMSG)
 *   cil_sock4_getpeername  getpeername()                          (BPF_CGROUP_INET4_GETPEERNAME)
 *   cil_sock6_*            the same four for AF_INET6 sockets, IPv4-mapped destinations
 *                          (::ffff:VIP) only: dual-stack sockets reach IPv4 Services too
 *
 * Forward (connect, sendmsg): the destination (VIP, port, protocol) is looked up in
 * cilium_lb4_services_v2 (a hash map: O(1) in the number of Services). Not a Service:
 * the call proceeds untouched (so with several programs attached to one cgroup, one per
 * agent, a destination already rewritten by an earlier program passes the next one). A
 * Service without active backends: the call fails with ECONNREFUSED, as a client sees it
 * from upstream's per-packet path (ICMP port unreachable). Otherwise a backend is chosen
 * at random among slots 1..count (upstream bpf-lb-algorithm=random; only active backends
 * occupy slots, terminating ones stay in cilium_lb4_backends_v3 for the connections they
 * have), or the one remembered for the client's network namespace with sessionAffinity
 * ClientIP while it is younger than the timeout, still active and still in the Service
 * (cilium_lb_affinity_match). The socket's destination becomes the backend before any
 * packet exists, so no per-packet NAT or conntrack is needed; what the socket was sent
 * to is remembered per (socket cookie, backend) in cilium_lb4_reverse_sk.
 *
 * Alias VIPs (a Service's former ClusterIP kept by a ServiceCIDR migration): every forward
 * lookup that finds a Service stamps bpf_ktime_get_ns() into cilia_lb4_alias_use when the
 * VIP has an entry there. The agent keeps one entry per alias (value 0 until used) and
 * reports the last use to the operator, which releases an alias unused for its grace
 * period. Other VIPs have no entry: one failed lookup.
 *
 * Reverse (recvmsg, getpeername): a source that cilium_lb4_reverse_sk knows for this
 * socket is shown as the VIP and Service port again (the application sees the peer it
 * addressed), as long as the Service still exists with the same rev-NAT index.
 *
 * NodePort through the node's own address (upstream's "wildcard" lookup): a NodePort is
 * stored once as the surrogate (0.0.0.0, nodePort) with SVC_FLAG_NODEPORT. When the exact
 * (address, port) lookup misses and the address is one of this node's own IPv4 addresses
 * (cilia_lb4_node_addrs, filled by the agent), the surrogate is looked up; the reverse
 * path does the same, so a pod or host process reaching <own node address>:<nodePort>
 * gets a backend and sees that address as its peer.
 */
#include <linux/bpf.h>
#include <linux/in.h>
#include <linux/errno.h>
#include <bpf/bpf_helpers.h>
#include "lib/lb.h"

/* Maps of this program only (the four shared with bpf_host.c are in lib/lb.h). */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__type(key, __u16);
	__type(value, struct lb4_reverse_nat);
	__uint(max_entries, CILIA_LB_MAP_MAX);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} cilium_lb4_reverse_nat SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__type(key, struct ipv4_revnat_tuple);
	__type(value, struct ipv4_revnat_entry);
	__uint(max_entries, CILIA_LB_SOCK_REV_MAX);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} cilium_lb4_reverse_sk SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__type(key, __be32);
	__type(value, __u64);
	__uint(max_entries, CILIA_LB_MAP_MAX);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} cilia_lb4_alias_use SEC(".maps");

/* This node's own IPv4 addresses (value unused); written by the agent. */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__type(key, __be32);
	__type(value, __u8);
	__uint(max_entries, CILIA_LB_MAP_MAX);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} cilia_lb4_node_addrs SEC(".maps");

#define SYS_REJECT 0
#define SYS_PROCEED 1

/* The NodePort surrogate for a missed (address, port) lookup: key's address becomes
 * 0.0.0.0 when the address is the node's own and a NodePort serves that port, else NULL. */
static __always_inline struct lb4_service *nodeport_wildcard(struct lb4_key *key)
{
	struct lb4_service *svc;

	if (!bpf_map_lookup_elem(&cilia_lb4_node_addrs, &key->address))
		return NULL;
	key->address = 0;
	svc = bpf_map_lookup_elem(&cilium_lb4_services_v2, key);
	if (svc && (svc->flags & SVC_FLAG_NODEPORT))
		return svc;
	return NULL;
}

/* Stamp the use of an alias VIP (no entry: not an alias, nothing to do). */
static __always_inline void alias_used(__be32 address)
{
	__u64 *last = bpf_map_lookup_elem(&cilia_lb4_alias_use, &address);

	if (last)
		*last = bpf_ktime_get_ns();
}

/* The destination *address:*port (network order) of ctx's socket becomes a backend when it is
 * a Service. 0: translated or not a Service (proceed); <0: -errno to fail the call with.
 * The caller reads and writes the context's address fields (user_ip4 or user_ip6[3]: the
 * verifier lets each attach type touch only its own family's). */
static __always_inline int sock_xlate_fwd(struct bpf_sock_addr *ctx, __be32 *address,
					  __be16 *port)
{
	struct lb4_key key = {};
	struct lb4_service *svc, *slot;
	struct lb4_backend *backend;
	struct lb4_affinity_key akey = {};
	struct ipv4_revnat_tuple rkey = {};
	struct ipv4_revnat_entry rval = {};
	__u32 backend_id = 0;
	__u64 now = 0;
	__u8 proto = ctx->protocol;

	if (proto != IPPROTO_TCP && proto != IPPROTO_UDP)
		return 0;
	key.address = *address;
	key.dport = *port;
	key.proto = proto;
	key.scope = LB_LOOKUP_SCOPE_EXT;
	svc = bpf_map_lookup_elem(&cilium_lb4_services_v2, &key);
	if (!svc)
		svc = nodeport_wildcard(&key);
	if (!svc)
		return 0;
	alias_used(key.address);
	if (svc->count == 0)
		return -ECONNREFUSED;
	if (svc->flags & SVC_FLAG_AFFINITY) {
		now = bpf_ktime_get_ns();
		akey.client_cookie = bpf_get_netns_cookie(ctx);
		akey.rev_nat_id = svc->rev_nat_index;
		akey.netns = 1;
		backend_id = affinity_backend(svc, &akey, now);
	}
	if (!backend_id) {
		key.backend_slot = (bpf_get_prandom_u32() % svc->count) + 1;
		slot = bpf_map_lookup_elem(&cilium_lb4_services_v2, &key);
		if (!slot)
			return 0; /* the Service is being rewritten: leave the call alone */
		backend_id = slot->backend_id;
	}
	backend = bpf_map_lookup_elem(&cilium_lb4_backends_v3, &backend_id);
	if (!backend)
		return 0;
	if (svc->flags & SVC_FLAG_AFFINITY) {
		struct lb_affinity_val aval = {.last_used = now, .backend_id = backend_id};

		bpf_map_update_elem(&cilium_lb4_affinity, &akey, &aval, BPF_ANY);
	}
	rkey.cookie = bpf_get_socket_cookie(ctx);
	rkey.address = backend->address;
	rkey.port = backend->port;
	rval.address = *address; /* what the socket addressed (not the 0.0.0.0 surrogate) */
	rval.port = key.dport;
	rval.rev_nat_index = svc->rev_nat_index;
	bpf_map_update_elem(&cilium_lb4_reverse_sk, &rkey, &rval, BPF_ANY);
	*address = backend->address;
	*port = backend->port;
	return 0;
}

/* A source *address:*port that ctx's socket reached as a Service backend becomes the VIP
 * and Service port again; returns 1 when it did. */
static __always_inline int sock_xlate_rev(struct bpf_sock_addr *ctx, __be32 *address,
					  __be16 *port)
{
	struct ipv4_revnat_tuple rkey = {};
	struct ipv4_revnat_entry *rval;
	struct lb4_key key = {};
	struct lb4_service *svc;

	rkey.cookie = bpf_get_socket_cookie(ctx);
	rkey.address = *address;
	rkey.port = *port;
	rval = bpf_map_lookup_elem(&cilium_lb4_reverse_sk, &rkey);
	if (!rval)
		return 0;
	key.address = rval->address;
	key.dport = rval->port;
	key.proto = ctx->protocol;
	key.scope = LB_LOOKUP_SCOPE_EXT;
	svc = bpf_map_lookup_elem(&cilium_lb4_services_v2, &key);
	if (!svc)
		svc = nodeport_wildcard(&key);
	if (!svc || svc->rev_nat_index != rval->rev_nat_index) {
		bpf_map_delete_elem(&cilium_lb4_reverse_sk, &rkey);
		return 0;
	}
	*address = rval->address;
	*port = rval->port;
	return 1;
}

/* CILIA_NO_SET_RETVAL builds the variant for kernels before 5.18 (build/bpf/bpf_sock_compat.o,
 * chosen by the agent from a probe): without bpf_set_retval a rejected call fails with the
 * hook's default EPERM, as upstream's socket-LB refuses on such kernels. */
static __always_inline int verdict(int err)
{
	if (err < 0) {
#ifndef CILIA_NO_SET_RETVAL
		bpf_set_retval(err);
#endif
		return SYS_REJECT;
	}
	return SYS_PROCEED;
}

static __always_inline int sock4_fwd(struct bpf_sock_addr *ctx)
{
	__be32 address = ctx->user_ip4;
	__be16 port = (__be16)ctx->user_port;
	int err = sock_xlate_fwd(ctx, &address, &port);

	if (err == 0 && (address != ctx->user_ip4 || port != (__be16)ctx->user_port)) {
		ctx->user_ip4 = address;
		ctx->user_port = port;
	}
	return verdict(err);
}

static __always_inline void sock4_rev(struct bpf_sock_addr *ctx)
{
	__be32 address = ctx->user_ip4;
	__be16 port = (__be16)ctx->user_port;

	if (sock_xlate_rev(ctx, &address, &port)) {
		ctx->user_ip4 = address;
		ctx->user_port = port;
	}
}

/* IPv4-mapped IPv6 (::ffff:a.b.c.d): what a dual-stack AF_INET6 socket (Java's default, for
 * one) uses for an IPv4 VIP. Only these are translated by the *6 programs. */
#if __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
#define V4_MAPPED_WORD 0xffff0000U
#else
#define V4_MAPPED_WORD 0x0000ffffU
#endif

static __always_inline int v4_mapped(struct bpf_sock_addr *ctx)
{
	return ctx->user_ip6[0] == 0 && ctx->user_ip6[1] == 0 &&
	       ctx->user_ip6[2] == V4_MAPPED_WORD;
}

static __always_inline int sock6_fwd(struct bpf_sock_addr *ctx)
{
	__be32 address;
	__be16 port;
	int err;

	if (!v4_mapped(ctx))
		return SYS_PROCEED;
	address = ctx->user_ip6[3];
	port = (__be16)ctx->user_port;
	err = sock_xlate_fwd(ctx, &address, &port);
	if (err == 0 && (address != ctx->user_ip6[3] || port != (__be16)ctx->user_port)) {
		ctx->user_ip6[3] = address;
		ctx->user_port = port;
	}
	return verdict(err);
}

static __always_inline void sock6_rev(struct bpf_sock_addr *ctx)
{
	__be32 address;
	__be16 port;

	if (!v4_mapped(ctx))
		return;
	address = ctx->user_ip6[3];
	port = (__be16)ctx->user_port;
	if (sock_xlate_rev(ctx, &address, &port)) {
		ctx->user_ip6[3] = address;
		ctx->user_port = port;
	}
}

SEC("cgroup/connect4")
int cil_sock4_connect(struct bpf_sock_addr *ctx)
{
	return sock4_fwd(ctx);
}

SEC("cgroup/sendmsg4")
int cil_sock4_sendmsg(struct bpf_sock_addr *ctx)
{
	return sock4_fwd(ctx);
}

SEC("cgroup/recvmsg4")
int cil_sock4_recvmsg(struct bpf_sock_addr *ctx)
{
	sock4_rev(ctx);
	return SYS_PROCEED;
}

SEC("cgroup/getpeername4")
int cil_sock4_getpeername(struct bpf_sock_addr *ctx)
{
	sock4_rev(ctx);
	return SYS_PROCEED;
}

SEC("cgroup/connect6")
int cil_sock6_connect(struct bpf_sock_addr *ctx)
{
	return sock6_fwd(ctx);
}

SEC("cgroup/sendmsg6")
int cil_sock6_sendmsg(struct bpf_sock_addr *ctx)
{
	return sock6_fwd(ctx);
}

SEC("cgroup/recvmsg6")
int cil_sock6_recvmsg(struct bpf_sock_addr *ctx)
{
	sock6_rev(ctx);
	return SYS_PROCEED;
}

SEC("cgroup/getpeername6")
int cil_sock6_getpeername(struct bpf_sock_addr *ctx)
{
	sock6_rev(ctx);
	return SYS_PROCEED;
}

/* GPL, as bcc loaded these programs (the kernel refuses GPL-only helpers otherwise). */
char LICENSE[] SEC("license") = "GPL";
