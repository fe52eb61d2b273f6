/* XDP program: drop early, before an skb exists, what the TC program would only drop later.
 *
 * Attached on the devices facing outside, it drops malformed IPv4 and IPv6 packets and the first packets
 * of new connections that kube-proxy's rules drop whatever the connection state: clients that
 * loadBalancerSourceRanges does not admit, and traffic from outside to an
 * externalTrafficPolicy=Local service without a local endpoint (and internalTrafficPolicy=Local
 * without one). The decision is the TC program's own (lb4_policy), counted under the same
 * reasons. Everything else passes untouched and uncounted: the TC program counts it.
 *
 * Trace mode (common.h): a struct epx_trace_meta in data_meta; the decision is recorded in
 * epx_trace (reason CONTINUE: passed on to TC), nothing counted, no expired entry removed.
 */
#include "lib/common.h"
#include "lib/maps.h"
#include "lib/stats.h"
#include "lib/lb4.h"
#include "lib/lb6.h"
#include "lib/trace.h"

static __always_inline int xdp_early_drop(__u32 reason)
{
	return reason == EPX_DROP_SOURCE_RANGE || reason == EPX_DROP_NO_LOCAL_EXTERNAL ||
	       reason == EPX_DROP_NO_LOCAL_INTERNAL;
}

/* The verdict for `reason` (a drop, or CONTINUE: TC decides), counted (live) or recorded (trace). */
static __always_inline int xdp_done(__u32 reason, __u32 len, struct epx_trace_rec *tr)
{
	if (tr)
		tr->reason = reason;
	else if (reason)
		stats_count(reason, len);
	return reason ? XDP_DROP : XDP_PASS;
}

/* IPv6: the same early drops, decided by lb6_policy (the TC program's own), and traced alike. */
static __always_inline int xdp6_run(struct xdp_md *ctx, struct epx_trace_rec *tr)
{
	void *data = (void *)(long)ctx->data, *data_end = (void *)(long)ctx->data_end;
	struct pkt6 p = {};
	struct lb4_service *svc;
	struct lb4_choice c = {};
	struct scratch6 *s;
	__u32 zero = 0, reason, flags;
	struct lb4_config *cfg;

	__u64 now;
	__u8 origin;

	reason = pkt6_parse(data, data_end, data_end - data, &p);
	if (reason == EPX_PASS_NOT_IPV4)
		return xdp_done(EPX_CONTINUE, 0, tr); /* not IP at all (ARP, ...): the TC program counts it */
	if (epx_is_drop(reason))
		return xdp_done(reason, data_end - data, tr);
	if (reason)
		return xdp_done(EPX_CONTINUE, 0, tr);
	/* packets of established connections keep flowing, as with kube-proxy (NEW only) */
	s = scratch6_get();
	if (!s)
		return xdp_done(EPX_CONTINUE, 0, tr);
	s->key = ct6_key_make(&p.saddr, &p.daddr, p.sport, p.dport, p.proto, CT4_SVC);
	now = bpf_ktime_get_ns();
	if (tr ? ct6_find_svc(&s->key, now) : ct6_lookup_svc(s, &s->key, now)) {
		if (tr)
			tr->flags |= EPX_TRACE_F_ESTABLISHED;
		return xdp_done(EPX_CONTINUE, 0, tr);
	}
	svc = lb6_lookup_packet_service(&p.daddr, p.dport, p.proto);
	cfg = epx_lookup(epx_config, &zero);
	if (!svc || !cfg)
		return xdp_done(EPX_CONTINUE, 0, tr);
	trace_service(tr, svc);
	flags = lb6_flags(cfg, p.cfg6);
	origin = lb6_origin(&p.saddr, ctx->ingress_ifindex, flags);
	reason = lb6_policy(svc, &p.saddr, origin, flags, &c);
	trace_policy(tr, origin, c.scope, c.masq);
	return xdp_done(xdp_early_drop(reason) ? reason : EPX_CONTINUE, data_end - data, tr);
}

static __always_inline int xdp_lb_run(struct xdp_md *ctx, struct epx_trace_rec *tr)
{
	void *data = (void *)(long)ctx->data, *data_end = (void *)(long)ctx->data_end;
	struct pkt4 p = {};
	struct lb4_service *svc;
	struct lb4_choice c = {};
	struct ct4_key key;
	__u32 zero = 0, reason;
	struct lb4_config *cfg;
	__u64 now;
	__u8 origin;

	reason = pkt4_parse(data, data_end, data_end - data, &p);
	if (reason == EPX_PASS_NOT_IPV4)
		return xdp6_run(ctx, tr); /* IPv6, or not IP: passed on */
	if (epx_is_drop(reason))
		return xdp_done(reason, data_end - data, tr);
	if (reason || p.frag == EPX_FRAG_LATER)
		return xdp_done(EPX_CONTINUE, 0, tr);
	/* packets of established connections keep flowing, as with kube-proxy (NEW only) */
	key = ct4_key_make(p.saddr, p.daddr, p.sport, p.dport, p.proto, CT4_SVC);
	now = bpf_ktime_get_ns();
	if (tr ? ct4_find_svc(&key, now) : ct4_lookup_svc(&key, now)) {
		if (tr)
			tr->flags |= EPX_TRACE_F_ESTABLISHED;
		return xdp_done(EPX_CONTINUE, 0, tr);
	}
	svc = lb4_lookup_packet_service(p.daddr, p.dport, p.proto);
	cfg = epx_lookup(epx_config, &zero);
	if (!svc || !cfg || (cfg->flags & (CFG_F_NETFILTER_MIDSTREAM | CFG_F_NETFILTER_FIRST)))
		return xdp_done(EPX_CONTINUE, 0, tr); /* a mode switch: the TC program decides (lb4_left_to_netfilter) */
	trace_service(tr, svc);
	origin = lb4_origin(p.saddr, ctx->ingress_ifindex, cfg->flags);
	reason = lb4_policy(svc, p.saddr, origin, cfg->flags, &c);
	trace_policy(tr, origin, c.scope, c.masq);
	return xdp_done(xdp_early_drop(reason) ? reason : EPX_CONTINUE, data_end - data, tr);
}

int xdp_lb(struct xdp_md *ctx)
{
	struct epx_trace_meta *meta = trace_xdp_meta(ctx); /* the one test live packets pay */

	if (meta) {
		struct epx_trace_rec *tr = trace_begin(meta->nonce, EPX_HOOK_XDP);

		if (tr)
			tr->ifindex = ctx->ingress_ifindex;
		return tr ? xdp_lb_run(ctx, tr) : XDP_PASS;
	}
	return xdp_lb_run(ctx, NULL);
}
