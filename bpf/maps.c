/* Every map of the datapath, declared once, created (or re-opened) pinned under EPX_PIN_DIR.
 *
 * The loader compiles this unit first: bcc opens a map that is already pinned instead of
 * creating it, so the maps (connections included) outlive the agent across restarts. bcc's
 * table reflection of this file (Key/Leaf ctypes) is what tests/bpf checks structs.py against.
 * The programs then reach these maps by file descriptor (see lib/maps.h): bcc rewrites
 * `map.lookup()` only in a program's main file, never in the shared headers.
 */
#include "lib/common.h"

#ifndef EPX_PIN_DIR
#error "compile with -DEPX_PIN_DIR=\"<bpffs directory>\" (the loader passes it)"
#endif
#define EPX_PIN(name) EPX_PIN_DIR "/" #name

/* Capacities come from the loader (loader.MAX_ENTRIES), one -DEPX_<MAP>_MAX each, so that it
 * can tell a pinned map of another size from ours; a missing one fails the compile here. */

/* frontend -> service */
BPF_TABLE_PINNED("hash", struct lb4_key, struct lb4_service, epx_svc, EPX_SVC_MAX, EPX_PIN(epx_svc));
/* backend id -> address */
BPF_TABLE_PINNED("hash", __u32, struct lb4_backend, epx_backend, EPX_BACKEND_MAX, EPX_PIN(epx_backend));
/* (service id, scope, slot) -> backend id */
BPF_TABLE_PINNED("hash", struct lb4_slot_key, __u32, epx_slot, EPX_SLOT_MAX, EPX_PIN(epx_slot));
/* (service id, client) -> backend id, last use */
BPF_TABLE_PINNED("lru_hash", struct lb4_affinity_key, struct lb4_affinity, epx_affinity, EPX_AFFINITY_MAX,
		 EPX_PIN(epx_affinity));
/* (service id, client prefix) -> admitted (loadBalancerSourceRanges) */
BPF_TABLE_PINNED("lpm_trie", struct lb4_range_key, __u32, epx_src_range, EPX_SRC_RANGE_MAX, EPX_PIN(epx_src_range),
		 BPF_F_NO_PREALLOC);
/* this node's addresses (what a NodePort listens on, what "from the node" means) */
BPF_TABLE_PINNED("hash", __be32, __u32, epx_node_addr, EPX_NODE_ADDR_MAX, EPX_PIN(epx_node_addr));
/* the CIDR local-traffic detector's prefixes (--cluster-cidr, or the Node's podCIDRs): "from a pod" */
BPF_TABLE_PINNED("lpm_trie", struct lpm4_key, __u32, epx_pod_cidr, EPX_POD_CIDR_MAX, EPX_PIN(epx_pod_cidr),
		 BPF_F_NO_PREALLOC);
/* ifindex -> EPX_IF_*: pod devices, and what the interface local-traffic detectors match */
BPF_TABLE_PINNED("hash", __u32, __u32, epx_iface, EPX_IFACE_MAX, EPX_PIN(epx_iface));
/* connections (see ct4_key in common.h); full: ct4_early_drop, then EPX_DROP_CT_FULL. Not
 * preallocated: its capacity is kube-proxy's conntrack limit (maxPerCore x CPUs: 4 million
 * entries on 64 CPUs), a limit as nf_conntrack_max is, not memory taken up front. */
BPF_TABLE_PINNED("hash", struct ct4_key, struct ct4_entry, epx_ct4, EPX_CT4_MAX, EPX_PIN(epx_ct4),
		 BPF_F_NO_PREALLOC);
/* per CPU, the connections it created last: where ct4_early_drop looks for one to drop */
BPF_TABLE_PINNED("percpu_array", __u32, struct ct4_ring, epx_ct4_ring, 1, EPX_PIN(epx_ct4_ring));
/* first-fragment ports, for the later fragments of the same datagram */
BPF_TABLE_PINNED("lru_hash", struct frag4_key, struct frag4_ports, epx_frag4, EPX_FRAG4_MAX, EPX_PIN(epx_frag4));
/* socket LB: backend a UDP socket talks to -> frontend its recvmsg must show */
BPF_TABLE_PINNED("lru_hash", struct sock4_rev_key, struct sock4_rev, epx_sock_rev, EPX_SOCK_REV_MAX,
		 EPX_PIN(epx_sock_rev));
/* node configuration, one entry */
BPF_TABLE_PINNED("array", __u32, struct lb4_config, epx_config, 1, EPX_PIN(epx_config));
/* per-CPU packet/byte counters by enum epx_reason */
BPF_TABLE_PINNED("percpu_array", __u32, struct epx_stat, epx_stats, EPX_REASON_MAX, EPX_PIN(epx_stats));
/* trace mode (common.h): what the last trace run on each CPU decided */
BPF_TABLE_PINNED("percpu_array", __u32, struct epx_trace_rec, epx_trace, 1, EPX_PIN(epx_trace));

/* ---- IPv6 (common.h: the IPv6 section): the same roles, their own maps and id space ---- */
/* frontend -> service */
BPF_TABLE_PINNED("hash", struct lb6_key, struct lb4_service, epx_svc6, EPX_SVC6_MAX, EPX_PIN(epx_svc6));
/* backend id -> address */
BPF_TABLE_PINNED("hash", __u32, struct lb6_backend, epx_backend6, EPX_BACKEND6_MAX, EPX_PIN(epx_backend6));
/* (service id, scope, slot) -> backend id */
BPF_TABLE_PINNED("hash", struct lb4_slot_key, __u32, epx_slot6, EPX_SLOT6_MAX, EPX_PIN(epx_slot6));
/* (service id, client) -> backend id, last use */
BPF_TABLE_PINNED("lru_hash", struct lb6_affinity_key, struct lb4_affinity, epx_affinity6, EPX_AFFINITY6_MAX,
		 EPX_PIN(epx_affinity6));
/* (service id, client prefix) -> admitted (loadBalancerSourceRanges) */
BPF_TABLE_PINNED("lpm_trie", struct lb6_range_key, __u32, epx_src_range6, EPX_SRC_RANGE6_MAX, EPX_PIN(epx_src_range6),
		 BPF_F_NO_PREALLOC);
/* this node's IPv6 addresses */
BPF_TABLE_PINNED("hash", struct epx_in6, __u32, epx_node_addr6, EPX_NODE_ADDR6_MAX, EPX_PIN(epx_node_addr6));
/* the CIDR local-traffic detector's IPv6 prefixes */
BPF_TABLE_PINNED("lpm_trie", struct lpm6_key, __u32, epx_pod_cidr6, EPX_POD_CIDR6_MAX, EPX_PIN(epx_pod_cidr6),
		 BPF_F_NO_PREALLOC);
/* IPv6 connections (ct6_key); full: EPX_DROP_CT_FULL (no early drop for IPv6 yet) */
BPF_TABLE_PINNED("hash", struct ct6_key, struct ct6_entry, epx_ct6, EPX_CT6_MAX, EPX_PIN(epx_ct6),
		 BPF_F_NO_PREALLOC);
/* the IPv6 masquerade address, one entry */
BPF_TABLE_PINNED("array", __u32, struct lb6_config, epx_config6, 1, EPX_PIN(epx_config6));
/* socket LB: backend an IPv6 UDP socket talks to -> frontend its recvmsg6 must show */
BPF_TABLE_PINNED("lru_hash", struct sock6_rev_key, struct sock6_rev, epx_sock_rev6, EPX_SOCK_REV6_MAX,
		 EPX_PIN(epx_sock_rev6));
/* per-CPU scratch of the IPv6 connection steps (common.h: struct scratch6) */
BPF_TABLE_PINNED("percpu_array", __u32, struct scratch6, epx_scratch6, 1, EPX_PIN(epx_scratch6));
