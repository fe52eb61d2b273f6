/* Service load balancing for IPv6: lb4.h's decisions (shared SEMANTICS.md) over the IPv6 maps.
 *
 * lb6_lookup_service         frontend -> service (exact frontend, else NodePort on a node address)
 * lb6_lookup_packet_service  the same for a packet's destination (never ::)
 * lb6_local_pod              the local-traffic detector (IPv6 pod CIDRs, or the shared epx_iface)
 * lb6_origin                 pod / node / external
 * lb6_policy                 source ranges and REJECT here, the rest is lb4.h's family-free
 *                            lb_policy_scope: one policy for both families
 * lb6_select_backend         session affinity, else a uniformly random slot
 * lb6_forward                the ingress path: established connection, or a new one
 *
 * lb6_select_backend and lb6_forward take a trace record as lb4.h's do: NULL for live packets;
 * with one they decide alike, record the decision, and write nothing (no affinity, no connection).
 */
#ifndef EPX_LB6_H
#define EPX_LB6_H

#include "lib/lb4.h"
#include "lib/nat6.h"

static __always_inline struct lb4_service *lb6_lookup_service(const struct epx_in6 *daddr, __be16 dport, __u8 proto)
{
	struct lb6_key key = { .addr = *daddr, .port = dport, .proto = proto };
	struct lb4_service *svc = epx_lookup(epx_svc6, &key);

	if (svc || !epx_lookup(epx_node_addr6, daddr))
		return svc;
	__builtin_memset(&key.addr, 0, sizeof(key.addr)); /* NodePort: any of this node's addresses */
	return epx_lookup(epx_svc6, &key);
}

/* :: is the key NodePorts are stored under, never a destination on the wire (as 0.0.0.0 in
 * lb4_lookup_packet_service: the kernel does not deliver it). */
static __always_inline struct lb4_service *lb6_lookup_packet_service(const struct epx_in6 *daddr, __be16 dport,
								     __u8 proto)
{
	return in6_is_zero(daddr) ? NULL : lb6_lookup_service(daddr, dport, proto);
}

static __always_inline int lb6_in_pod_cidr(const struct epx_in6 *saddr)
{
	struct lpm6_key key = { .prefixlen = 128, .addr = *saddr };

	return epx_lookup(epx_pod_cidr6, &key) != NULL;
}

/* epx_config's flags as IPv6 sees them: the detector kinds are shared (an interface detector
 * serves both families), but whether the CIDR detector is kube-proxy's no-op one is per family
 * (a dual-stack node's --cluster-cidr may name one family only): CFG_F_DETECT_NONE is IPv4's,
 * CFG6_F_DETECT_NONE IPv6's. `cfg6` is the caller's epx_config6 (pkt6_config: one lookup a packet). */
static __always_inline __u32 lb6_flags(const struct lb4_config *cfg, const struct lb6_config *cfg6)
{
	__u32 flags = cfg->flags & ~CFG_F_DETECT_NONE;

	return cfg6 && (cfg6->flags & CFG6_F_DETECT_NONE) ? flags | CFG_F_DETECT_NONE : flags;
}

/* lb4_local_pod for IPv6: the CIDR detectors read epx_pod_cidr6; the interface detectors read the
 * same epx_iface as IPv4 (a device is local for both families). */
static __always_inline int lb6_local_pod(const struct epx_in6 *saddr, __u32 ifindex, __u32 cfg_flags)
{
	if (cfg_flags & CFG_F_DETECT_NONE)
		return 0;
	if (cfg_flags & CFG_F_DETECT_IFACE)
		return !!(lb4_iface_flags(ifindex) & EPX_IF_LOCAL);
	return lb6_in_pod_cidr(saddr);
}

static __always_inline __u8 lb6_origin(const struct epx_in6 *saddr, __u32 ifindex, __u32 cfg_flags)
{
	if (lb6_local_pod(saddr, ifindex, cfg_flags))
		return EPX_ORIGIN_POD;
	if (epx_lookup(epx_node_addr6, saddr))
		return EPX_ORIGIN_NODE;
	return EPX_ORIGIN_EXTERNAL;
}

static __always_inline int lb6_source_admitted(const struct lb4_service *svc, const struct epx_in6 *saddr)
{
	struct lb6_range_key key = { .prefixlen = 32 + 128, .svc_id = svc->id, .addr = *saddr };

	return epx_lookup(epx_src_range6, &key) != NULL;
}

/* lb4_policy for an IPv6 client. */
static __always_inline __u32 lb6_policy(const struct lb4_service *svc, const struct epx_in6 *saddr, __u8 origin,
					__u32 cfg_flags, struct lb4_choice *c)
{
	if (!(svc->flags & LB4_F_HAS_ENDPOINTS))
		return EPX_REJECT; /* rule 9 */
	if ((svc->flags & LB4_F_SOURCE_RANGES) && !lb6_source_admitted(svc, saddr))
		return EPX_DROP_SOURCE_RANGE; /* rule 11 */
	return lb_policy_scope(svc, origin, cfg_flags, c);
}

/* lb4_select_backend over epx_affinity6 / epx_slot6 / epx_backend6. Returns 0 with *backend_id and
 * *be filled, or EPX_DROP_NO_BACKEND. With a trace record: the same choice, recorded, and no
 * affinity written. */
static __always_inline __u32 lb6_select_backend(const struct lb4_service *svc, __u8 scope,
						const struct epx_in6 *client, __u64 now, __u32 *backend_id,
						struct lb6_backend *be, struct epx_trace_rec *tr)
{
	struct lb6_affinity_key akey = { .svc_id = svc->id, .client = *client };
	__u8 member = scope == LB4_SCOPE_LOCAL ? LB4_BE_IN_LOCAL : LB4_BE_IN_CLUSTER;
	__u16 count = scope == LB4_SCOPE_LOCAL ? svc->local_count : svc->count;
	struct lb4_slot_key skey = { .svc_id = svc->id, .scope = scope, .bank = !!(svc->flags & LB4_F_SLOT_BANK) };
	struct lb6_backend *found = NULL;
	__u32 *id;

	if (!count)
		return EPX_DROP_NO_BACKEND;
	if (svc->affinity_timeout) {
		struct lb4_affinity *aff = epx_lookup(epx_affinity6, &akey);

		if (aff && now - aff->last_used <= (__u64)svc->affinity_timeout * EPX_NSEC_PER_SEC) {
			found = epx_lookup(epx_backend6, &aff->backend_id);
			if (found && (found->flags & member)) {
				*backend_id = aff->backend_id;
				if (tr)
					tr->flags |= EPX_TRACE_F_AFFINITY;
			} else {
				found = NULL;
			}
		}
	}
	if (!found) {
		skey.slot = bpf_get_prandom_u32() % count;
		id = epx_lookup(epx_slot6, &skey);
		if (!id)
			return EPX_DROP_NO_BACKEND;
		*backend_id = *id;
		found = epx_lookup(epx_backend6, id);
		if (!found)
			return EPX_DROP_NO_BACKEND;
	}
	*be = *found;
	trace_backend6(tr, *backend_id, &be->addr, be->port);
	if (svc->affinity_timeout && !tr) {
		struct lb4_affinity aff = { .last_used = now, .backend_id = *backend_id };

		epx_update(epx_affinity6, &akey, &aff);
	}
	return 0;
}

/* Trace mode: what an established connection's entry says (lb4_trace_established). */
static __always_inline void lb6_trace_established(struct epx_trace_rec *tr, const struct ct6_entry *e)
{
	if (!tr)
		return;
	tr->flags |= EPX_TRACE_F_ESTABLISHED;
	trace_backend6(tr, e->backend_id, &e->nat_addr, e->nat_port);
	if (e->flags & CT4_F_MASQ) {
		tr->masq = EPX_TRACE_MASQ_POLICY;
		__builtin_memcpy(tr->snat_addr6, e->snat_addr.w, sizeof(tr->snat_addr6));
		tr->snat_port = e->snat_port;
	}
}

/* A connection's packet toward its backend: DNAT, and a remapped connection's (CT4_S_REMAP)
 * source port (lb4_translate). Returns `verdict` or a drop reason. */
static __always_inline __u32 lb6_translate(struct __sk_buff *skb, struct pkt6 *p, const struct ct6_entry *e,
					   __u32 verdict)
{
	struct epx_in6 addr = e->nat_addr;
	__be16 port = e->nat_port, wire_port = ct6_wire_port(e, p->sport);
	__u32 reason = 0;

	if (wire_port != p->sport) {
		struct epx_in6 client = p->saddr;

		reason = nat6_rewrite(skb, p, NAT4_SRC, &client, wire_port);
	}
	if (!reason)
		reason = nat6_rewrite(skb, p, NAT4_DST, &addr, port);
	return reason ? reason : verdict;
}

/* Ingress: DNAT a packet of an established connection, or decide and record a new one (lb4_forward).
 * Returns EPX_FWD_ESTABLISHED / EPX_FWD_NEW, EPX_PASS_NO_SERVICE, EPX_REJECT or a drop. The
 * mode-switch handover (CFG_F_NETFILTER_*) is IPv4's: IPv6 connections are not moved. */
static __always_inline __u32 lb6_forward(struct __sk_buff *skb, struct scratch6 *s, struct pkt6 *p,
					 const struct lb4_config *cfg, __u64 now, struct epx_trace_rec *tr)
{
	struct ct6_entry *e;
	struct lb4_service *svc;
	struct lb4_choice c = {};
	struct lb6_backend be;
	__u32 backend_id, reason, flags;
	__u8 origin;
	int hairpin;

	s->key = ct6_key_make(&p->saddr, &p->daddr, p->sport, p->dport, p->proto, CT4_SVC);
	e = tr ? ct6_find_svc(&s->key, now) : ct6_lookup_svc(s, &s->key, now);
	/* a new SYN (SCTP: INIT) on a closing connection's tuple is a new connection (port reuse) */
	if (e && (p->proto == IPPROTO_TCP || p->proto == IPPROTO_SCTP) && (e->flags & CT4_F_CLOSING) &&
	    (p->tcp_flags & (EPX_TCP_SYN | EPX_TCP_ACK)) == EPX_TCP_SYN) {
		if (!tr)
			ct6_forget_closed(s, &s->key, e);
		e = NULL;
	}
	if (e) {
		if (tr)
			lb6_trace_established(tr, e);
		else
			ct6_touch(e, cfg, p, 0, now);
		return lb6_translate(skb, p, e, EPX_FWD_ESTABLISHED);
	}

	svc = lb6_lookup_packet_service(&p->daddr, p->dport, p->proto);
	if (!svc)
		return EPX_PASS_NO_SERVICE;
	trace_service(tr, svc);
	flags = lb6_flags(cfg, p->cfg6);
	origin = lb6_origin(&p->saddr, skb->ifindex, flags);
	reason = lb6_policy(svc, &p->saddr, origin, flags, &c);
	trace_policy(tr, origin, c.scope, c.masq);
	if (reason)
		return reason;
	reason = lb6_select_backend(svc, c.scope, &p->saddr, now, &backend_id, &be, tr);
	if (reason)
		return reason;
	/* rule 3, hairpin: a pod that lands on itself is masqueraded */
	hairpin = in6_eq(&be.addr, &p->saddr);
	if (tr) {
		if (hairpin)
			tr->masq |= EPX_TRACE_MASQ_HAIRPIN;
		/* the dry run allocates no port: only the static masquerade failures show */
		reason = (c.masq || hairpin) ? ct6_snat_check(cfg, p->cfg6) : 0;
	} else {
		reason = ct6_create(s, p, cfg, now, backend_id, &be.addr, be.port, c.masq || hairpin);
	}
	if (reason)
		return reason;
	/* the connection as created: its port may have been remapped (ct4.h, CT4_S_REMAP) */
	if (!tr) {
		s->key = ct6_key_make(&p->saddr, &p->daddr, p->sport, p->dport, p->proto, CT4_SVC);
		e = epx_lookup(epx_ct6, &s->key);
		if (e)
			return lb6_translate(skb, p, e, EPX_FWD_NEW);
	}
	reason = nat6_rewrite(skb, p, NAT4_DST, &be.addr, be.port);
	return reason ? reason : EPX_FWD_NEW;
}

#endif /* EPX_LB6_H */
