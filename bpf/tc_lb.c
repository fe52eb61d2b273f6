/* TC programs of the datapath, attached with clsact on every device a service packet crosses.
 *
 * tc_ingress (packets arriving from pods and from outside):
 *   1. a reply to a masqueraded connection gets its real client back as destination;
 *   2. a packet of a known connection is DNATed to that connection's backend;
 *   3. a packet to a service frontend starts a connection (policy, backend, CT entries, DNAT),
 *      or is rejected with ICMP, or dropped with its reason;
 *   an ICMP error about a connection's packet gets that connection's translation (icmp4_err.h);
 *   4. with CFG_F_HOST_ROUTING, a translated packet (or a reply of a tracked connection) is
 *   forwarded here, skipping the host's routing and netfilter stack when the FIB allows (fib4.h).
 * tc_egress (packets leaving toward pods and outside):
 *   1. forward packets of masqueraded connections get the masquerade source;
 *   2. replies get the frontend back as source. This is done on egress toward the client, not
 *      on ingress from the backend, so reverse-path filtering never sees a frontend address
 *      arriving on a backend-facing device (PLATFORM.md pitfall 2);
 *   an ICMP error about a connection's packet gets that connection's translation (icmp4_err.h):
 *   errors about a client's packet (a router's or the backend's, or this node's own forwarding
 *   error, e.g. fragmentation needed, whose quote tc_ingress already DNATed) leave here;
 *   3. a node socket bound to 127.0.0.0/8 that the socket LB sent to a backend is masqueraded
 *      (127.0.0.1:<nodePort>, rule 8), as kube-proxy's POSTROUTING MASQUERADE does, and the ARP
 *      request its first packet may cause announces the masquerade address, not 127.0.0.1.
 * TCP, UDP and SCTP alike (their ports sit at the same offsets). An SCTP packet whose ports a run
 * changed gets its CRC32c updated once, when the run is done (tc_sctp_done; the math in sctp.h).
 * Masquerade is split the same way kube-proxy splits it (mark in PREROUTING, MASQUERADE in
 * POSTROUTING): decided at ingress, applied at egress, after the kernel routed the DNATed packet;
 * rewriting the source to a node address at ingress would make the kernel drop it as martian.
 *
 * IPv6 takes the same steps in lib/tc6.h (entered when the IPv4 parser finds no IPv4 header).
 *
 * tc_lo (ingress of the node's loopback device only, devices.py): drops [::1]:<nodePort> of an
 * eTP=Local NodePort without a local endpoint, as kube-proxy's INPUT rule does (lib/lo6.h: why
 * there, and what it costs every loopback packet).
 *
 * Trace mode (common.h, trace.h): each entry tests the signal once; a trace run takes the same
 * logic, inlined a second time with its record, as a dry run that counts nothing.
 */
#include "lib/common.h"
#include "lib/maps.h"
#include "lib/stats.h"
#include "lib/lb4.h"
#include "lib/icmp4.h"
#include "lib/icmp4_err.h"
#include "lib/fib4.h"
#include "lib/arp4.h"
#include "lib/trace.h"
#include "lib/tc6.h"
#include "lib/lo6.h"

/* The verdict for `reason`, counted (live) or recorded (trace). */
static __always_inline int tc_done(struct __sk_buff *skb, __u32 reason, struct epx_trace_rec *tr)
{
	if (tr)
		tr->reason = reason;
	else
		stats_count(reason, skb->len);
	return epx_is_drop(reason) ? TC_ACT_SHOT : TC_ACT_OK;
}

/* The end of a run: an SCTP packet let through gets its CRC32c for the ports its translations
 * changed (nat4.h: nat4_sctp_finish), out here where nothing of the run is left on the stack.
 * "Let through" includes a redirect: the host-routing fast path (fib4.h) hands the packet on only
 * once the program returns, so its DNAT, and the masquerade fib4_egress_work does for a pod's
 * veth, are covered here too. (A REJECT's redirect is ICMP by now: nothing to do.)
 * The header was read before, so this cannot fail short of a bug; if it does, the packet (already
 * counted under its verdict) is dropped and counted under EPX_DROP_NAT_FAILED too. */
static __always_inline int tc_sctp_done(struct __sk_buff *skb, int verdict, struct epx_trace_rec *tr)
{
	if (verdict == TC_ACT_SHOT || !nat4_sctp_finish(skb))
		return verdict;
	return tc_done(skb, EPX_DROP_NAT_FAILED, tr);
}

static __always_inline struct lb4_config *tc_config(void)
{
	__u32 zero = 0;

	return epx_lookup(epx_config, &zero);
}

static __always_inline int tc_ingress_run(struct __sk_buff *skb, struct epx_trace_rec *tr)
{
	struct pkt4 p = {};
	struct lb4_config *cfg;
	__u64 now;
	__u32 reason;

	reason = pkt4_parse_skb(skb, &p);
	if (reason == EPX_PASS_NOT_IPV4) { /* IPv6 (lib/tc6.h), or not IP at all */
		__u32 len = skb->len;

		reason = tc6_ingress(skb, tr);
		if (reason != EPX_REJECT || tr) /* a trace run's REJECT is recorded, not built (tc6.h) */
			return tc_done(skb, reason, tr);
		stats_count(EPX_REJECT, len);
		return bpf_redirect(skb->ifindex, 0);
	}
	if (reason == EPX_PASS_NOT_L4 && p.proto == IPPROTO_ICMP && (cfg = tc_config()))
		return tc_done(skb, icmp4_err_ingress(skb, &p, cfg, bpf_ktime_get_ns()), tr);
	if (reason)
		return tc_done(skb, reason, tr);
	nat4_sctp_begin(skb, &p);
	cfg = tc_config();
	if (!cfg)
		return tc_done(skb, EPX_PASS_NO_SERVICE, tr);
	now = bpf_ktime_get_ns();

	reason = nat4_rev_snat(skb, &p, cfg, now, tr);
	if (!reason)
		reason = lb4_forward(skb, &p, cfg, now, tr);
	if (reason == EPX_REJECT) {
		__u32 len = skb->len;

		/* a local pod's packet may be CHECKSUM_PARTIAL (see icmp4.h): it came in on a pod
		 * device, or its source is in the detector's pod CIDR */
		int partial_safe = (lb4_iface_flags(skb->ifindex) & EPX_IF_POD) || lb4_in_pod_cidr(p.saddr);

		if (icmp4_reject(skb, &p, partial_safe))
			return tc_done(skb, EPX_DROP_REJECT_FAILED, tr);
		if (tr)
			tr->reason = EPX_REJECT;
		else
			stats_count(EPX_REJECT, len);
		return bpf_redirect(skb->ifindex, 0);
	}
	/* host routing (fib4.h): live packets only, a trace run explains the translation alone */
	if (!tr && (cfg->flags & CFG_F_HOST_ROUTING) && fib4_candidate(&p, reason)) {
		stats_count(reason, skb->len);
		return fib4_route(skb, &p, cfg, now);
	}
	return tc_done(skb, reason, tr);
}

int tc_ingress(struct __sk_buff *skb)
{
	if (trace_skb_requested(skb)) { /* the one test live packets pay */
		struct epx_trace_rec *tr = trace_skb_begin(skb, EPX_HOOK_TC_INGRESS);

		return tr ? tc_sctp_done(skb, tc_ingress_run(skb, tr), tr) : TC_ACT_OK;
	}
	return tc_sctp_done(skb, tc_ingress_run(skb, NULL), NULL);
}

static __always_inline int tc_egress_run(struct __sk_buff *skb, struct epx_trace_rec *tr)
{
	struct pkt4 p = {};
	struct lb4_config *cfg;
	__u64 now;
	__u32 reason;

	reason = pkt4_parse_skb(skb, &p);
	if (reason == EPX_PASS_NOT_IPV4)
		reason = tc6_egress(skb, tr); /* IPv6 (lib/tc6.h); anything else stays PASS_NOT_IPV4 */
	if (reason == EPX_PASS_NOT_IPV4 && (cfg = tc_config()))
		reason = arp4_masq_loopback_sender(skb, cfg) ?: reason;
	if (reason == EPX_PASS_NOT_L4 && p.proto == IPPROTO_ICMP)
		reason = icmp4_err_egress(skb, &p, bpf_ktime_get_ns());
	if (reason)
		return tc_done(skb, reason, tr);
	nat4_sctp_begin(skb, &p);
	cfg = tc_config();
	if (!cfg)
		return tc_done(skb, EPX_PASS_NO_SERVICE, tr);
	now = bpf_ktime_get_ns();

	/* A hairpin connection whose client and backend ports are equal has identical forward and
	 * reply tuples here; forward (SNAT) wins. Such a flow is not distinguishable by tuple. */
	reason = nat4_snat(skb, &p, cfg, now, tr);
	if (!reason)
		reason = nat4_rev_dnat(skb, &p, cfg, now, tr);
	if (!reason)
		reason = nat4_masq_local(skb, &p, cfg, now, tr);
	return tc_done(skb, reason ? reason : EPX_PASS_NO_SERVICE, tr);
}

int tc_egress(struct __sk_buff *skb)
{
	if (trace_skb_requested(skb)) { /* the one test live packets pay */
		struct epx_trace_rec *tr = trace_skb_begin(skb, EPX_HOOK_TC_EGRESS);

		return tr ? tc_sctp_done(skb, tc_egress_run(skb, tr), tr) : TC_ACT_OK;
	}
	return tc_sctp_done(skb, tc_egress_run(skb, NULL), NULL);
}

/* The node's lo (lib/lo6.h): kube-proxy's INPUT DROP of [::1]:<nodePort>, nothing else. */
int tc_lo(struct __sk_buff *skb)
{
	__u32 reason = lo6_decide(skb);

	if (!reason)
		return TC_ACT_OK;
	stats_count(reason, skb->len);
	return TC_ACT_SHOT;
}
