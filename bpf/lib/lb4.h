/* Service load balancing: kube-proxy's iptables-mode decisions (shared SEMANTICS.md) for IPv4.
 *
 * lb4_lookup_service  frontend -> service (exact frontend, else NodePort on a node address)
 * lb4_lookup_packet_service  the same for a packet's destination (never 0.0.0.0)
 * lb4_local_pod       kube-proxy's local-traffic detector (source CIDR or ingress interface)
 * lb4_origin          pod / node / external, as kube-proxy's rules tell sources apart
 * lb4_policy          endpoint set (cluster or local), masquerade, or REJECT / DROP
 * lb4_select_backend  session affinity, else a uniformly random slot
 * lb4_forward         the ingress path: established connection, or a new one
 *
 * lb4_select_backend and lb4_forward take a trace record (trace.h): NULL for live packets; with
 * one they decide alike, record the decision, and write nothing (no affinity, no connection).
 */
#ifndef EPX_LB4_H
#define EPX_LB4_H

#include "lib/nat4.h"

struct lb4_choice {
	__u8 scope; /* LB4_SCOPE_* */
	__u8 masq;
};

static __always_inline struct lb4_service *lb4_lookup_service(__be32 daddr, __be16 dport, __u8 proto)
{
	struct lb4_key key = { .addr = daddr, .port = dport, .proto = proto };
	struct lb4_service *svc = epx_lookup(epx_svc, &key);

	if (svc || !epx_lookup(epx_node_addr, &daddr))
		return svc;
	key.addr = 0; /* NodePort: any of this node's addresses */
	return epx_lookup(epx_svc, &key);
}

/* The service a packet to daddr:dport addresses, for the packet programs. 0.0.0.0 is never one: it
 * is the key NodePorts are stored under, but as a destination on the wire it is not a node address
 * (addrtype calls it BROADCAST, not LOCAL, and the kernel drops it as martian), so kube-proxy's
 * KUBE-NODEPORTS never sees it; without this check the exact lookup above found the NodePort and
 * DNATed a packet the kernel would have dropped (found by tests/bpf/test_fuzz_packets.py).
 * The socket LB keeps lb4_lookup_service: a connect() to 0.0.0.0 does reach the node itself. */
static __always_inline struct lb4_service *lb4_lookup_packet_service(__be32 daddr, __be16 dport, __u8 proto)
{
	return daddr ? lb4_lookup_service(daddr, dport, proto) : NULL;
}

static __always_inline int lb4_in_pod_cidr(__be32 saddr)
{
	struct lpm4_key key = { .prefixlen = 32, .addr = saddr };

	return epx_lookup(epx_pod_cidr, &key) != NULL;
}

static __always_inline __u32 lb4_iface_flags(__u32 ifindex)
{
	__u32 *flags = epx_lookup(epx_iface, &ifindex);

	return flags ? *flags : 0;
}

/* kube-proxy's LocalTrafficDetector.IfLocal, from what the packet carries: its source address
 * (ClusterCIDR, NodeCIDR: `-s CIDR`) or the device it arrived on (BridgeInterface,
 * InterfaceNamePrefix: `-i NAME`, the agent marks the matching devices in epx_iface). */
static __always_inline int lb4_local_pod(__be32 saddr, __u32 ifindex, __u32 cfg_flags)
{
	if (cfg_flags & CFG_F_DETECT_NONE)
		return 0;
	if (cfg_flags & CFG_F_DETECT_IFACE)
		return !!(lb4_iface_flags(ifindex) & EPX_IF_LOCAL);
	return lb4_in_pod_cidr(saddr);
}

static __always_inline __u8 lb4_origin(__be32 saddr, __u32 ifindex, __u32 cfg_flags)
{
	if (lb4_local_pod(saddr, ifindex, cfg_flags))
		return EPX_ORIGIN_POD;
	if (epx_lookup(epx_node_addr, &saddr))
		return EPX_ORIGIN_NODE;
	return EPX_ORIGIN_EXTERNAL;
}

static __always_inline int lb4_source_admitted(const struct lb4_service *svc, __be32 saddr)
{
	struct lb4_range_key key = { .prefixlen = 64, .svc_id = svc->id, .addr = saddr };

	return epx_lookup(epx_src_range, &key) != NULL;
}

/* The part of kube-proxy's choice that depends on neither family nor address: the endpoint set
 * and the masquerade for a service with usable endpoints whose source ranges admitted the client,
 * from where the packet comes (`origin`). lb4_policy and lb6_policy (lb6.h) end here. Returns 0
 * with `c` filled, or EPX_REJECT / EPX_DROP_*. */
static __always_inline __u32 lb_policy_scope(const struct lb4_service *svc, __u8 origin, __u32 cfg_flags,
					     struct lb4_choice *c)
{
	int masq_all = !!(cfg_flags & CFG_F_MASQ_ALL);

	if (!(svc->flags & LB4_F_EXTERNAL)) {
		/* clusterIP: masquerade what does not come from a pod (rules 1, 2); with
		 * --masquerade-all, everything. Without a detector kube-proxy has no rule telling pods
		 * apart, and masquerades none of it. */
		c->masq = masq_all || (origin != EPX_ORIGIN_POD && !(cfg_flags & CFG_F_DETECT_NONE));
		if (svc->flags & LB4_F_ITP_LOCAL) { /* rule 12 */
			c->scope = LB4_SCOPE_LOCAL;
			return svc->local_count ? 0 : EPX_DROP_NO_LOCAL_INTERNAL;
		}
		c->scope = LB4_SCOPE_CLUSTER;
		return svc->count ? 0 : EPX_REJECT;
	}
	if (!(svc->flags & LB4_F_ETP_LOCAL)) {
		/* rule 4: any endpoint, always masqueraded */
		c->masq = 1;
		c->scope = LB4_SCOPE_CLUSTER;
		return svc->count ? 0 : EPX_REJECT;
	}
	switch (origin) {
	case EPX_ORIGIN_POD: /* rules 6, 11: short-circuited to every endpoint, source kept: kube-proxy's
			      * KUBE-EXT "pod traffic" jump skips the clusterIP's masquerade rule (it
			      * matches the clusterIP as destination), so --masquerade-all does not apply */
		c->masq = 0;
		c->scope = LB4_SCOPE_CLUSTER;
		return svc->count ? 0 : EPX_REJECT;
	case EPX_ORIGIN_NODE:	   /* rule 7 */
	case EPX_ORIGIN_LOCALHOST: /* rule 8: 127.0.0.0/8 is a LOCAL source as well, so current
				    * kube-proxy's KUBE-EXT "route LOCAL traffic" applies: any endpoint */
		c->masq = 1;
		c->scope = LB4_SCOPE_CLUSTER;
		return svc->count ? 0 : EPX_REJECT;
	default: /* rule 5: local endpoints only, client IP preserved */
		c->masq = 0;
		c->scope = LB4_SCOPE_LOCAL;
		return svc->local_count ? 0 : EPX_DROP_NO_LOCAL_EXTERNAL;
	}
}

/* kube-proxy's choice for a new connection to `svc` from `saddr`. Returns 0 with `c` filled, or
 * EPX_REJECT / EPX_DROP_*. Masquerade here is the policy's; hairpin is added by the caller. */
static __always_inline __u32 lb4_policy(const struct lb4_service *svc, __be32 saddr, __u8 origin, __u32 cfg_flags,
					struct lb4_choice *c)
{
	if (!(svc->flags & LB4_F_HAS_ENDPOINTS))
		return EPX_REJECT; /* rule 9: no usable endpoint anywhere */
	if ((svc->flags & LB4_F_SOURCE_RANGES) && !lb4_source_admitted(svc, saddr))
		return EPX_DROP_SOURCE_RANGE; /* rule 11 */
	return lb_policy_scope(svc, origin, cfg_flags, c);
}

/* Choose a backend of `svc` in `scope` for `client` (rules 1, 10, 13). Returns 0 with *backend_id
 * and *be filled, or EPX_DROP_NO_BACKEND. */
static __always_inline __u32 lb4_select_backend(const struct lb4_service *svc, __u8 scope, __be32 client, __u64 now,
						__u32 *backend_id, struct lb4_backend *be, struct epx_trace_rec *tr)
{
	struct lb4_affinity_key akey = { .svc_id = svc->id, .client = client };
	__u8 member = scope == LB4_SCOPE_LOCAL ? LB4_BE_IN_LOCAL : LB4_BE_IN_CLUSTER;
	__u16 count = scope == LB4_SCOPE_LOCAL ? svc->local_count : svc->count;
	struct lb4_slot_key skey = { .svc_id = svc->id, .scope = scope, .bank = !!(svc->flags & LB4_F_SLOT_BANK) };
	struct lb4_backend *found = NULL;
	__u32 *id;

	if (!count)
		return EPX_DROP_NO_BACKEND;
	if (svc->affinity_timeout) {
		struct lb4_affinity *aff = epx_lookup(epx_affinity, &akey);

		/* kube-proxy's `recent --rcheck --seconds`: still ours if used within the timeout and
		 * still in the endpoint set this traffic may use */
		if (aff && now - aff->last_used <= (__u64)svc->affinity_timeout * EPX_NSEC_PER_SEC) {
			found = epx_lookup(epx_backend, &aff->backend_id);
			if (found && (found->flags & member)) {
				*backend_id = aff->backend_id;
				if (tr)
					tr->flags |= EPX_TRACE_F_AFFINITY;
			} else
				found = NULL;
		}
	}
	if (!found) {
		skey.slot = bpf_get_prandom_u32() % count;
		id = epx_lookup(epx_slot, &skey);
		if (!id)
			return EPX_DROP_NO_BACKEND;
		*backend_id = *id;
		found = epx_lookup(epx_backend, id);
		if (!found)
			return EPX_DROP_NO_BACKEND;
	}
	*be = *found;
	trace_backend(tr, *backend_id, be->addr, be->port);
	if (svc->affinity_timeout && !tr) {
		struct lb4_affinity aff = { .last_used = now, .backend_id = *backend_id };

		epx_update(epx_affinity, &akey, &aff);
	}
	return 0;
}

/* Ingress: DNAT a packet of an established connection, or decide and record a new one.
 * Returns EPX_FWD_ESTABLISHED / EPX_FWD_NEW, EPX_PASS_NO_SERVICE, EPX_REJECT or a drop. */
/* Trace mode: what an established connection's entry says (its backend, its masquerade). */
static __always_inline void lb4_trace_established(struct epx_trace_rec *tr, const struct ct4_entry *e)
{
	if (!tr)
		return;
	tr->flags |= EPX_TRACE_F_ESTABLISHED;
	trace_backend(tr, e->backend_id, e->nat_addr, e->nat_port);
	if (e->flags & CT4_F_MASQ) {
		tr->masq = EPX_TRACE_MASQ_POLICY;
		tr->snat_addr = e->snat_addr;
		tr->snat_port = e->snat_port;
	}
}

/* A mode switch in progress (CFG_F_NETFILTER_*): is a packet without a connection entry the
 * kernel conntrack's, the other mode's, to translate? */
static __always_inline int lb4_left_to_netfilter(const struct pkt4 *p, __u32 cfg_flags)
{
	if (cfg_flags & CFG_F_NETFILTER_FIRST)
		return 1;
	if (cfg_flags & CFG_F_NETFILTER_MIDSTREAM)
		return !(p->proto == IPPROTO_TCP && (p->tcp_flags & (EPX_TCP_SYN | EPX_TCP_ACK)) == EPX_TCP_SYN);
	return 0;
}

/* A connection's packet toward its backend: DNAT, and a remapped connection's (CT4_S_REMAP)
 * source port. Returns `verdict` or a drop reason. */
static __always_inline __u32 lb4_translate(struct __sk_buff *skb, struct pkt4 *p, const struct ct4_entry *e,
					   __u32 verdict)
{
	__be32 be_addr = e->nat_addr;
	__be16 be_port = e->nat_port, wire_port = ct4_wire_port(e, p->sport);
	__u32 reason = nat4_rewrite(skb, p, NAT4_SRC, p->saddr, wire_port);

	if (!reason)
		reason = nat4_rewrite(skb, p, NAT4_DST, be_addr, be_port);
	return reason ? reason : verdict;
}

static __always_inline __u32 lb4_forward(struct __sk_buff *skb, struct pkt4 *p, const struct lb4_config *cfg, __u64 now,
					 struct epx_trace_rec *tr)
{
	struct ct4_key key = ct4_key_make(p->saddr, p->daddr, p->sport, p->dport, p->proto, CT4_SVC);
	struct ct4_entry *e = tr ? ct4_find_svc(&key, now) : ct4_lookup_svc(&key, now);
	struct lb4_service *svc;
	struct lb4_choice c = {};
	struct lb4_backend be;
	__u32 backend_id, reason;
	__u8 origin;
	int hairpin;

	/* a new SYN (SCTP: INIT) on a closing connection's tuple is a new connection (port reuse) */
	if (e && (p->proto == IPPROTO_TCP || p->proto == IPPROTO_SCTP) && (e->flags & CT4_F_CLOSING) &&
	    (p->tcp_flags & (EPX_TCP_SYN | EPX_TCP_ACK)) == EPX_TCP_SYN) {
		if (!tr)
			ct4_forget_closed(&key, e);
		e = NULL;
	}
	if (e) {
		if (e->state & CT4_S_HELD)
			return EPX_DROP_HANDOVER_HELD;
		if (tr)
			lb4_trace_established(tr, e);
		else
			ct4_touch(e, cfg, p, 0, now);
		return lb4_translate(skb, p, e, EPX_FWD_ESTABLISHED);
	}

	svc = lb4_lookup_packet_service(p->daddr, p->dport, p->proto);
	if (!svc)
		return EPX_PASS_NO_SERVICE;
	trace_service(tr, svc);
	if (p->frag == EPX_FRAG_LATER)
		return EPX_PASS_FRAG_UNKNOWN; /* its first fragment made no connection */
	if (lb4_left_to_netfilter(p, cfg->flags))
		return EPX_PASS_HANDOVER;
	origin = lb4_origin(p->saddr, skb->ifindex, cfg->flags);
	reason = lb4_policy(svc, p->saddr, origin, cfg->flags, &c);
	trace_policy(tr, origin, c.scope, c.masq);
	if (reason)
		return reason;
	reason = lb4_select_backend(svc, c.scope, p->saddr, now, &backend_id, &be, tr);
	if (reason)
		return reason;
	/* rule 3, hairpin: a pod that lands on itself is masqueraded */
	hairpin = be.addr == p->saddr;
	if (tr) {
		if (hairpin)
			tr->masq |= EPX_TRACE_MASQ_HAIRPIN;
		/* the dry run allocates no port: only the static masquerade failures show */
		reason = (c.masq || hairpin) ? ct4_snat_check(cfg) : 0;
	} else
		reason = ct4_create(p, cfg, now, backend_id, be.addr, be.port, (c.masq || hairpin) ? CT4_F_MASQ : 0);
	if (reason)
		return reason;
	/* the connection as created: its port may have been remapped (ct4.h, CT4_S_REMAP) */
	e = tr ? NULL : epx_lookup(epx_ct4, &key);
	if (e)
		return lb4_translate(skb, p, e, EPX_FWD_NEW);
	reason = nat4_rewrite(skb, p, NAT4_DST, be.addr, be.port);
	return reason ? reason : EPX_FWD_NEW;
}

#endif /* EPX_LB4_H */
