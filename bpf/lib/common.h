/* Shared definitions of the Cilia endpoint datapath.
 *
 * Compiled ahead of time by clang (`make bpf`: bpf/bpf_*.c -> build/bpf/bpf_*.o) and loaded
 * by the agent with libbpf. Layouts are mirrored in Python by the agent's datapath package
 * (datapath/layout.py); change both together.
 *
 * Map sizes are not compiled in: the agent sets each map's max_entries before load
 * (--bpf-ipcache-map-max, --bpf-policy-map-max, --bpf-ct-global-max, the endpoint and ring
 * buffer sizes); the values in the map definitions are only defaults. Other options are
 * load-time constants in the program's CONFIG (bpf_lxc.c: struct lxc_config), which the
 * verifier sees as constants, so a disabled branch is pruned as a -D option pruned it.
 */
#ifndef CILIA_COMMON_H
#define CILIA_COMMON_H

#include <linux/bpf.h>
#include <linux/pkt_cls.h>
#include <linux/if_ether.h>
#include <linux/ip.h>
#include <linux/in.h>
#include <linux/tcp.h>
#include <linux/udp.h>
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_endian.h>

/* The ICMP echo header (RFC 792): <linux/icmp.h> pulls in libc's socket headers, which do
 * not build for the bpf target. */
#define ICMP_ECHOREPLY 0
#define ICMP_ECHO 8
struct icmphdr {
	__u8 type;
	__u8 code;
	__sum16 checksum;
	union {
		struct {
			__be16 id;
			__be16 sequence;
		} echo;
		__be32 gateway;
	} un;
};

/* Monitor aggregation levels (upstream option.MonitorAggregationLevel*). */
#define AGGREGATION_NONE 0
#define AGGREGATION_LOW 2
#define AGGREGATION_MEDIUM 3

/* TCP header byte 13 flags (named as upstream; not linux/tcp.h's TCP_FLAG_*, which are
 * big-endian masks of the 32-bit word). */
#define TH_FIN 0x01
#define TH_SYN 0x02
#define TH_RST 0x04
#define TH_ACK 0x10

/* Report times in the conntrack entry: nanoseconds >> 26 (67 ms units) in 16 bits,
 * compared with wrapping arithmetic (an entry idle for a multiple of 73 minutes may skip
 * one periodic update). */
#define CT_REPORT_SHIFT 26

/* Reserved security identities (upstream pkg/identity/numericidentity.go). */
#define IDENTITY_UNKNOWN 0
#define IDENTITY_HOST 1
#define IDENTITY_WORLD 2

/* Directions, as in the upstream policy key: 0 ingress (to the pod), 1 egress (from the pod). */
#define DIR_INGRESS 0
#define DIR_EGRESS 1

/* Verdicts, numbered as Hubble's flow.Verdict. */
#define VERDICT_FORWARDED 1
#define VERDICT_DROPPED 2
#define VERDICT_AUDIT 4

/* Drop reasons, numbered as upstream (flow.DropReason). 0 = not dropped. */
#define REASON_FORWARDED 0
#define DROP_INVALID_SIP 132 /* a pod sent a packet whose source is not its own address */
#define DROP_POLICY_DENIED 133 /* no rule allows it while the direction is enforced */
#define DROP_POLICY_DENY 181   /* an explicit deny rule matched */

/* ipcache: longest-prefix match IPv4 address -> security identity. */
struct ipcache_key {
	__u32 prefixlen; /* bits of ip that must match, 0..32 */
	__u32 ip;        /* network byte order */
};

struct ipcache_value {
	__u32 sec_identity;
	__u32 node_ip; /* node that hosts the address, network byte order; 0 = local/unknown */
};

/* endpoints: host-side veth ifindex -> endpoint. */
struct endpoint_info {
	__u32 ep_id;
	__u32 sec_identity;
	__u32 ipv4;            /* network byte order */
	__u8 enforce_ingress;  /* 1 = default-deny ingress */
	__u8 enforce_egress;   /* 1 = default-deny egress */
	__u8 policy_audit;     /* 1 = audit mode: a policy drop is forwarded and reported as
				* AUDIT (upstream --policy-audit-mode, per endpoint) */
	__u8 pad;
};

/* policy: one LPM trie for all endpoints. The first 72 bits (ep_id,
 * sec_label, egress) always match in full; +8 bits with a protocol, +16
 * more with a port (upstream policy key, extended with the endpoint id).
 * sec_label 0 = any peer (looked up separately). */
#define POLICY_PREFIX_STATIC 72
#define POLICY_PREFIX_PROTO 80
#define POLICY_PREFIX_FULL 96
struct policy_key {
	__u32 prefixlen;
	__u32 ep_id;
	__u32 sec_label;
	__u8 egress;
	__u8 protocol; /* 0 = any */
	__be16 dport;  /* 0 = any */
};

#define POLICY_FLAG_DENY 1
/* An ICMP rule's dport: this + the ICMP type (cilia_agent.policy.rules.ICMP_TYPE_BASE). */
#define POLICY_ICMP_TYPE_BASE 256
struct policy_value {
	__u8 flags;
	__u8 pad[7];
	__u64 packets;
	__u64 bytes;
};

/* conntrack: 5-tuple + the hook that created the entry. */
#define CT_DIR_EGRESS 1
#define CT_DIR_INGRESS 2
struct ct_key {
	__u32 saddr;
	__u32 daddr;
	__be16 sport;
	__be16 dport;
	__u8 proto;
	__u8 dir;
	__u16 pad;
};

/* ct_value.ct_flags (bit 0 was the whole byte "reply_seen" before 2026-12-02: entries
 * made by older programs read the same). */
#define CT_REPLY_SEEN 0x01 /* a reply passed (its first one is reported) */
#define CT_TX_FIN 0x02     /* FIN seen in the original direction */
#define CT_RX_FIN 0x04     /* FIN seen in the reply direction */
struct ct_value {
	__u64 created_ns;   /* conntrack's clock: bpf_ktime_get_coarse_ns() where the */
	__u64 last_seen_ns; /* kernel has it (CONFIG.ct_clock_coarse), else _get_ns() */
	__u64 packets;
	__u8 tcp_flags_seen;    /* TCP flags of both directions */
	__u8 ct_flags;          /* CT_REPLY_SEEN | CT_TX_FIN | CT_RX_FIN */
	__u8 tx_flags_reported; /* aggregation flags already reported, original direction */
	__u8 rx_flags_reported; /* the same, reply direction */
	__u16 tx_report;        /* last report, original direction (CT_REPORT_SHIFT units) */
	__u16 rx_report;        /* last report, reply direction */
};

/* metrics: per-CPU counters by (reason, direction); reason 0 = forwarded. */
struct metrics_key {
	__u8 reason;
	__u8 dir;
	__u16 pad;
};

struct metrics_value {
	__u64 packets;
	__u64 bytes;
};

/* One ring-buffer event per trace or drop (layout mirrored in Python). */
#define EVENT_TRACE 4  /* upstream monitor message type: trace */
#define EVENT_DROP 1   /* upstream monitor message type: drop */
#define EVENT_POLICY_VERDICT 5 /* upstream monitor message type: policy verdict (audit) */

/* A trace event's observation point (upstream monitor/api trace observation points). */
#define TRACE_TO_LXC 0   /* delivered to the endpoint (to-container) */
#define TRACE_TO_STACK 3 /* handed from the endpoint to the host's stack (not a local pod) */
#define TRACE_FROM_LXC 5 /* sent by the endpoint (from-container) */
struct flow_event {
	__u64 ts_ns;        /* bpf_ktime_get_ns() (monotonic) */
	__u32 saddr;        /* network byte order */
	__u32 daddr;
	__be16 sport;
	__be16 dport;
	__u8 proto;
	__u8 event_type;    /* EVENT_TRACE | EVENT_DROP */
	__u8 verdict;       /* VERDICT_* */
	__u8 drop_reason;   /* DROP_* or 0 */
	__u32 src_identity;
	__u32 dst_identity;
	__u32 ep_id;
	__u32 ifindex;
	__u32 len;          /* bytes on the wire */
	__u8 dir;           /* DIR_INGRESS | DIR_EGRESS, seen from the endpoint */
	__u8 is_reply;
	__u8 tcp_flags;
	__u8 obs_point;     /* TRACE_TO_LXC, TRACE_TO_STACK, TRACE_FROM_LXC (drops: 0) */
};

#endif /* CILIA_COMMON_H */
