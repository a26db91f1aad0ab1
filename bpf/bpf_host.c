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
 *                  by, without a gateway when CONFIG.tunnel is set): destination
 *                  rewritten to the backend, the client's address kept
 *                  (the pod's policy program sees the client: identity world); the
 *                  packet goes on up the stack to the pod. The reply leaves by this
 *                  device: to-netdev rewrites its source back to node:nodePort.
 *   remote backend (its route leaves by this device again, or, with tunnel routing, goes
 *                  through a gateway: another node's pod CIDR behind the tunnel device;
 *                  its replies to this node come back over the LAN): destination
 *                  rewritten to the backend and source to this node's address and a NAT
 *                  port (32768-65535,
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
 *
 * BPF masquerade (CONFIG.masquerade; upstream enable-bpf-masquerade), on the same devices:
 *   cil_to_netdev   a packet leaving by a device listed in cilia_masq_dev_v4 (ifindex ->
 *                   the node address to masquerade to), whose source is in
 *                   cilia_masq_src_v4 (this node's masqueraded pod CIDRs) and whose
 *                   destination is not in cilium_ipmasq_v4 (every pod CIDR of the cluster,
 *                   ipv4-native-routing-cidr, the ip-masq-agent's nonMasqueradeCIDRs, every
 *                   node's address) gets source node:NAT port; the port is chosen at random
 *                   in CONFIG.nat_port_min..nat_port_max, up to NAT_PORT_TRIES tries, and is
 *                   free when no other flow to the same destination address:port holds it
 *                   (BPF_NOEXIST on the reply entry). No free port: the packet is dropped and
 *                   counted in cilia_nat_stats (NAT_STAT_MASQ_EXHAUSTED).
 *   cil_from_netdev the reply, outside -> node:NAT port, gets the pod's address and port back
 *                   and goes on up the stack, which routes it to the pod.
 * TCP, UDP and ICMP echo (the echo identifier is translated as the port). Both directions
 * are recorded in cilium_snat_v4_external (flagged NAT_F_MASQ); entries age out of the LRU
 * map and are removed by the agent's NAT GC once idle (`created` is refreshed by the
 * forward direction's packets).
 */
#include <stddef.h>
#include <linux/bpf.h>
#include <linux/pkt_cls.h>
#include <linux/if_ether.h>
#include <linux/ip.h>
#include <linux/in.h>
#include "lib/common.h" /* struct icmphdr, ICMP_ECHO* */
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_endian.h>
#include "lib/lb.h"

/* The map of this program only (the four shared with bpf_sock.c are in lib/lb.h). */
struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__type(key, struct lb4_nat_tuple);
	__type(value, struct lb4_nat_entry);
	__uint(max_entries, CILIA_LB_NAT_MAX);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} cilium_snat_v4_external SEC(".maps");

/* BPF masquerade: which destinations are never masqueraded (upstream's name: the map its
 * ip-masq-agent fills) and which sources are, as longest-prefix-match tries. */
struct masq_lpm_key {
	__u32 prefixlen; /* 0..32 */
	__be32 addr;
};

#define CILIA_MASQ_CIDR_MAX 16384

struct {
	__uint(type, BPF_MAP_TYPE_LPM_TRIE);
	__type(key, struct masq_lpm_key);
	__type(value, __u8);
	__uint(max_entries, CILIA_MASQ_CIDR_MAX);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} cilium_ipmasq_v4 SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_LPM_TRIE);
	__type(key, struct masq_lpm_key);
	__type(value, __u8);
	__uint(max_entries, CILIA_MASQ_CIDR_MAX);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} cilia_masq_src_v4 SEC(".maps");

/* The masquerading devices: ifindex -> the address their masqueraded packets leave from. */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__type(key, __u32);
	__type(value, __be32);
	__uint(max_entries, 256);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} cilia_masq_dev_v4 SEC(".maps");

/* Counters (per CPU, index NAT_STAT_*), read by the agent as metrics. */
#define NAT_STAT_MASQ_NEW 0       /* masqueraded flows started */
#define NAT_STAT_MASQ_EXHAUSTED 1 /* packets dropped: no free NAT port */
#define NAT_STAT_NODEPORT_EXHAUSTED 2 /* NodePort requests dropped: no free NAT port */
#define NAT_STAT_MAX 4
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__type(key, __u32);
	__type(value, __u64);
	__uint(max_entries, NAT_STAT_MAX);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} cilia_nat_stats SEC(".maps");

static __always_inline void nat_stat(__u32 index)
{
	__u64 *count = bpf_map_lookup_elem(&cilia_nat_stats, &index);

	if (count)
		*count += 1;
}

/* Load-time configuration: the agent writes it into .rodata before loading (so the verifier
 * prunes what a configuration disables). Mirrored by the agent's loadbalancer/layout.py
 * (HostProgramConfig); change both together. */
struct host_config {
	/* 1 with --routing-mode tunnel: a backend whose route goes through a gateway is a pod
	 * of another node, reached through the tunnel device (datapath/routing.py routes each
	 * node's pod CIDRs "via <node> dev <tunnel> onlink"); 0 with native routing, where
	 * another node's pods are routed through the device the request came in by. */
	__u32 tunnel;
	/* 1 with --enable-bpf-masquerade: cil_to_netdev masquerades pod traffic (see above). */
	__u32 masquerade;
	/* NAT ports of both NodePort SNAT and masquerade, host order, inclusive
	 * (--bpf-nat-port-range; upstream's NAT range is NodePort's maximum + 1 .. 65535). */
	__u32 nat_port_min;
	__u32 nat_port_max;
};

const volatile struct host_config CONFIG = {
	.tunnel = 0, .masquerade = 0, .nat_port_min = 32768, .nat_port_max = 65535};

/* A packet these programs leave alone goes on to the next program on the device (tcx
 * TCX_NEXT, clsact: the next filter), e.g. another agent's on the same device in a test
 * stack; with none left it is passed. A translated one is passed (TC_ACT_OK) or redirected. */
#define CIL_NEXT TC_ACT_UNSPEC
#define AF_INET 2
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
	__u32 sport_off; /* where sport/dport are written (ICMP echo: the identifier's offset) */
	__u32 dport_off;
};

/* A NAT port drawn at random from CONFIG's range (network order). */
static __always_inline __be16 nat_port(void)
{
	__u32 span = CONFIG.nat_port_max - CONFIG.nat_port_min + 1;

	return bpf_htons(CONFIG.nat_port_min + (bpf_get_prandom_u32() % span));
}

/* An ICMP echo request or reply: the identifier is the request's source port and the
 * reply's destination port (the other one 0), so a reply's tuple is the request's reversed.
 * 1 when filled, 0 for other ICMP messages. */
static __always_inline int parse_icmp(struct __sk_buff *skb, struct pkt *p)
{
	struct icmphdr icmp;

	if (bpf_skb_load_bytes(skb, p->l4_off, &icmp, sizeof(icmp)) < 0 || icmp.code != 0)
		return 0;
	p->csum_off = p->l4_off + offsetof(struct icmphdr, checksum);
	p->sport_off = p->dport_off = p->l4_off + offsetof(struct icmphdr, un.echo.id);
	if (icmp.type == ICMP_ECHO) {
		p->sport = icmp.un.echo.id;
		p->dport = 0;
		return 1;
	}
	if (icmp.type == ICMP_ECHOREPLY) {
		p->sport = 0;
		p->dport = icmp.un.echo.id;
		return 1;
	}
	return 0;
}

/* 1 for an unfragmented IPv4 TCP/UDP packet or ICMP echo (fields filled), 0 for anything
 * else. */
static __always_inline int parse(struct __sk_buff *skb, struct pkt *p)
{
	struct iphdr ip;
	__be16 ports[2];

	if (skb->protocol != bpf_htons(ETH_P_IP))
		return 0;
	if (bpf_skb_load_bytes(skb, IP_OFF, &ip, sizeof(ip)) < 0)
		return 0;
	if (ip.version != 4 || ip.ihl < 5)
		return 0;
	if (ip.frag_off & bpf_htons(0x3fff)) /* MF or a fragment offset */
		return 0;
	p->l4_off = IP_OFF + ip.ihl * 4;
	p->saddr = ip.saddr;
	p->daddr = ip.daddr;
	p->proto = ip.protocol;
	if (ip.protocol == IPPROTO_ICMP)
		return parse_icmp(skb, p);
	if (ip.protocol != IPPROTO_TCP && ip.protocol != IPPROTO_UDP)
		return 0;
	if (bpf_skb_load_bytes(skb, p->l4_off, ports, sizeof(ports)) < 0)
		return 0;
	p->sport = ports[0];
	p->dport = ports[1];
	p->sport_off = p->l4_off;
	p->dport_off = p->l4_off + 2;
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
	/* the ICMP checksum covers no pseudo-header: an address change leaves it alone */
	if (p->proto != IPPROTO_ICMP && bpf_l4_csum_replace(skb, p->csum_off, old, new, l4) < 0)
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

/* Rewrite one side of the packet, the address at addr_off and the port at port_off, from
 * *cur_addr:*cur_port to addr:port (checksums included), and record the new values in
 * *cur_addr and *cur_port. 0, or -1 on error. */
static __always_inline int rewrite_side(struct __sk_buff *skb, struct pkt *p, int addr_off,
					int port_off, __be32 *cur_addr, __be16 *cur_port,
					__be32 addr, __be16 port)
{
	if (set_addr(skb, p, addr_off, *cur_addr, addr) < 0 ||
	    set_port(skb, p, port_off, *cur_port, port) < 0)
		return -1;
	*cur_addr = addr;
	*cur_port = port;
	return 0;
}

/* Rewrite source and destination (a 0 address keeps that side). 0 or -1 on error. */
static __always_inline int rewrite(struct __sk_buff *skb, struct pkt *p, __be32 saddr,
				   __be16 sport, __be32 daddr, __be16 dport)
{
	if (saddr && rewrite_side(skb, p, IP_SRC_OFF, p->sport_off, &p->saddr, &p->sport, saddr,
				  sport) < 0)
		return -1;
	if (daddr && rewrite_side(skb, p, IP_DST_OFF, p->dport_off, &p->daddr, &p->dport, daddr,
				  dport) < 0)
		return -1;
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
		return bpf_redirect_neigh(f.ifindex, NULL, 0, 0);
	return TC_ACT_SHOT;
}

/* The translation-state key of packet p as it travels, direction dir (NAT_DIR_*). */
static __always_inline void tuple_of(const struct pkt *p, struct lb4_nat_tuple *t, __u8 dir)
{
	t->saddr = p->saddr;
	t->daddr = p->daddr;
	t->sport = p->sport;
	t->dport = p->dport;
	t->nexthdr = p->proto;
	t->flags = dir;
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

/* 1 when the backend at addr, whose route f was just looked up from skb's device, is on
 * another host: its replies reach this node only if the request leaves with this node's
 * address as its source. */
static __always_inline int backend_remote(struct __sk_buff *skb, struct bpf_fib_lookup *f,
					  __be32 addr)
{
	if (f->ifindex == skb->ifindex)
		return 1;
	return CONFIG.tunnel && f->ipv4_dst != addr; /* bpf_fib_lookup: ipv4_dst = the gateway */
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

	if (p->proto == IPPROTO_ICMP)
		return CIL_NEXT; /* NodePorts are TCP/UDP */
	key.dport = p->dport;
	key.proto = p->proto;
	key.scope = LB_LOOKUP_SCOPE_EXT;
	svc = bpf_map_lookup_elem(&cilium_lb4_services_v2, &key);
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
		slot = bpf_map_lookup_elem(&cilium_lb4_services_v2, &key);
		if (!slot)
			return TC_ACT_SHOT; /* the Service is being rewritten */
		backend_id = slot->backend_id;
	}
	backend = bpf_map_lookup_elem(&cilium_lb4_backends_v3, &backend_id);
	if (!backend)
		return TC_ACT_SHOT;
	if (svc->flags & SVC_FLAG_AFFINITY) {
		struct lb_affinity_val aval = {.last_used = now, .backend_id = backend_id};

		bpf_map_update_elem(&cilium_lb4_affinity, &akey, &aval, BPF_ANY);
	}

	tuple_of(p, &fwd, NAT_DIR_FWD);
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
	    backend_remote(skb, &f, backend->address)) {
		/* remote backend: SNAT to this node's address and a free NAT port */
		rev.daddr = p->daddr;
		rval.to_daddr = p->saddr;
		rval.to_dport = p->sport;
#pragma unroll
		for (i = 0; i < NAT_PORT_TRIES; i++) {
			rev.dport = nat_port();
			if (bpf_map_update_elem(&cilium_snat_v4_external, &rev, &rval, BPF_NOEXIST) == 0)
				break; /* BPF_NOEXIST: the port was free for this backend */
		}
		if (i == NAT_PORT_TRIES) {
			nat_stat(NAT_STAT_NODEPORT_EXHAUSTED);
			return TC_ACT_SHOT;
		}
		fval.to_saddr = p->daddr;
		fval.to_sport = rev.dport;
	} else {
		/* local backend: the client's address is kept; the reply leaves by to-netdev */
		rev.daddr = p->saddr;
		rev.dport = p->sport;
		if (bpf_map_update_elem(&cilium_snat_v4_external, &rev, &rval, BPF_ANY) < 0)
			return TC_ACT_SHOT;
	}
	if (bpf_map_update_elem(&cilium_snat_v4_external, &fwd, &fval, BPF_ANY) < 0)
		return TC_ACT_SHOT;
	return forward(skb, p, &fval);
}

/* 1 when addr is in the LPM trie map. */
static __always_inline int in_cidrs(void *map, __be32 addr)
{
	struct masq_lpm_key key = {.prefixlen = 32, .addr = addr};

	return bpf_map_lookup_elem(map, &key) != NULL;
}

/* BPF masquerade of a packet leaving by skb's device (see the top of the file). */
static __always_inline int masq_egress(struct __sk_buff *skb, struct pkt *p)
{
	struct lb4_nat_tuple fwd = {}, rev = {};
	struct lb4_nat_entry fval = {}, rval = {};
	struct lb4_nat_entry *e;
	__u32 ifindex = skb->ifindex;
	__be32 *node, addr;
	__u64 now;
	int i;

	node = bpf_map_lookup_elem(&cilia_masq_dev_v4, &ifindex);
	if (!node)
		return CIL_NEXT;
	addr = *node;
	if (p->saddr == addr || (p->proto == IPPROTO_ICMP && p->dport != 0))
		return CIL_NEXT; /* the node's own traffic; an echo reply leaving */
	if (!in_cidrs(&cilia_masq_src_v4, p->saddr) || in_cidrs(&cilium_ipmasq_v4, p->daddr))
		return CIL_NEXT;
	now = bpf_ktime_get_ns();
	tuple_of(p, &fwd, NAT_DIR_FWD);
	e = bpf_map_lookup_elem(&cilium_snat_v4_external, &fwd);
	if (e && (e->flags & NAT_F_MASQ) && e->to_saddr == addr) {
		/* a known flow: its reply entry must still be there (LRU, GC) and its own */
		rev.saddr = p->daddr;
		rev.sport = p->dport;
		rev.daddr = addr;
		rev.dport = e->to_sport;
		rev.nexthdr = p->proto;
		rev.flags = NAT_DIR_REPLY;
		rval.to_daddr = p->saddr;
		rval.to_dport = p->sport;
		rval.flags = NAT_F_MASQ;
		rval.created = now;
		struct lb4_nat_entry *r = bpf_map_lookup_elem(&cilium_snat_v4_external, &rev);

		if ((r && r->to_daddr == p->saddr && r->to_dport == p->sport) ||
		    (!r && bpf_map_update_elem(&cilium_snat_v4_external, &rev, &rval,
					       BPF_NOEXIST) == 0)) {
			e->created = now; /* last use, for the agent's GC */
			if (r)
				r->created = now;
			if (rewrite(skb, p, addr, e->to_sport, 0, 0) < 0)
				return TC_ACT_SHOT;
			return TC_ACT_OK;
		}
		/* its port went to another flow meanwhile: choose a new one */
	}
	rev.saddr = p->daddr;
	rev.sport = p->dport;
	rev.daddr = addr;
	rev.nexthdr = p->proto;
	rev.flags = NAT_DIR_REPLY;
	rval.to_daddr = p->saddr;
	rval.to_dport = p->sport;
	rval.flags = NAT_F_MASQ;
	rval.created = now;
#pragma unroll
	for (i = 0; i < NAT_PORT_TRIES; i++) {
		rev.dport = nat_port();
		if (bpf_map_update_elem(&cilium_snat_v4_external, &rev, &rval, BPF_NOEXIST) == 0)
			break;
	}
	if (i == NAT_PORT_TRIES) {
		nat_stat(NAT_STAT_MASQ_EXHAUSTED);
		return TC_ACT_SHOT;
	}
	fval.to_saddr = addr;
	fval.to_sport = rev.dport;
	fval.flags = NAT_F_MASQ;
	fval.created = now;
	if (bpf_map_update_elem(&cilium_snat_v4_external, &fwd, &fval, BPF_ANY) < 0) {
		bpf_map_delete_elem(&cilium_snat_v4_external, &rev);
		return TC_ACT_SHOT;
	}
	nat_stat(NAT_STAT_MASQ_NEW);
	if (rewrite(skb, p, addr, rev.dport, 0, 0) < 0)
		return TC_ACT_SHOT;
	return TC_ACT_OK;
}

SEC("tc")
int cil_from_netdev(struct __sk_buff *skb)
{
	struct pkt p = {};
	struct lb4_nat_tuple t = {};
	struct lb4_nat_entry *e;

	if (!parse(skb, &p))
		return CIL_NEXT;
	tuple_of(&p, &t, NAT_DIR_REPLY);
	e = bpf_map_lookup_elem(&cilium_snat_v4_external, &t);
	if (CONFIG.masquerade && e && (e->flags & NAT_F_MASQ)) {
		/* a reply to a masqueraded pod flow: back to the pod, routed by the stack */
		if (rewrite(skb, &p, 0, 0, e->to_daddr, e->to_dport) < 0)
			return TC_ACT_SHOT;
		return TC_ACT_OK;
	}
	if (p.proto == IPPROTO_ICMP)
		return CIL_NEXT;
	if (e && (e->flags & NAT_F_MASQ))
		return CIL_NEXT; /* masquerade off: an earlier run's entry, not a NodePort flow */
	if (e && e->to_daddr) {
		/* a remote backend's reply to node:NAT port: back to the client */
		if (rewrite(skb, &p, e->to_saddr, e->to_sport, e->to_daddr, e->to_dport) < 0)
			return TC_ACT_SHOT;
		return redirect_out(skb, &p);
	}
	t.flags = NAT_DIR_FWD;
	e = bpf_map_lookup_elem(&cilium_snat_v4_external, &t);
	if (e && !(e->flags & NAT_F_MASQ)) {
		if (bpf_map_lookup_elem(&cilium_lb4_backends_v3, &e->backend_id))
			return forward(skb, &p, e);
		bpf_map_delete_elem(&cilium_snat_v4_external, &t); /* its backend is gone: choose again */
	}
	return nodeport_new(skb, &p);
}

SEC("tc")
int cil_to_netdev(struct __sk_buff *skb)
{
	struct pkt p = {};
	struct lb4_nat_tuple t = {};
	struct lb4_nat_entry *e;

	if (!parse(skb, &p))
		return CIL_NEXT;
	tuple_of(&p, &t, NAT_DIR_REPLY);
	e = bpf_map_lookup_elem(&cilium_snat_v4_external, &t);
	if (!e || e->to_daddr || (e->flags & NAT_F_MASQ))
		return CONFIG.masquerade ? masq_egress(skb, &p) : CIL_NEXT;
	/* a local backend's reply to an outside client: from node:nodePort again */
	if (rewrite(skb, &p, e->to_saddr, e->to_sport, 0, 0) < 0)
		return TC_ACT_SHOT;
	return TC_ACT_OK;
}

/* GPL, as bcc loaded these programs: bpf_fib_lookup is a GPL-only helper. */
char LICENSE[] SEC("license") = "GPL";
