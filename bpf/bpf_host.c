/* Cilia host datapath: NodePort on the node's external devices (upstream bpf_host).
 *
 *   cil_from_netdev  tc ingress of each --devices device: packets arriving from the LAN
 *   cil_to_netdev    tc egress of the same devices: packets leaving for the LAN
 *
 * What a socket hook cannot do: a client on another host of the LAN connects to
 * <any local address of this node>:<nodePort>. Its packets are translated one by one here,
 * with the state of every translated flow in cilium_snat_v4_external (lib/lb.h).
 *
 * Lookup (new flow, from-netdev): the Service key is (0.0.0.0, nodePort, protocol), the
 * zero-address "surrogate" frontend upstream keeps for every NodePort, and it applies only
 * when the destination is a local address of this node (bpf_fib_lookup answers "not
 * forwarded" for a local route), so every address of the node serves the NodePort and
 * forwarded traffic to the same port elsewhere is left alone. Keying NodePorts by the
 * surrogate only keeps the socket-LB (bpf_sock.c, exact-address lookups) from translating
 * a connect() to a node address, so the packets of such a connection reach this program.
 * The backend is chosen as the socket-LB chooses (bpf-lb-algorithm random among slots
 * 1..count; sessionAffinity ClientIP keyed by the client's address, netns flag 0). A
 * NodePort without an active backend (externalTrafficPolicy Local on a node without a
 * local backend) drops the packet.
 *
 * Translation (upstream bpf-lb-mode snat):
 *   local backend  (its route leaves by another device than the one the packet came in
 *                  by): destination rewritten to the backend, the client's address kept
 *                  (the pod's policy program sees the client: identity world); the
 *                  packet goes on up the stack to the pod. The reply leaves by this
 *                  device: to-netdev rewrites its source back to node:nodePort.
 *   remote backend (its route leaves by this device again): destination rewritten to the
 *                  backend and source to this node's address and a NAT port (32768-65535,
 *                  a free one among up to NAT_PORT_TRIES random tries), then the packet is
 *                  redirected out (bpf_fib_lookup + bpf_redirect/bpf_redirect_neigh: the
 *                  stack would drop a packet with a local source as martian). The backend
 *                  replies to node:NAT port; from-netdev rewrites that reply to come from
 *                  node:nodePort and go to the client, and redirects it out.
 * Checksums: bpf_l3_csum_replace for the IP header, bpf_l4_csum_replace (pseudo-header
 * flag for addresses; a UDP checksum of 0 stays 0) for TCP/UDP.
 *
 * A flow keeps its backend while that backend exists in cilium_lb4_backends_v3 (also
 * terminating), so established connections finish; entries age out of the LRU map.
 * Non-IPv4, non-TCP/UDP packets and IP fragments pass untouched.
 */
#include <uapi/linux/bpf.h>
#include <uapi/linux/pkt_cls.h>
#include <uapi/linux/if_ether.h>
#include <uapi/linux/ip.h>
#include <uapi/linux/in.h>
#include "lib/lb.h"

BPF_TABLE_PINNED("hash", struct lb4_key, struct lb4_service, cilium_lb4_services_v2,
		 CILIA_LB_MAP_MAX, CILIA_PIN_DIR "/cilium_lb4_services_v2", BPF_F_NO_PREALLOC);
BPF_TABLE_PINNED("hash", __u32, struct lb4_backend, cilium_lb4_backends_v3, CILIA_LB_MAP_MAX,
		 CILIA_PIN_DIR "/cilium_lb4_backends_v3", BPF_F_NO_PREALLOC);
BPF_TABLE_PINNED("lru_hash", struct lb4_affinity_key, struct lb_affinity_val, cilium_lb4_affinity,
		 CILIA_LB_MAP_MAX, CILIA_PIN_DIR "/cilium_lb4_affinity");
BPF_TABLE_PINNED("hash", struct lb_affinity_match, __u8, cilium_lb_affinity_match,
		 CILIA_LB_MAP_MAX, CILIA_PIN_DIR "/cilium_lb_affinity_match", BPF_F_NO_PREALLOC);
BPF_TABLE_PINNED("lru_hash", struct lb4_nat_tuple, struct lb4_nat_entry, cilium_snat_v4_external,
		 CILIA_LB_NAT_MAX, CILIA_PIN_DIR "/cilium_snat_v4_external");

/* A packet these programs leave alone goes on to the next program on the device (tcx
 * TCX_NEXT, clsact: the next filter), e.g. another agent's on the same device in a test
 * stack; with none left it is passed. A translated one is passed (TC_ACT_OK) or redirected. */
#define CIL_NEXT TC_ACT_UNSPEC
#define NSEC_PER_SEC 1000000000ULL
#define AF_INET 2
#define NAT_PORT_MIN 32768
#define NAT_PORT_SPAN 32768
#define NAT_PORT_TRIES 16
#define IP_OFF ETH_HLEN
#define IP_CSUM_OFF (ETH_HLEN + offsetof(struct iphdr, check))
#define IP_SRC_OFF (ETH_HLEN + offsetof(struct iphdr, saddr))
#define IP_DST_OFF (ETH_HLEN + offsetof(struct iphdr, daddr))

struct pkt {
	__be32 saddr;
	__be32 daddr;
	__be16 sport;
	__be16 dport;
	__u8 proto;
	__u32 l4_off;
	__u32 csum_off;
};

/* 1 for an unfragmented IPv4 TCP/UDP packet (fields filled), 0 for anything else. */
static __always_inline int parse(struct __sk_buff *skb, struct pkt *p)
{
	struct iphdr ip;
	__be16 ports[2];

	if (skb->protocol != htons(ETH_P_IP))
		return 0;
	if (bpf_skb_load_bytes(skb, IP_OFF, &ip, sizeof(ip)) < 0)
		return 0;
	if (ip.version != 4 || ip.ihl < 5)
		return 0;
	if (ip.frag_off & htons(0x3fff)) /* MF or a fragment offset */
		return 0;
	if (ip.protocol != IPPROTO_TCP && ip.protocol != IPPROTO_UDP)
		return 0;
	p->l4_off = IP_OFF + ip.ihl * 4;
	if (bpf_skb_load_bytes(skb, p->l4_off, ports, sizeof(ports)) < 0)
		return 0;
	p->saddr = ip.saddr;
	p->daddr = ip.daddr;
	p->sport = ports[0];
	p->dport = ports[1];
	p->proto = ip.protocol;
	p->csum_off = p->l4_off + (ip.protocol == IPPROTO_TCP ? 16 : 6);
	return 1;
}

static __always_inline int set_addr(struct __sk_buff *skb, struct pkt *p, int off, __be32 old,
				    __be32 new)
{
	__u64 l4 = BPF_F_PSEUDO_HDR | sizeof(new);

	if (old == new)
		return 0;
	if (p->proto == IPPROTO_UDP)
		l4 |= BPF_F_MARK_MANGLED_0;
	if (bpf_l4_csum_replace(skb, p->csum_off, old, new, l4) < 0)
		return -1;
	if (bpf_l3_csum_replace(skb, IP_CSUM_OFF, old, new, sizeof(new)) < 0)
		return -1;
	return bpf_skb_store_bytes(skb, off, &new, sizeof(new), 0);
}

static __always_inline int set_port(struct __sk_buff *skb, struct pkt *p, int off, __be16 old,
				    __be16 new)
{
	__u64 l4 = sizeof(new);

	if (old == new)
		return 0;
	if (p->proto == IPPROTO_UDP)
		l4 |= BPF_F_MARK_MANGLED_0;
	if (bpf_l4_csum_replace(skb, p->csum_off, old, new, l4) < 0)
		return -1;
	return bpf_skb_store_bytes(skb, off, &new, sizeof(new), 0);
}

/* Rewrite source and destination (a 0 address keeps that side). 0 or -1 on error. */
static __always_inline int rewrite(struct __sk_buff *skb, struct pkt *p, __be32 saddr,
				   __be16 sport, __be32 daddr, __be16 dport)
{
	if (saddr) {
		if (set_addr(skb, p, IP_SRC_OFF, p->saddr, saddr) < 0 ||
		    set_port(skb, p, p->l4_off, p->sport, sport) < 0)
			return -1;
		p->saddr = saddr;
		p->sport = sport;
	}
	if (daddr) {
		if (set_addr(skb, p, IP_DST_OFF, p->daddr, daddr) < 0 ||
		    set_port(skb, p, p->l4_off + 2, p->dport, dport) < 0)
			return -1;
		p->daddr = daddr;
		p->dport = dport;
	}
	return 0;
}

/* bpf_fib_lookup of p's (new) addresses from the ingress device; returns the helper's code
 * and fills fib (fib->ifindex: the output device). */
static __always_inline int fib(struct __sk_buff *skb, struct pkt *p, __be32 daddr,
			       struct bpf_fib_lookup *f)
{
	f->family = AF_INET;
	f->l4_protocol = p->proto;
	f->ipv4_src = p->saddr;
	f->ipv4_dst = daddr;
	f->ifindex = skb->ifindex;
	return bpf_fib_lookup(skb, f, sizeof(*f), 0);
}

/* bpf_redirect_neigh(ifindex, NULL, 0, 0) with the kernel's four arguments (bcc's helper
 * table declares an older prototype). */
static __always_inline long redirect_neigh(__u32 ifindex)
{
	long (*helper)(__u32, void *, int, __u64) = (void *)BPF_FUNC_redirect_neigh;

	return helper(ifindex, NULL, 0, 0);
}

/* Send the (translated) packet out where its route leads, MACs set; the stack would drop
 * a forwarded packet whose source is a local address (martian source). */
static __always_inline int redirect_out(struct __sk_buff *skb, struct pkt *p)
{
	struct bpf_fib_lookup f = {};
	int rc = fib(skb, p, p->daddr, &f);

	if (rc == BPF_FIB_LKUP_RET_SUCCESS) {
		if (bpf_skb_store_bytes(skb, 0, f.dmac, ETH_ALEN, 0) < 0 ||
		    bpf_skb_store_bytes(skb, ETH_ALEN, f.smac, ETH_ALEN, 0) < 0)
			return TC_ACT_SHOT;
		return bpf_redirect(f.ifindex, 0);
	}
	if (rc == BPF_FIB_LKUP_RET_NO_NEIGH)
		return redirect_neigh(f.ifindex);
	return TC_ACT_SHOT;
}

static __always_inline __u32 affinity_backend(const struct lb4_service *svc,
					      struct lb4_affinity_key *akey, __u64 now)
{
	struct lb_affinity_val *val = cilium_lb4_affinity.lookup(akey);
	struct lb_affinity_match match = {};
	struct lb4_backend *backend;

	if (!val)
		return 0;
	if (val->last_used + (__u64)svc->backend_id * NSEC_PER_SEC <= now)
		goto stale;
	match.backend_id = val->backend_id;
	match.rev_nat_id = svc->rev_nat_index;
	if (!cilium_lb_affinity_match.lookup(&match))
		goto stale;
	backend = cilium_lb4_backends_v3.lookup(&val->backend_id);
	if (!backend || backend->flags != BE_STATE_ACTIVE)
		goto stale;
	return val->backend_id;
stale:
	cilium_lb4_affinity.delete(akey);
	return 0;
}

/* Apply a forward entry: DNAT (and SNAT), then up the stack or out again. */
static __always_inline int forward(struct __sk_buff *skb, struct pkt *p, struct lb4_nat_entry *e)
{
	if (rewrite(skb, p, e->to_saddr, e->to_sport, e->to_daddr, e->to_dport) < 0)
		return TC_ACT_SHOT;
	if (e->to_saddr)
		return redirect_out(skb, p);
	return TC_ACT_OK;
}

/* A new flow to a NodePort of this node: choose a backend, record the flow, translate. */
static __always_inline int nodeport_new(struct __sk_buff *skb, struct pkt *p)
{
	struct lb4_key key = {};
	struct lb4_service *svc, *slot;
	struct lb4_backend *backend;
	struct lb4_affinity_key akey = {};
	struct lb4_nat_tuple fwd = {}, rev = {};
	struct lb4_nat_entry fval = {}, rval = {};
	struct bpf_fib_lookup f = {};
	__u32 backend_id = 0;
	__u64 now = bpf_ktime_get_ns();
	int rc, i;

	key.dport = p->dport;
	key.proto = p->proto;
	key.scope = LB_LOOKUP_SCOPE_EXT;
	svc = cilium_lb4_services_v2.lookup(&key);
	if (!svc || !(svc->flags & SVC_FLAG_NODEPORT))
		return CIL_NEXT;
	if (fib(skb, p, p->daddr, &f) != BPF_FIB_LKUP_RET_NOT_FWDED || p->daddr == 0xffffffff)
		return CIL_NEXT; /* not addressed to this node */
	if (svc->count == 0)
		return TC_ACT_SHOT; /* no backend here (externalTrafficPolicy Local) */
	if (svc->flags & SVC_FLAG_AFFINITY) {
		akey.client_cookie = p->saddr;
		akey.rev_nat_id = svc->rev_nat_index;
		backend_id = affinity_backend(svc, &akey, now);
	}
	if (!backend_id) {
		key.backend_slot = (bpf_get_prandom_u32() % svc->count) + 1;
		slot = cilium_lb4_services_v2.lookup(&key);
		if (!slot)
			return TC_ACT_SHOT; /* the Service is being rewritten */
		backend_id = slot->backend_id;
	}
	backend = cilium_lb4_backends_v3.lookup(&backend_id);
	if (!backend)
		return TC_ACT_SHOT;
	if (svc->flags & SVC_FLAG_AFFINITY) {
		struct lb_affinity_val aval = {.last_used = now, .backend_id = backend_id};

		cilium_lb4_affinity.update(&akey, &aval);
	}

	fwd.saddr = p->saddr;
	fwd.daddr = p->daddr;
	fwd.sport = p->sport;
	fwd.dport = p->dport;
	fwd.nexthdr = p->proto;
	fwd.flags = NAT_DIR_FWD;
	fval.to_daddr = backend->address;
	fval.to_dport = backend->port;
	fval.backend_id = backend_id;
	fval.rev_nat_index = svc->rev_nat_index;
	fval.created = now;

	rev.saddr = backend->address;
	rev.sport = backend->port;
	rev.nexthdr = p->proto;
	rev.flags = NAT_DIR_REPLY;
	rval.to_saddr = p->daddr;
	rval.to_sport = p->dport;
	rval.rev_nat_index = svc->rev_nat_index;
	rval.created = now;

	__builtin_memset(&f, 0, sizeof(f));
	rc = fib(skb, p, backend->address, &f);
	if ((rc == BPF_FIB_LKUP_RET_SUCCESS || rc == BPF_FIB_LKUP_RET_NO_NEIGH) &&
	    f.ifindex == skb->ifindex) {
		/* remote backend: SNAT to this node's address and a free NAT port */
		rev.daddr = p->daddr;
		rval.to_daddr = p->saddr;
		rval.to_dport = p->sport;
#pragma unroll
		for (i = 0; i < NAT_PORT_TRIES; i++) {
			rev.dport = htons(NAT_PORT_MIN + (bpf_get_prandom_u32() % NAT_PORT_SPAN));
			if (cilium_snat_v4_external.insert(&rev, &rval) == 0)
				break; /* BPF_NOEXIST: the port was free for this backend */
		}
		if (i == NAT_PORT_TRIES)
			return TC_ACT_SHOT;
		fval.to_saddr = p->daddr;
		fval.to_sport = rev.dport;
	} else {
		/* local backend: the client's address is kept; the reply leaves by to-netdev */
		rev.daddr = p->saddr;
		rev.dport = p->sport;
		if (cilium_snat_v4_external.update(&rev, &rval) < 0)
			return TC_ACT_SHOT;
	}
	if (cilium_snat_v4_external.update(&fwd, &fval) < 0)
		return TC_ACT_SHOT;
	return forward(skb, p, &fval);
}

int cil_from_netdev(struct __sk_buff *skb)
{
	struct pkt p = {};
	struct lb4_nat_tuple t = {};
	struct lb4_nat_entry *e;

	if (!parse(skb, &p))
		return CIL_NEXT;
	t.saddr = p.saddr;
	t.daddr = p.daddr;
	t.sport = p.sport;
	t.dport = p.dport;
	t.nexthdr = p.proto;
	t.flags = NAT_DIR_REPLY;
	e = cilium_snat_v4_external.lookup(&t);
	if (e && e->to_daddr) {
		/* a remote backend's reply to node:NAT port: back to the client */
		if (rewrite(skb, &p, e->to_saddr, e->to_sport, e->to_daddr, e->to_dport) < 0)
			return TC_ACT_SHOT;
		return redirect_out(skb, &p);
	}
	t.flags = NAT_DIR_FWD;
	e = cilium_snat_v4_external.lookup(&t);
	if (e) {
		if (cilium_lb4_backends_v3.lookup(&e->backend_id))
			return forward(skb, &p, e);
		cilium_snat_v4_external.delete(&t); /* its backend is gone: choose again */
	}
	return nodeport_new(skb, &p);
}

int cil_to_netdev(struct __sk_buff *skb)
{
	struct pkt p = {};
	struct lb4_nat_tuple t = {};
	struct lb4_nat_entry *e;

	if (!parse(skb, &p))
		return CIL_NEXT;
	t.saddr = p.saddr;
	t.daddr = p.daddr;
	t.sport = p.sport;
	t.dport = p.dport;
	t.nexthdr = p.proto;
	t.flags = NAT_DIR_REPLY;
	e = cilium_snat_v4_external.lookup(&t);
	if (!e || e->to_daddr)
		return CIL_NEXT;
	/* a local backend's reply to an outside client: from node:nodePort again */
	if (rewrite(skb, &p, e->to_saddr, e->to_sport, 0, 0) < 0)
		return TC_ACT_SHOT;
	return TC_ACT_OK;
}
