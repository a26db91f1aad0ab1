/* Cilia endpoint datapath: tc clsact programs on an endpoint's host-side veth.
 *
 *   cil_from_container  tc ingress of lxc… = packets the pod sends   (policy direction egress)
 *   cil_to_container    tc egress  of lxc… = packets sent to the pod (policy direction ingress)
 *
 * Per packet: resolve the peer's security identity through the ipcache
 * (unknown addresses are "world"), pass established flows and replies through
 * conntrack, otherwise look the (endpoint, peer identity, direction, protocol,
 * port) up in the policy map: an explicit deny drops with POLICY_DENY (181),
 * an allow forwards and creates a conntrack entry, no match drops with
 * POLICY_DENIED (133) when the direction is enforced. Every drop emits an event on the
 * ring buffer; forwarded packets emit one as CILIA_MONITOR_AGGREGATION says (lib/common.h:
 * at the default, medium, a connection's first packet in each direction, its SYN/FIN/RST
 * and one update per interval). An event that does not fit in the ring buffer is counted
 * in cilia_events_counters (the agent reports it as a LostEvent). The reader is woken for
 * every CILIA_EVENTS_WAKEUP_EVENTS-th event of a CPU only (it also drains on a timer). Per-CPU counters count packets
 * and bytes by reason and direction.
 *
 * Non-IPv4 traffic (ARP for the router IP, IPv6) is passed untouched.
 */
#include "lib/common.h"

BPF_TABLE_PINNED("lpm_trie", struct ipcache_key, struct ipcache_value, cilia_ipcache,
		 CILIA_IPCACHE_MAX, CILIA_PIN_DIR "/cilia_ipcache", BPF_F_NO_PREALLOC);
BPF_TABLE_PINNED("hash", __u32, struct endpoint_info, cilia_endpoints, CILIA_ENDPOINTS_MAX,
		 CILIA_PIN_DIR "/cilia_endpoints");
BPF_TABLE_PINNED("lpm_trie", struct policy_key, struct policy_value, cilia_policy,
		 CILIA_POLICY_MAX, CILIA_PIN_DIR "/cilia_policy", BPF_F_NO_PREALLOC);
BPF_TABLE_PINNED("lru_hash", struct ct_key, struct ct_value, cilia_ct, CILIA_CT_MAX,
		 CILIA_PIN_DIR "/cilia_ct");
BPF_TABLE_PINNED("percpu_hash", struct metrics_key, struct metrics_value, cilia_metrics, 1024,
		 CILIA_PIN_DIR "/cilia_metrics");
BPF_RINGBUF_OUTPUT(cilia_events, CILIA_EVENTS_PAGES);
/* Per-CPU counters of the event path: [EVENTS_LOST] events that did not fit in
 * cilia_events (read by the agent), [EVENTS_PENDING] events since the last wakeup. */
#define EVENTS_LOST 0
#define EVENTS_PENDING 1
BPF_PERCPU_ARRAY(cilia_events_counters, __u64, 2);

struct packet {
	__u32 saddr;
	__u32 daddr;
	__be16 sport;
	__be16 dport;
	__u8 proto;
	__u8 tcp_flags;
	__u32 len;
};

/* Returns 1 for an IPv4 packet (fields filled), 0 for anything to pass untouched. */
static __always_inline int parse_packet(struct __sk_buff *skb, struct packet *p)
{
	void *data = (void *)(long)skb->data;
	void *data_end = (void *)(long)skb->data_end;
	struct ethhdr *eth = data;

	if ((void *)(eth + 1) > data_end)
		return 0;
	if (eth->h_proto != htons(ETH_P_IP))
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
	if (ip->frag_off & htons(0x1FFF))
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
	} else if (p->proto == IPPROTO_ICMP) {
		struct icmphdr *icmp = l4;
		if ((void *)(icmp + 1) > data_end)
			return 1;
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
	struct ipcache_value *val = cilia_ipcache.lookup(&key);

	return val ? val->sec_identity : IDENTITY_WORLD;
}

static __always_inline void count(__u8 reason, __u8 dir, __u32 len)
{
	struct metrics_key key = {.reason = reason, .dir = dir};
	struct metrics_value zero = {};
	struct metrics_value *val = cilia_metrics.lookup_or_try_init(&key, &zero);

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

/* Policy verdict for a new flow: 0 (allowed), DROP_POLICY_DENY or DROP_POLICY_DENIED. */
static __always_inline __u8 policy_check(struct endpoint_info *ep, __u32 peer, __u8 dir,
					 struct packet *p)
{
	struct policy_key key = {
		.prefixlen = POLICY_PREFIX_FULL,
		.ep_id = ep->ep_id,
		.sec_label = peer,
		.egress = dir,
		.protocol = p->proto,
		.dport = p->dport,
	};
	struct policy_value *exact = cilia_policy.lookup(&key);

	key.sec_label = 0;
	struct policy_value *any = cilia_policy.lookup(&key);

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

static __always_inline void emit(struct __sk_buff *skb, struct packet *p, struct endpoint_info *ep,
				 __u32 peer, __u8 dir, __u8 reason, __u8 is_reply)
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
	ev.src_identity = dir == DIR_EGRESS ? ep->sec_identity : peer;
	ev.dst_identity = dir == DIR_EGRESS ? peer : ep->sec_identity;
	ev.ep_id = ep->ep_id;
	ev.ifindex = skb->ifindex;
	ev.len = p->len;
	ev.dir = dir;
	ev.is_reply = is_reply;
	ev.tcp_flags = p->tcp_flags;
	/* Wake the reader for every CILIA_EVENTS_WAKEUP_EVENTS-th event of a CPU only. */
	__u32 idx = EVENTS_PENDING;
	__u64 flags = 0;
	__u64 *pending = cilia_events_counters.lookup(&idx);
	if (CILIA_EVENTS_WAKEUP_EVENTS > 1 && pending) {
		*pending += 1;
		if (*pending >= CILIA_EVENTS_WAKEUP_EVENTS) {
			*pending = 0;
			flags = BPF_RB_FORCE_WAKEUP;
		} else {
			flags = BPF_RB_NO_WAKEUP;
		}
	}
	if (cilia_events.ringbuf_output(&ev, sizeof(ev), flags) < 0) {
		idx = EVENTS_LOST;
		__u64 *lost = cilia_events_counters.lookup(&idx);
		if (lost)
			*lost += 1;
	}
}

/* Medium aggregation of an existing connection (upstream ct_update_timeout's report
 * rule): 1 when this packet is to be reported, updating the entry's report state. */
static __always_inline int ct_report(struct ct_value *ct, __u8 is_reply, __u8 tcp_flags,
				     __u64 now)
{
	__u16 t = now >> CT_REPORT_SHIFT;
	__u8 seen = tcp_flags & CILIA_MONITOR_AGGREGATION_FLAGS;

	if (is_reply) {
		if (!ct->reply_seen || (seen & ~ct->rx_flags_reported) ||
		    (__u16)(t - ct->rx_report) >= CT_REPORT_INTERVAL) {
			ct->reply_seen = 1;
			ct->rx_flags_reported |= seen;
			ct->rx_report = t;
			return 1;
		}
		return 0;
	}
	if ((seen & ~ct->tx_flags_reported) || (__u16)(t - ct->tx_report) >= CT_REPORT_INTERVAL) {
		ct->tx_flags_reported |= seen;
		ct->tx_report = t;
		return 1;
	}
	return 0;
}

static __always_inline int handle(struct __sk_buff *skb, __u8 dir)
{
	struct packet p = {};

	if (!parse_packet(skb, &p))
		return TC_ACT_OK;
	__u32 ifindex = skb->ifindex;
	struct endpoint_info *ep = cilia_endpoints.lookup(&ifindex);
	if (!ep)
		return TC_ACT_OK;

	__u32 peer = identity_of(dir == DIR_EGRESS ? p.daddr : p.saddr);
	__u8 ct_dir = dir == DIR_EGRESS ? CT_DIR_EGRESS : CT_DIR_INGRESS;
	struct ct_key fwd = {.saddr = p.saddr, .daddr = p.daddr, .sport = p.sport,
			     .dport = p.dport, .proto = p.proto, .dir = ct_dir};
	struct ct_key rev = {.saddr = p.daddr, .daddr = p.saddr, .sport = p.dport,
			     .dport = p.sport, .proto = p.proto,
			     .dir = dir == DIR_EGRESS ? CT_DIR_INGRESS : CT_DIR_EGRESS};
	__u64 now = bpf_ktime_get_ns();
	__u8 is_reply = 0;
	__u8 reason = 0;
	__u8 is_new = 0;

	struct ct_value *ct = cilia_ct.lookup(&fwd);
	if (!ct) {
		ct = cilia_ct.lookup(&rev);
		if (ct)
			is_reply = 1;
	}
	__u8 report = 0;
	if (ct) {
		ct->last_seen_ns = now;
		__sync_fetch_and_add(&ct->packets, 1);
		ct->tcp_flags_seen |= p.tcp_flags;
		report = ct_report(ct, is_reply, p.tcp_flags, now);
	} else {
		reason = policy_check(ep, peer, dir, &p);
		if (!reason) {
			struct ct_value entry = {
				.created_ns = now,
				.last_seen_ns = now,
				.packets = 1,
				.tcp_flags_seen = p.tcp_flags,
				.tx_flags_reported = p.tcp_flags & CILIA_MONITOR_AGGREGATION_FLAGS,
				.tx_report = now >> CT_REPORT_SHIFT,
			};
			cilia_ct.update(&fwd, &entry);
			is_new = 1;
		}
	}

	count(reason, dir, p.len);
	if (reason) {
		emit(skb, &p, ep, peer, dir, reason, is_reply);
		return TC_ACT_SHOT;
	}
	if (CILIA_MONITOR_AGGREGATION == AGGREGATION_NONE ||
	    (CILIA_MONITOR_AGGREGATION <= AGGREGATION_LOW && dir == DIR_INGRESS) || is_new ||
	    report)
		emit(skb, &p, ep, peer, dir, 0, is_reply);
	return TC_ACT_OK;
}

int cil_from_container(struct __sk_buff *skb)
{
	return handle(skb, DIR_EGRESS);
}

int cil_to_container(struct __sk_buff *skb)
{
	return handle(skb, DIR_INGRESS);
}
