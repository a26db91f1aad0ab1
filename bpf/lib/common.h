/* Shared definitions of the Cilia endpoint datapath.
 *
 * Compiled by bcc (the agent passes the -D options below once per
 * configuration, never per endpoint). Layouts are mirrored in Python by the
 * agent's datapath package; change both together.
 *
 * Build-time options (with defaults):
 *   CILIA_PIN_DIR            "/sys/fs/bpf/cilia"   where maps are pinned
 *   CILIA_IPCACHE_MAX        512000                ipcache entries (upstream default)
 *   CILIA_POLICY_MAX         16384                 policy entries (upstream bpf-policy-map-max)
 *   CILIA_CT_MAX             262144                conntrack entries (LRU)
 *   CILIA_ENDPOINTS_MAX      65535                 local endpoints (upstream 64k/node)
 *   CILIA_EVENTS_PAGES       64                    ring buffer size in pages (power of 2)
 *   CILIA_EVENTS_WAKEUP_EVENTS 1                   wake the reader for every N-th event of a
 *                                                  CPU only (1 = every event; the reader also
 *                                                  drains the buffer on a timer)
 *   CILIA_MONITOR_AGGREGATION 3                    trace events of forwarded packets
 *                                                  (upstream --monitor-aggregation): 0 none =
 *                                                  every packet; 1 lowest, 2 low = every packet
 *                                                  entering a pod, the medium rule for packets
 *                                                  leaving it; 3 medium, 4 maximum = per
 *                                                  connection and direction only: its first
 *                                                  packet, a TCP flag of the flags below seen for
 *                                                  the first time, and one update per interval.
 *                                                  Drops are always reported, each one.
 *   CILIA_MONITOR_AGGREGATION_INTERVAL_NS 5e9      periodic update of an active connection
 *                                                  (upstream --monitor-aggregation-interval 5s)
 *   CILIA_MONITOR_AGGREGATION_FLAGS 0x07           TCP flags reported the first time they are
 *                                                  seen, byte 13 bits (upstream
 *                                                  --monitor-aggregation-flags all = syn,fin,rst)
 */
#ifndef CILIA_COMMON_H
#define CILIA_COMMON_H

#include <uapi/linux/bpf.h>
#include <uapi/linux/pkt_cls.h>
#include <uapi/linux/if_ether.h>
#include <uapi/linux/ip.h>
#include <uapi/linux/in.h>
#include <uapi/linux/tcp.h>
#include <uapi/linux/udp.h>
#include <uapi/linux/icmp.h>

#ifndef CILIA_PIN_DIR
#define CILIA_PIN_DIR "/sys/fs/bpf/cilia"
#endif
#ifndef CILIA_IPCACHE_MAX
#define CILIA_IPCACHE_MAX 512000
#endif
#ifndef CILIA_POLICY_MAX
#define CILIA_POLICY_MAX 16384
#endif
#ifndef CILIA_CT_MAX
#define CILIA_CT_MAX 262144
#endif
#ifndef CILIA_ENDPOINTS_MAX
#define CILIA_ENDPOINTS_MAX 65535
#endif
#ifndef CILIA_EVENTS_PAGES
#define CILIA_EVENTS_PAGES 64
#endif
#ifndef CILIA_EVENTS_WAKEUP_EVENTS
#define CILIA_EVENTS_WAKEUP_EVENTS 1
#endif
#ifndef CILIA_MONITOR_AGGREGATION
#define CILIA_MONITOR_AGGREGATION 3
#endif
#ifndef CILIA_MONITOR_AGGREGATION_INTERVAL_NS
#define CILIA_MONITOR_AGGREGATION_INTERVAL_NS 5000000000ULL
#endif
#ifndef CILIA_MONITOR_AGGREGATION_FLAGS
#define CILIA_MONITOR_AGGREGATION_FLAGS 0x07
#endif

/* Monitor aggregation levels (upstream option.MonitorAggregationLevel*). */
#define AGGREGATION_NONE 0
#define AGGREGATION_LOW 2
#define AGGREGATION_MEDIUM 3

/* Report times in the conntrack entry: nanoseconds >> 26 (67 ms units) in 16 bits,
 * compared with wrapping arithmetic (an entry idle for a multiple of 73 minutes may skip
 * one periodic update). */
#define CT_REPORT_SHIFT 26
#define CT_REPORT_INTERVAL \
	((CILIA_MONITOR_AGGREGATION_INTERVAL_NS >> CT_REPORT_SHIFT) ? \
	 (CILIA_MONITOR_AGGREGATION_INTERVAL_NS >> CT_REPORT_SHIFT) : 1)

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

/* Drop reasons, numbered as upstream (flow.DropReason). 0 = not dropped. */
#define REASON_FORWARDED 0
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
	__u16 pad;
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

struct ct_value {
	__u64 created_ns;
	__u64 last_seen_ns;
	__u64 packets;
	__u8 tcp_flags_seen;
	__u8 reply_seen;        /* 1 once a reply passed: its first one is reported */
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
	__u8 pad;
};

#endif /* CILIA_COMMON_H */
