/* The IPv6 half of the TC programs (tc_lb.c): the same steps as IPv4, over the IPv6 maps.
 *
 * tc6_ingress: a reply to a masqueraded connection gets its real client back as destination;
 *   a packet of a known connection is DNATed to its backend; a packet to a service frontend
 *   starts a connection, or is rejected with ICMPv6 port unreachable (built here, redirected by
 *   the caller), or dropped with its reason.
 * tc6_egress: forward packets of masqueraded connections get the masquerade source; replies get
 *   the frontend back as source (on egress toward the client, as IPv4: PLATFORM.md pitfall 2).
 * In both, an ICMPv6 error about a connection's packet gets that connection's translation
 *   (icmp6_err.h), as tc_lb.c gives IPv4's (icmp4_err.h).
 * TCP, UDP and SCTP alike; an SCTP packet's CRC32c is updated once per run by tc_lb.c's
 * tc_sctp_done, as IPv4's (nat6_sctp_begin tells it where the header is).
 * Both return the reason to count; a frame that is not IPv6 gets EPX_PASS_NOT_IPV4 back, for the
 * caller's own handling of non-IP frames (ARP).
 *
 * Trace mode (trace.h): a trace run takes the same steps with its record, as a dry run that
 * writes no entry and counts nothing; a REJECT is recorded, its ICMPv6 error not built.
 * Not for IPv6 yet: fragments, the mode-switch handover.
 */
#ifndef EPX_TC6_H
#define EPX_TC6_H

#include "lib/lb6.h"
#include "lib/icmp6.h"
#include "lib/icmp6_err.h"
#include "lib/stats.h"

/* Whether pkt6_parse's verdict `reason` leaves an ICMPv6 message to look into (icmp6_err.h). */
static __always_inline int tc6_icmp6(__u32 reason, const struct pkt6 *p)
{
	return reason == EPX_PASS_IPV6_NOT_L4 && p->proto == EPX_NEXTHDR_ICMP;
}

static __always_inline __u32 tc6_ingress(struct __sk_buff *skb, struct epx_trace_rec *tr)
{
	struct pkt6 p = {};
	struct scratch6 *s;
	struct lb4_config *cfg;
	__u32 zero = 0, reason;
	__u64 now;

	reason = pkt6_parse_skb(skb, &p);
	nat6_sctp_begin(skb, &p);
	if (reason && !tc6_icmp6(reason, &p))
		return reason;
	cfg = epx_lookup(epx_config, &zero);
	s = scratch6_get();
	if (!cfg || !s)
		return reason ?: EPX_PASS_NO_SERVICE;
	now = bpf_ktime_get_ns();
	if (reason)
		return icmp6_err_ingress(skb, s, &p, cfg, now);

	reason = nat6_rev_snat(skb, s, &p, cfg, now, tr);
	if (!reason)
		reason = lb6_forward(skb, s, &p, cfg, now, tr);
	if (reason == EPX_REJECT)
		skb->cb[NAT6_SCTP_OFF_CB] = 0; /* an ICMPv6 error now (or dropped): no CRC to update */
	/* a local pod's packet may be CHECKSUM_PARTIAL (see icmp6.h): it came in on a pod device, or
	 * its source is in the detector's pod CIDR */
	if (reason == EPX_REJECT && !tr &&
	    icmp6_reject(skb, &p, s, (lb4_iface_flags(skb->ifindex) & EPX_IF_POD) || lb6_in_pod_cidr(&p.saddr)))
		return EPX_DROP_REJECT_FAILED;
	return reason;
}

static __always_inline __u32 tc6_egress(struct __sk_buff *skb, struct epx_trace_rec *tr)
{
	struct pkt6 p = {};
	struct scratch6 *s;
	struct lb4_config *cfg;
	__u32 zero = 0, reason;
	__u64 now;

	reason = pkt6_parse_skb(skb, &p);
	nat6_sctp_begin(skb, &p);
	if (reason && !tc6_icmp6(reason, &p))
		return reason;
	cfg = epx_lookup(epx_config, &zero);
	s = scratch6_get();
	if (!cfg || !s)
		return reason ?: EPX_PASS_NO_SERVICE;
	now = bpf_ktime_get_ns();
	if (reason)
		return icmp6_err_egress(skb, s, &p, now);

	/* as IPv4: a hairpin tuple that is both forward and reply is taken as forward */
	reason = nat6_snat(skb, s, &p, now, tr);
	if (!reason)
		reason = nat6_rev_dnat(skb, s, &p, cfg, now, tr);
	return reason ? reason : EPX_PASS_NO_SERVICE;
}

#endif /* EPX_TC6_H */
