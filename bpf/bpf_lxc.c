/* Cilia endpoint datapath: tc clsact programs on an endpoint's host-side veth.
 *
 *   cil_from_container  tc ingress of lxc… = packets the pod sends   (policy direction egress)
 *   cil_to_container    tc egress  of lxc… = packets sent to the pod (policy direction ingress)
 *
 * Per packet: pass established flows and replies through conntrack (a SYN on the entry
 * of a connection closed by FIN or RST is a new flow); otherwise resolve the peer's
 * security identity through the ipcache (unknown addresses are "world"; it is also
 * resolved for every event) and look the (endpoint, peer identity, direction, protocol,
 * port) up in the policy map: an explicit deny drops with POLICY_DENY (181),
 * an allow forwards and creates a conntrack entry, no match drops with
 * POLICY_DENIED (133) when the direction is enforced; on an endpoint in audit mode
 * (endpoint_info.policy_audit, the agent's --policy-audit-mode) either drop is reported as
 * a policy-verdict event with verdict AUDIT and the flow is allowed. Every drop emits an event on the
 * ring buffer; forwarded packets emit one as CONFIG.monitor_aggregation says (below:
 * at the default, medium, a connection's first packet in each direction, its SYN/FIN/RST
 * and one update per interval, reported where the packet goes: to-container of a local
 * pod, to-stack otherwise). An event the ring buffer refuses goes to a small rescue
 * ring; one that fits in neither is counted in cilia_events_counters (the agent reports
 * it as a LostEvent). The reader is woken for
 * every CONFIG.events_wakeup_events-th event of a CPU, or when half the ring buffer is
 * unread (it also drains on a timer). Per-CPU counters count packets
 * and bytes by reason and direction. A forwarded packet from the pod to another pod of
 * this node is redirected to that pod's host veth (local_delivery), where
 * cil_to_container decides it, instead of going up the host's IP stack.
 *
 * Non-IPv4 traffic (ARP for the router IP, IPv6) is passed untouched.
 */
#include <stddef.h>
#include "lib/common.h"

#define AF_INET 2

/* Load-time configuration (the agent writes it before load; mirrored by
 * cilia_agent.datapath.layout.LxcConfig):
 *   monitor_aggregation_interval_ns  periodic update of an active connection
 *                                    (upstream --monitor-aggregation-interval, 5 s)
 *   monitor_aggregation              trace events of forwarded packets (upstream
 *                                    --monitor-aggregation): 0 none = every packet at every
 *                                    observation point; 1 lowest, 2 low = every packet, but not
 *                                    as from-container; 3 medium, 4 maximum = per connection
 *                                    and direction only: its first packet, a TCP flag of the
 *                                    flags below seen for the first time, and one update per
 *                                    interval. Drops are always reported, each one.
 *   events_wakeup_events             wake the reader for every N-th event of a CPU, or
 *                                    when half the ring buffer is unread (1 = every
 *                                    event; the reader also drains on a timer)
 *   monitor_aggregation_flags        TCP flags reported the first time they are seen, byte 13
 *                                    bits (upstream --monitor-aggregation-flags all =
 *                                    syn,fin,rst = 0x07)
 *   ct_clock_coarse                  1: conntrack's clock is bpf_ktime_get_coarse_ns (5.11;
 *                                    the agent sets it when the kernel has the helper, as
 *                                    upstream's bpf_mono_now picks jiffies when it can);
 *                                    0: bpf_ktime_get_ns. Events always carry the latter.
 *   host_legacy_routing              0: a forwarded packet from a pod to another pod of this
 *                                    node is delivered by the program (local_delivery,
 *                                    below), not through the host's IP stack; 1: every
 *                                    packet goes up the stack (upstream
 *                                    --enable-host-legacy-routing).
 */
struct lxc_config {
	__u64 monitor_aggregation_interval_ns;
	__u32 monitor_aggregation;
	__u32 events_wakeup_events;
	__u8 monitor_aggregation_flags;
	__u8 ct_clock_coarse;
	__u8 host_legacy_routing;
	__u8 pad[5];
};

const volatile struct lxc_config CONFIG = {
	.monitor_aggregation_interval_ns = 5000000000ULL,
	.monitor_aggregation = AGGREGATION_MEDIUM,
	.events_wakeup_events = 1,
	.monitor_aggregation_flags = 0x07,
};

/* Maps. max_entries here are defaults; the agent sets the configured sizes at load
 * (ipcache 512000, endpoints 65535, policy 16384, conntrack 262144 as upstream). Pinned maps
 * keep their names, types, sizes and flags, so an agent restart reuses them. */
struct {
	__uint(type, BPF_MAP_TYPE_LPM_TRIE);
	__type(key, struct ipcache_key);
	__type(value, struct ipcache_value);
	__uint(max_entries, 512000);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} cilia_ipcache SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__type(key, __u32);
	__type(value, struct endpoint_info);
	__uint(max_entries, 65535);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} cilia_endpoints SEC(".maps");

/* Local endpoints by IPv4 address (network byte order) -> host-side veth ifindex
 * (upstream cilium_lxc, keyed by address). The programs read it for a forwarded packet
 * leaving a pod: to deliver it to a local pod (local_delivery) and to decide where it is
 * reported (handle, below). */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__type(key, __u32);
	__type(value, __u32);
	__uint(max_entries, 65535);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} cilia_lxc SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_LPM_TRIE);
	__type(key, struct policy_key);
	__type(value, struct policy_value);
	__uint(max_entries, 16384);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} cilia_policy SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__type(key, struct ct_key);
	__type(value, struct ct_value);
	__uint(max_entries, 262144);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} cilia_ct SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_HASH);
	__type(key, struct metrics_key);
	__type(value, struct metrics_value);
	__uint(max_entries, 1024);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} cilia_metrics SEC(".maps");

/* Flow events; max_entries is the size in bytes (pages * page size, set by the agent). */
struct {
	__uint(type, BPF_MAP_TYPE_RINGBUF);
	__uint(max_entries, 64 * 4096);
} cilia_events SEC(".maps");

/* Where an event goes when cilia_events refuses it although it has room. Measured on this
 * project's 6.18 VM: one event in 100,000 to 800,000 at 20,000 events/s was refused, one
 * of them while the ring held 448 unread bytes of 262,144 (bpf_ringbuf_query at the
 * failure): the reservation failed (its lock, presumably), not the space. A second ring
 * has its own lock.
 * The agent drains it on every pass of its reader (a rescued event arrives at most one
 * timer period late, out of order by that much). Its size is fixed at 4 pages (the agent
 * sets it in bytes for the running kernel's page size): it only takes what the main ring
 * refuses, and when both are full the event is counted lost. */
struct {
	__uint(type, BPF_MAP_TYPE_RINGBUF);
	__uint(max_entries, 4 * 4096);
} cilia_events_rescue SEC(".maps");

/* Per-CPU counters of the event path: [EVENTS_LOST] events that fit in neither ring
 * (read by the agent), [EVENTS_PENDING] events since the last wakeup, [EVENTS_RESCUED]
 * events cilia_events refused and cilia_events_rescue took. */
#define EVENTS_LOST 0
#define EVENTS_PENDING 1
#define EVENTS_RESCUED 2
#define EVENTS_WAKEUP_MIN 16
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__type(key, __u32);
	__type(value, __u64);
	__uint(max_entries, 3);
} cilia_events_counters SEC(".maps");

struct packet {
	__u32 saddr;
	__u32 daddr;
	__be16 sport;
	__be16 dport;
	__u8 proto;
	__u8 tcp_flags;
	__u32 len;
	__u8 icmp_type; /* ICMP: the header's type (policy_check looks rules up by it) */
};

/* Returns 1 for an IPv4 packet (fields filled), 0 for anything to pass untouched. */
static __always_inline int parse_packet(struct __sk_buff *skb, struct packet *p)
{
	void *data = (void *)(long)skb->data;
	void *data_end = (void *)(long)skb->data_end;
	struct ethhdr *eth = data;

	if ((void *)(eth + 1) > data_end)
		return 0;
	if (eth->h_proto != bpf_htons(ETH_P_IP))
		return 0;
	struct iphdr *ip = (void *)(eth + 1);
	if ((void *)(ip + 1) > data_end)
		return 0;
	p->saddr = ip->saddr;
	p->daddr = ip->daddr;
	p->proto = ip->protocol;
	p->len = skb->len;
	__u32 ihl = ip->ihl * 4;
	if (ihl < sizeof(*ip))
		return 1;
	/* Non-first fragments carry no L4 header: match them on addresses only. */
	if (ip->frag_off & bpf_htons(0x1FFF))
		return 1;
	void *l4 = (void *)ip + ihl;
	if (p->proto == IPPROTO_TCP) {
		struct tcphdr *tcp = l4;
		if ((void *)(tcp + 1) > data_end)
			return 1;
		p->sport = tcp->source;
		p->dport = tcp->dest;
		p->tcp_flags = ((__u8 *)tcp)[13];
	} else if (p->proto == IPPROTO_UDP) {
		struct udphdr *udp = l4;
		if ((void *)(udp + 1) > data_end)
			return 1;
		p->sport = udp->source;
		p->dport = udp->dest;
	} else if (p->proto == IPPROTO_SCTP) {
		/* The SCTP common header starts with the source and destination ports. */
		__be16 *ports = l4;
		if ((void *)(ports + 2) > data_end)
			return 1;
		p->sport = ports[0];
		p->dport = ports[1];
	} else if (p->proto == IPPROTO_ICMP) {
		struct icmphdr *icmp = l4;
		if ((void *)(icmp + 1) > data_end)
			return 1;
		p->icmp_type = icmp->type;
		/* Echo request and reply share the id: use it on both sides so the
		 * reply is the reverse tuple of the request. */
		if (icmp->type == ICMP_ECHO || icmp->type == ICMP_ECHOREPLY) {
			p->sport = icmp->un.echo.id;
			p->dport = icmp->un.echo.id;
		}
	}
	return 1;
}

static __always_inline __u32 identity_of(__u32 addr)
{
	struct ipcache_key key = {.prefixlen = 32, .ip = addr};
	struct ipcache_value *val = bpf_map_lookup_elem(&cilia_ipcache, &key);

	return val ? val->sec_identity : IDENTITY_WORLD;
}

static __always_inline void count(__u8 reason, __u8 dir, __u32 len)
{
	struct metrics_key key = {.reason = reason, .dir = dir};
	struct metrics_value zero = {};
	struct metrics_value *val = bpf_map_lookup_elem(&cilia_metrics, &key);

	if (!val) {
		bpf_map_update_elem(&cilia_metrics, &key, &zero, BPF_NOEXIST);
		val = bpf_map_lookup_elem(&cilia_metrics, &key);
	}
	if (val) {
		val->packets += 1;
		val->bytes += len;
	}
}

static __always_inline void account(struct policy_value *val, __u32 len)
{
	__sync_fetch_and_add(&val->packets, 1);
	__sync_fetch_and_add(&val->bytes, len);
}

/* Policy verdict for a new flow: 0 (allowed), DROP_POLICY_DENY or DROP_POLICY_DENIED.
 * ICMP is looked up by type: the rule's port is POLICY_ICMP_TYPE_BASE + type (so type 0
 * is not the wildcard port 0; the agent writes ICMP rules the same way). */
static __always_inline __u8 policy_check(struct endpoint_info *ep, __u32 peer, __u8 dir,
					 struct packet *p)
{
	struct policy_key key = {
		.prefixlen = POLICY_PREFIX_FULL,
		.ep_id = ep->ep_id,
		.sec_label = peer,
		.egress = dir,
		.protocol = p->proto,
		.dport = p->proto == IPPROTO_ICMP ? bpf_htons(POLICY_ICMP_TYPE_BASE + p->icmp_type)
						  : p->dport,
	};
	struct policy_value *exact = bpf_map_lookup_elem(&cilia_policy, &key);

	key.sec_label = 0;
	struct policy_value *any = bpf_map_lookup_elem(&cilia_policy, &key);

	if (exact && (exact->flags & POLICY_FLAG_DENY)) {
		account(exact, p->len);
		return DROP_POLICY_DENY;
	}
	if (any && (any->flags & POLICY_FLAG_DENY)) {
		account(any, p->len);
		return DROP_POLICY_DENY;
	}
	if (exact) {
		account(exact, p->len);
		return 0;
	}
	if (any) {
		account(any, p->len);
		return 0;
	}
	__u8 enforce = dir == DIR_EGRESS ? ep->enforce_egress : ep->enforce_ingress;
	return enforce ? DROP_POLICY_DENIED : 0;
}

/* emit()'s obs_point for an audit event (not an observation point; the event carries 0). */
#define OBS_AUDIT 0xff

static __always_inline void emit(struct __sk_buff *skb, struct packet *p, struct endpoint_info *ep,
				 __u32 peer, __u8 dir, __u8 reason, __u8 is_reply, __u8 obs_point)
{
	struct flow_event ev = {};

	ev.ts_ns = bpf_ktime_get_ns();
	ev.saddr = p->saddr;
	ev.daddr = p->daddr;
	ev.sport = p->sport;
	ev.dport = p->dport;
	ev.proto = p->proto;
	ev.event_type = reason ? EVENT_DROP : EVENT_TRACE;
	ev.verdict = reason ? VERDICT_DROPPED : VERDICT_FORWARDED;
	ev.drop_reason = reason;
	if (obs_point == OBS_AUDIT) {
		/* Audit mode: the policy verdict the packet would have had (upstream's policy
		 * verdict notification with its audit flag; the drop reason it would have had
		 * stays in drop_reason for the agent's log). */
		ev.event_type = EVENT_POLICY_VERDICT;
		ev.verdict = VERDICT_AUDIT;
		obs_point = 0;
	}
	ev.src_identity = dir == DIR_EGRESS ? ep->sec_identity : peer;
	ev.dst_identity = dir == DIR_EGRESS ? peer : ep->sec_identity;
	ev.ep_id = ep->ep_id;
	ev.ifindex = skb->ifindex;
	ev.len = p->len;
	ev.dir = dir;
	ev.is_reply = is_reply;
	ev.tcp_flags = p->tcp_flags;
	ev.obs_point = obs_point;
	/* Wake the reader for every CONFIG.events_wakeup_events-th event of a CPU, or
	 * when half the ring buffer waits to be read (with many CPUs each holding fewer than
	 * N events, the ring could otherwise fill before any CPU's count is reached), then
	 * at most every EVENTS_WAKEUP_MIN-th event of a CPU while the reader catches up. A
	 * wakeup is an irq_work (a self-IPI, tens of microseconds in a VM). */
	__u32 idx = EVENTS_PENDING;
	__u64 flags = 0;
	__u64 *pending = bpf_map_lookup_elem(&cilia_events_counters, &idx);
	if (CONFIG.events_wakeup_events > 1 && pending) {
		*pending += 1;
		if (*pending >= CONFIG.events_wakeup_events ||
		    (*pending >= EVENTS_WAKEUP_MIN &&
		     bpf_ringbuf_query(&cilia_events, BPF_RB_AVAIL_DATA) * 2 >=
			     bpf_ringbuf_query(&cilia_events, BPF_RB_RING_SIZE))) {
			flags = BPF_RB_FORCE_WAKEUP;
		} else {
			flags = BPF_RB_NO_WAKEUP;
		}
	}
	if (bpf_ringbuf_output(&cilia_events, &ev, sizeof(ev), flags) < 0) {
		/* Nothing written, no wakeup sent: the count stays, so the next event wakes.
		 * The event goes to the rescue ring (no wakeup: the reader drains it on its
		 * next pass), or is counted lost when that refuses it too. */
		idx = bpf_ringbuf_output(&cilia_events_rescue, &ev, sizeof(ev),
					 BPF_RB_NO_WAKEUP) < 0 ? EVENTS_LOST : EVENTS_RESCUED;
		__u64 *counter = bpf_map_lookup_elem(&cilia_events_counters, &idx);
		if (counter)
			*counter += 1;
	} else if (flags == BPF_RB_FORCE_WAKEUP && pending) {
		*pending = 0;
	}
}

/* Medium aggregation of an existing connection (upstream ct_update_timeout's report
 * rule): 1 when this packet is to be reported, updating the entry's report state. */
static __always_inline int ct_report(struct ct_value *ct, __u8 is_reply, __u8 tcp_flags,
				     __u64 now)
{
	__u16 t = now >> CT_REPORT_SHIFT;
	__u8 seen = tcp_flags & CONFIG.monitor_aggregation_flags;
	__u64 interval = CONFIG.monitor_aggregation_interval_ns >> CT_REPORT_SHIFT;

	if (!interval)
		interval = 1;

	if (is_reply) {
		if (!(ct->ct_flags & CT_REPLY_SEEN) || (seen & ~ct->rx_flags_reported) ||
		    (__u16)(t - ct->rx_report) >= interval) {
			ct->ct_flags |= CT_REPLY_SEEN;
			ct->rx_flags_reported |= seen;
			ct->rx_report = t;
			return 1;
		}
		return 0;
	}
	if ((seen & ~ct->tx_flags_reported) || (__u16)(t - ct->tx_report) >= interval) {
		ct->tx_flags_reported |= seen;
		ct->tx_report = t;
		return 1;
	}
	return 0;
}

/* Deliver a forwarded packet from a pod to a pod of this node without the host's IP stack
 * (upstream bpf_lxc's local delivery, ipv4_local_delivery: what --enable-host-legacy-routing
 * false gives): the TTL decremented as a router would (the IP checksum updated), MACs from
 * the kernel's FIB and neighbour table (bpf_fib_lookup: source = the destination's host
 * veth, destination = the pod's eth0), then redirected to the egress of that host veth,
 * where cil_to_container decides and reports the packet as for any other. The host's
 * routing, netfilter (the FORWARD chain, its conntrack) and forwarding counters are
 * skipped, as upstream's are. ifindex: the destination's host veth from cilia_lxc.
 * Returns TC_ACT_REDIRECT, or TC_ACT_OK (the stack forwards it) when the route does not
 * lead to that veth (the FIB answers otherwise, or has no route) or the TTL would expire
 * (the stack answers with ICMP time exceeded); TC_ACT_SHOT when the header cannot be
 * rewritten. */
static __always_inline int local_delivery(struct __sk_buff *skb, __u32 ifindex)
{
	void *data = (void *)(long)skb->data;
	void *data_end = (void *)(long)skb->data_end;
	struct iphdr *ip = data + ETH_HLEN;

	if ((void *)(ip + 1) > data_end || ip->ttl <= 1)
		return TC_ACT_OK;
	struct bpf_fib_lookup f = {
		.family = AF_INET,
		.l4_protocol = ip->protocol,
		/* tot_len 0: no MTU check. A TCP sender's GSO packet is up to 64 KiB, which
		 * the check would refuse (FRAG_NEEDED), sending every bulk-transfer packet
		 * through the stack; both pods' MTUs are the node's. */
		.ipv4_src = ip->saddr,
		.ipv4_dst = ip->daddr,
		.ifindex = skb->ifindex,
	};
	/* The TTL and the protocol are one 16-bit word of the header (offset 8), as the
	 * checksum sums it. */
	__u8 word[2] = {ip->ttl - 1, ip->protocol};
	__be16 old = *(__be16 *)&ip->ttl;
	__be16 new;
	__builtin_memcpy(&new, word, sizeof(new));
	int rc = bpf_fib_lookup(skb, &f, sizeof(f), 0);

	if ((rc != BPF_FIB_LKUP_RET_SUCCESS && rc != BPF_FIB_LKUP_RET_NO_NEIGH) ||
	    f.ifindex != ifindex)
		return TC_ACT_OK;
	if (bpf_skb_store_bytes(skb, ETH_HLEN + offsetof(struct iphdr, ttl), word, 1, 0) < 0)
		return TC_ACT_SHOT;
	if (bpf_l3_csum_replace(skb, ETH_HLEN + offsetof(struct iphdr, check), old, new, 2) < 0)
		return TC_ACT_SHOT;
	if (rc == BPF_FIB_LKUP_RET_NO_NEIGH)
		return bpf_redirect_neigh(ifindex, NULL, 0, 0);
	if (bpf_skb_store_bytes(skb, 0, f.dmac, ETH_ALEN, 0) < 0 ||
	    bpf_skb_store_bytes(skb, ETH_ALEN, f.smac, ETH_ALEN, 0) < 0)
		return TC_ACT_SHOT;
	return bpf_redirect(ifindex, 0);
}

static __always_inline int handle(struct __sk_buff *skb, __u8 dir)
{
	struct packet p = {};

	if (!parse_packet(skb, &p))
		return TC_ACT_OK;
	__u32 ifindex = skb->ifindex;
	struct endpoint_info *ep = bpf_map_lookup_elem(&cilia_endpoints, &ifindex);
	if (!ep)
		return TC_ACT_OK;
	/* Source address verification (upstream's, in its endpoint program): a pod sends only
	 * from its own address, else the packet is dropped (DROP_INVALID_SIP, counted and
	 * reported), so a forged source never reaches a peer that takes identity from it. */
	if (dir == DIR_EGRESS && ep->ipv4 && p.saddr != ep->ipv4) {
		count(DROP_INVALID_SIP, dir, p.len);
		emit(skb, &p, ep, identity_of(p.daddr), dir, DROP_INVALID_SIP, 0, 0);
		return TC_ACT_SHOT;
	}

	/* The peer's identity is looked up only when it is needed: a new flow's policy
	 * decision, or an event (most packets of a connection need neither). */
	__u32 peer_addr = dir == DIR_EGRESS ? p.daddr : p.saddr;
	__u32 peer = 0;
	__u8 ct_dir = dir == DIR_EGRESS ? CT_DIR_EGRESS : CT_DIR_INGRESS;
	struct ct_key fwd = {.saddr = p.saddr, .daddr = p.daddr, .sport = p.sport,
			     .dport = p.dport, .proto = p.proto, .dir = ct_dir};
	struct ct_key rev = {.saddr = p.daddr, .daddr = p.saddr, .sport = p.dport,
			     .dport = p.sport, .proto = p.proto,
			     .dir = dir == DIR_EGRESS ? CT_DIR_INGRESS : CT_DIR_EGRESS};
	/* Conntrack's clock: the coarse monotonic one where the kernel has it (the last tick,
	 * no clock source read: ~30 ns less per packet, measured with BPF_PROG_TEST_RUN on an
	 * established flow; ticks of 1-10 ms are far finer than any timeout or report
	 * interval). The verifier drops the branch CONFIG rules out, so a kernel without the
	 * helper loads the object. Events carry the precise clock, read in emit. */
	__u64 now = CONFIG.ct_clock_coarse ? bpf_ktime_get_coarse_ns() : bpf_ktime_get_ns();
	__u8 is_reply = 0;
	__u8 reason = 0;
	__u8 is_new = 0;

	struct ct_value *ct = bpf_map_lookup_elem(&cilia_ct, &fwd);
	if (!ct) {
		ct = bpf_map_lookup_elem(&cilia_ct, &rev);
		if (ct)
			is_reply = 1;
	}
	/* A SYN without ACK on the entry of a connection that saw FIN or RST starts a new
	 * connection on a reused tuple (upstream CT_REOPENED): the packet is a new flow, so
	 * policy is decided again and the SYN reported. The entry is reused in place when
	 * the tuple is the same way round (no delete and insert: the LRU's free-list work
	 * twice per connection), deleted otherwise. */
	struct ct_value *reopen = 0;
	if (ct && (p.tcp_flags & (TH_SYN | TH_ACK)) == TH_SYN &&
	    (ct->tcp_flags_seen & (TH_FIN | TH_RST))) {
		if (is_reply)
			bpf_map_delete_elem(&cilia_ct, &rev);
		else
			reopen = ct;
		ct = NULL;
		is_reply = 0;
	}
	__u8 report = 0;
	if (ct) {
		ct->last_seen_ns = now;
		__sync_fetch_and_add(&ct->packets, 1);
		ct->tcp_flags_seen |= p.tcp_flags;
		/* Which way closed: the conntrack GC gives an entry the close timeout once
		 * both ways sent FIN (or one RST), as upstream; a half-closed connection
		 * keeps the established one. */
		if (p.tcp_flags & TH_FIN)
			ct->ct_flags |= is_reply ? CT_RX_FIN : CT_TX_FIN;
		report = ct_report(ct, is_reply, p.tcp_flags, now);
	} else {
		peer = identity_of(peer_addr);
		reason = policy_check(ep, peer, dir, &p);
		/* Audit mode (upstream --policy-audit-mode): a flow the policy would drop is
		 * reported as AUDIT and then handled as allowed (conntrack entry, counted as
		 * forwarded), so nothing is dropped while the endpoint audits. */
		if (reason && ep->policy_audit) {
			emit(skb, &p, ep, peer, dir, reason, 0, OBS_AUDIT);
			reason = 0;
		}
		if (!reason) {
			struct ct_value entry = {
				.created_ns = now,
				.last_seen_ns = now,
				.packets = 1,
				.tcp_flags_seen = p.tcp_flags,
				.ct_flags = (p.tcp_flags & TH_FIN) ? CT_TX_FIN : 0,
				.tx_flags_reported = p.tcp_flags & CONFIG.monitor_aggregation_flags,
				.tx_report = now >> CT_REPORT_SHIFT,
			};
			/* In place, not atomically: an entry the LRU evicted and reused
			 * meanwhile is overwritten whole (the hit path writes through the
			 * same kind of pointer). */
			if (reopen)
				*reopen = entry;
			else
				bpf_map_update_elem(&cilia_ct, &fwd, &entry, BPF_ANY);
			is_new = 1;
		} else if (reopen) {
			bpf_map_delete_elem(&cilia_ct, &fwd);
		}
	}

	count(reason, dir, p.len);
	if (reason) {
		emit(skb, &p, ep, peer, dir, reason, is_reply, 0);
		return TC_ACT_SHOT;
	}
	/* Trace events of a forwarded packet, by observation point as upstream's
	 * emit_trace_notify: with aggregation none every packet is reported where it is seen
	 * (from-container, to-container) and once more as handed to the stack when it leaves
	 * for something other than a local pod; from low on nothing is reported as
	 * from-container (the packet is reported where it goes: the destination pod's
	 * to-container, or to-stack here when that is not a local pod), and from medium on
	 * only the packets conntrack reports (is_new, ct_report). A connection between two
	 * pods of the node is therefore reported once per reported packet, not twice. */
	__u32 aggregation = CONFIG.monitor_aggregation;
	__u8 reported = aggregation <= AGGREGATION_LOW || is_new || report;
	if (dir == DIR_INGRESS) {
		if (reported) {
			if (ct)
				peer = identity_of(peer_addr);
			emit(skb, &p, ep, peer, dir, 0, is_reply, TRACE_TO_LXC);
		}
		return TC_ACT_OK;
	}
	/* Leaving the pod: is it for a local pod? A hash lookup, needed for delivery and,
	 * for a reported packet, to decide before the peer's identity is looked up (the
	 * ipcache's LPM trie) whether it is reported here at all: a packet for a local pod is
	 * left to that pod's to-container, so it costs no more. */
	if (!reported && CONFIG.host_legacy_routing)
		return TC_ACT_OK;
	__u32 *lxc = bpf_map_lookup_elem(&cilia_lxc, &p.daddr);
	if (reported && (!lxc || aggregation == AGGREGATION_NONE)) {
		if (ct)
			peer = identity_of(peer_addr);
		if (aggregation == AGGREGATION_NONE)
			emit(skb, &p, ep, peer, dir, 0, is_reply, TRACE_FROM_LXC);
		if (!lxc)
			emit(skb, &p, ep, peer, dir, 0, is_reply, TRACE_TO_STACK);
	}
	/* (A forged source was dropped above; the check stays for an endpoint without an
	 * address.) */
	if (!lxc || CONFIG.host_legacy_routing || p.saddr != ep->ipv4)
		return TC_ACT_OK;
	/* A reply is delivered here only when the peer pod sent the original to this pod's
	 * address itself: then its from-container made the egress entry of that tuple. A
	 * connection whose original the host translated (a hostPort's DNAT by portmap, a
	 * kube-proxy Service) has no such entry; its replies go up the stack, whose conntrack
	 * translates them back. */
	if (is_reply) {
		rev.dir = CT_DIR_EGRESS; /* the original's tuple, as the peer's egress keyed it */
		if (!bpf_map_lookup_elem(&cilia_ct, &rev))
			return TC_ACT_OK;
	}
	return local_delivery(skb, *lxc);
}

SEC("tc")
int cil_from_container(struct __sk_buff *skb)
{
	return handle(skb, DIR_EGRESS);
}

SEC("tc")
int cil_to_container(struct __sk_buff *skb)
{
	return handle(skb, DIR_INGRESS);
}

char _license[] SEC("license") = "GPL";
