/* XDP program: drop early, before an skb exists, what the TC program would only drop later.
 *
 * Attached on the devices facing outside, it drops malformed IPv4 packets and the first packets
 * of new connections that kube-proxy's rules drop whatever the connection state: clients that
 * loadBalancerSourceRanges does not admit, and traffic from outside to an
 * externalTrafficPolicy=Local service without a local endpoint (and internalTrafficPolicy=Local
 * without one). The decision is the TC program's own (lb4_policy), counted under the same
 * reasons. Everything else passes untouched and uncounted: the TC program counts it.
 */
#include "lib/common.h"
#include "lib/maps.h"
#include "lib/stats.h"
#include "lib/lb4.h"

static __always_inline int xdp_early_drop(__u32 reason)
{
	return reason == EPX_DROP_SOURCE_RANGE || reason == EPX_DROP_NO_LOCAL_EXTERNAL ||
	       reason == EPX_DROP_NO_LOCAL_INTERNAL;
}

int xdp_lb(struct xdp_md *ctx)
{
	void *data = (void *)(long)ctx->data, *data_end = (void *)(long)ctx->data_end;
	struct pkt4 p = {};
	struct lb4_service *svc;
	struct lb4_choice c = {};
	struct ct4_key key;
	__u32 zero = 0, reason;
	struct lb4_config *cfg;

	reason = pkt4_parse(data, data_end, data_end - data, &p);
	if (epx_is_drop(reason)) {
		stats_count(reason, data_end - data);
		return XDP_DROP;
	}
	if (reason || p.frag == EPX_FRAG_LATER)
		return XDP_PASS;
	/* packets of established connections keep flowing, as with kube-proxy (NEW only) */
	key = ct4_key_make(p.saddr, p.daddr, p.sport, p.dport, p.proto, CT4_SVC);
	if (ct4_lookup_svc(&key, bpf_ktime_get_ns()))
		return XDP_PASS;
	svc = lb4_lookup_service(p.daddr, p.dport, p.proto);
	cfg = epx_lookup(epx_config, &zero);
	if (!svc || !cfg)
		return XDP_PASS;
	reason = lb4_policy(svc, p.saddr, lb4_origin(p.saddr, ctx->ingress_ifindex, cfg->flags), cfg->flags, &c);
	if (!xdp_early_drop(reason))
		return XDP_PASS;
	stats_count(reason, data_end - data);
	return XDP_DROP;
}
