/* Host routing: a packet tc_ingress translated skips the node's routing, neighbour and netfilter
 * stack (issue 12; the shape of Cilium's BPF host routing).
 *
 * Candidates (fib4_candidate): packets tc_ingress DNATed (FWD_NEW, FWD_ESTABLISHED) or gave their
 * client back (REV_SNAT), and replies of tracked connections (a CT4_REV_DNAT half for the packet:
 * the backend answering a client whose connection this node translated), so both directions of a
 * connection skip the stack. With CFG_F_HOST_ROUTING set, such a packet gets a bpf_fib_lookup (the
 * kernel's own FIB: routes, rules, neighbours) for what it is after translation, and then:
 *   - out to the host side of a local pod's veth (EPX_IF_PEER): what that device's egress hook
 *     would have done (tc_egress: masquerade, reverse DNAT) is done here, because
 *     bpf_redirect_peer hands the packet to the pod's end of the veth at once, and the host side's
 *     egress hook never runs; then bpf_redirect_peer;
 *   - out of any other device: bpf_redirect_neigh to the route's next hop. The packet is queued on
 *     that device (dev_queue_xmit), so its egress hook, our tc_egress, still runs and does the
 *     egress work there, as on the slow path.
 * Either way the packet is forwarded as ip_forward would: TTL decremented (TTL <= 1: the slow path,
 * where the kernel answers time exceeded) and skb->priority from the TOS (rt_tos2priority).
 *
 * Everything else stays on the slow path (TC_ACT_OK), counted under an EV_HOST_STACK_* reason, so
 * the kernel decides as it did before:
 *   FIB   the lookup did not give a forwarding decision to act on: no neighbour entry yet (the
 *         kernel resolves it; later packets go fast), a local destination, blackhole, unreachable,
 *         prohibit, forwarding off, an encapsulating route; or the reverse-path check below
 *         failed; or the route leads back out of the device the packet came in on while that
 *         device may send ICMP redirects (ip_forward would send one);
 *   MTU   the packet (a GSO packet: each of its segments) is larger than the route's MTU: the
 *         kernel fragments it or, with DF, answers fragmentation needed (path-MTU discovery).
 *         The lookup enforces the device's MTU, a locked route MTU and a learnt path MTU; an
 *         unlocked route MTU, which forwarding honours too, only through what the agent wrote
 *         into epx_iface (EPX_IF_MTU_SHIFT: the smallest of the device's routes, conservative);
 *   SKIP  not a packet to route here: fragments, IP options (ip_forward processes them), TTL <= 1,
 *         a packet not addressed to this host's MAC, an skb mark (fwmark routing rules), a
 *         multicast source, a mode switch in progress (CFG_F_NETFILTER_*: netfilter's conntrack
 *         must see the other mode's packets).
 * ICMP errors, REJECT, drops and trace runs never get here.
 *
 * Reverse-path filtering: the kernel validates a forwarded packet's source (rp_filter) against
 * the FIB. The fast path takes only packets the strict check passes (the route back to the source
 * leaves through the device the packet came in on), which the loose check and no check pass too;
 * any other goes to the slow path, where the real setting decides. Martian sources (a local,
 * broadcast or unroutable address) fail the same lookup.
 *
 * Not skipped by the fast path, by design: tc_egress on a device the packet leaves through (only
 * the peer case does its work here). Skipped, as with Cilium's host routing: netfilter's FORWARD
 * and POSTROUTING chains and conntrack for these packets (a node whose other components filter
 * pod traffic there must run with --bpf-host-routing=off), and xfrm policies.
 */
#ifndef EPX_FIB4_H
#define EPX_FIB4_H

#include "lib/nat4.h"

#define FIB4_AF_INET 2
#define FIB4_PACKET_HOST 0
/* bpf_redirect_neigh as the kernel defines it (5.11+: ifindex, params, plen, flags); bcc 0.26's
 * helpers.h still declares the 5.10 form without plen, which would pass the flags as plen. */
static long (*fib4_redirect_neigh)(__u32 ifindex, struct bpf_redir_neigh *params, int plen,
				   __u64 flags) = (void *)BPF_FUNC_redirect_neigh;

/* Is the verdict tc_ingress reached for `p` one the fast path may take over? */
static __always_inline int fib4_candidate(const struct pkt4 *p, __u32 reason)
{
	__u32 zero = 0;
	struct ct4_ring *ring;

	if (reason == EPX_FWD_NEW || reason == EPX_FWD_ESTABLISHED || reason == EPX_REV_SNAT)
		return 1;
	if (reason != EPX_PASS_NO_SERVICE || p->frag == EPX_FRAG_LATER)
		return 0;
	/* a reply of a connection we translate: its source is restored at egress toward the client */
	ring = epx_lookup(epx_ct4_ring, &zero); /* its scratch key: tc_ingress's stack is full */
	if (!ring)
		return 0;
	ring->half = ct4_key_make(p->saddr, p->daddr, p->sport, p->dport, p->proto, CT4_REV_DNAT);
	return epx_lookup(epx_ct4, &ring->half) != NULL;
}

/* The kernel's rt_tos2priority: what ip_forward sets skb->priority to. */
static __always_inline __u32 fib4_tos2priority(__u8 tos)
{
	switch ((tos & 0x1e) >> 3) {
	case 1:
		return 2; /* TC_PRIO_BULK */
	case 2:
		return 6; /* TC_PRIO_INTERACTIVE */
	case 3:
		return 4; /* TC_PRIO_INTERACTIVE_BULK */
	default:
		return 0; /* TC_PRIO_BESTEFFORT */
	}
}

/* The IP length the route's MTU must hold: the packet's, or for a GSO packet each segment's
 * (headers + gso_size), as ip_forward checks it with skb_gso_validate_network_len. */
static __always_inline __u32 fib4_mtu_len(struct __sk_buff *skb, const struct pkt4 *p, __u32 tot_len)
{
	void *data = (void *)(long)skb->data, *data_end = (void *)(long)skb->data_end;
	struct tcphdr *tcp = data + ETH_HLEN + sizeof(struct iphdr); /* no IP options here */

	if (!skb->gso_size)
		return tot_len;
	/* SCTP's GSO packets carry GSO_BY_FRAGS (0xffff) here: too big, the kernel decides */
	if (p->proto != IPPROTO_TCP)
		return p->ip_hlen + sizeof(struct udphdr) + skb->gso_size;
	if ((void *)(tcp + 1) > data_end)
		return 0xffff; /* cannot tell: too big, the slow path decides */
	return p->ip_hlen + tcp->doff * 4 + skb->gso_size;
}

/* The strict reverse-path check (see the header comment): does the route back to the source
 * leave through the device the packet came in on? A missing neighbour does not matter here, only
 * the device. `fib` is the caller's scratch (fib4_route). */
static __always_inline int fib4_rpf_ok(struct __sk_buff *skb, const struct pkt4 *p, __u8 tos,
				       struct bpf_fib_lookup *fib)
{
	long rc;

	__builtin_memset(fib, 0, sizeof(*fib));
	fib->family = FIB4_AF_INET;
	fib->tos = tos;
	fib->tot_len = 1; /* an MTU check that always passes: the device is all we ask for */
	fib->ifindex = skb->ifindex;
	fib->ipv4_src = p->daddr;
	fib->ipv4_dst = p->saddr;
	rc = bpf_fib_lookup(skb, fib, sizeof(*fib), 0);
	return (rc == BPF_FIB_LKUP_RET_SUCCESS || rc == BPF_FIB_LKUP_RET_NO_NEIGH) && fib->ifindex == skb->ifindex;
}

/* ip_decrease_ttl, checksum included: TTL and protocol share a 16-bit word of the header.
 * Direct packet access, no stack: tc_ingress's stack is full. Returns 0 or -1. */
static __always_inline int fib4_dec_ttl(struct __sk_buff *skb)
{
	void *data = (void *)(long)skb->data, *data_end = (void *)(long)skb->data_end;
	struct iphdr *ip = data + ETH_HLEN;
	__be16 old_word;

	if ((void *)(ip + 1) > data_end)
		return -1;
	old_word = *(__be16 *)&ip->ttl;
	/* one less in the TTL byte, the word's first: 0x0100 in network order */
	if (bpf_l3_csum_replace(skb, ETH_HLEN + offsetof(struct iphdr, check), old_word,
				old_word - epx_htons(0x0100), sizeof(__be16)))
		return -1;
	data = (void *)(long)skb->data; /* the helper invalidated the packet pointers */
	data_end = (void *)(long)skb->data_end;
	ip = data + ETH_HLEN;
	if ((void *)(ip + 1) > data_end)
		return -1;
	ip->ttl--;
	return 0;
}

/* What the egress hook of a local pod's veth would do to this packet (tc_egress_run's packet
 * path: masquerade, or the frontend restored on a reply), counted as that hook counts it. The
 * fast path delivers into the pod with bpf_redirect_peer, which skips that hook. Returns the
 * reason (a drop stops the packet, as it would have at egress). */
static __always_inline __u32 fib4_egress_work(struct __sk_buff *skb, struct pkt4 *p, const struct lb4_config *cfg,
					       __u64 now)
{
	__u32 reason = nat4_snat(skb, p, cfg, now, NULL);

	if (!reason)
		reason = nat4_rev_dnat(skb, p, cfg, now, NULL);
	if (!reason)
		reason = EPX_PASS_NO_SERVICE;
	stats_count(reason, skb->len);
	return reason;
}

/* The fast path for candidate `p` (live packets only). Returns TC_ACT_REDIRECT (taken),
 * TC_ACT_OK (the slow path: the kernel routes it) or TC_ACT_SHOT (the egress work dropped it);
 * counts one EV_HOST_* reason. */
static __always_inline int fib4_route(struct __sk_buff *skb, struct pkt4 *p, const struct lb4_config *cfg, __u64 now)
{
	__u32 zero = 0;
	/* the lookup struct lives in this CPU's ring (tc_ingress's stack is full), reused for the
	 * reverse check, the lookup, then the redirect's next hop */
	struct ct4_ring *ring = epx_lookup(epx_ct4_ring, &zero);
	struct bpf_fib_lookup *fib;
	struct bpf_redir_neigh *nh;
	void *data, *data_end;
	struct iphdr *ip;
	__u32 out, out_flags, len, tot_len;
	__u8 tos;
	__be32 next_hop;
	long rc;

	if (!ring)
		goto stack;
	fib = &ring->fib;
	nh = (struct bpf_redir_neigh *)&ring->fib;
	if ((cfg->flags & (CFG_F_NETFILTER_FIRST | CFG_F_NETFILTER_MIDSTREAM)) || p->frag != EPX_FRAG_NONE ||
	    p->ip_hlen != sizeof(struct iphdr) || skb->pkt_type != FIB4_PACKET_HOST || skb->mark ||
	    (p->saddr & epx_htonl(0xf0000000)) == epx_htonl(0xe0000000))
		goto skip;
	/* the header as the translation left it (linear: pkt4_parse_skb pulled it) */
	data = (void *)(long)skb->data;
	data_end = (void *)(long)skb->data_end;
	ip = data + ETH_HLEN;
	if ((void *)(ip + 1) > data_end || ip->ttl <= 1)
		goto skip;
	tos = ip->tos;
	tot_len = epx_ntohs(ip->tot_len);
	if (!fib4_rpf_ok(skb, p, tos, fib))
		goto stack;

	__builtin_memset(fib, 0, sizeof(*fib));
	fib->family = FIB4_AF_INET;
	fib->tos = tos;
	fib->l4_protocol = p->proto;
	fib->sport = p->sport;
	fib->dport = p->dport;
	len = fib4_mtu_len(skb, p, tot_len);
	fib->tot_len = len > 0xffff ? 0xffff : len;
	fib->ifindex = skb->ifindex;
	fib->ipv4_src = p->saddr;
	fib->ipv4_dst = p->daddr;
	rc = bpf_fib_lookup(skb, fib, sizeof(*fib), 0);
	if (rc == BPF_FIB_LKUP_RET_FRAG_NEEDED) {
		stats_count(EPX_EV_HOST_STACK_MTU, skb->len);
		return TC_ACT_OK;
	}
	if (rc != BPF_FIB_LKUP_RET_SUCCESS)
		goto stack;
	out = fib->ifindex;
	out_flags = lb4_iface_flags(out);
	/* a route MTU the lookup does not enforce (unlocked), as the agent read it from the routes */
	if ((out_flags >> EPX_IF_MTU_SHIFT) && len > (out_flags >> EPX_IF_MTU_SHIFT)) {
		stats_count(EPX_EV_HOST_STACK_MTU, skb->len);
		return TC_ACT_OK;
	}
	/* ip_forward sends an ICMP redirect for a packet routed back out where it came from */
	if (out == skb->ifindex && !(out_flags & EPX_IF_NO_REDIRECTS))
		goto stack;

	/* the frame's addresses for the pod (the neighbour entry the lookup found); on the other way
	 * out, the neighbour subsystem writes them. Harmless if the stack takes the packet after all:
	 * forwarding rebuilds the Ethernet header. */
	if ((out_flags & EPX_IF_PEER) && (bpf_skb_store_bytes(skb, 0, fib->dmac, ETH_ALEN, 0) ||
					  bpf_skb_store_bytes(skb, ETH_ALEN, fib->smac, ETH_ALEN, 0)))
		goto stack;
	next_hop = fib->ipv4_dst; /* the gateway, or the destination itself on a link route */
	if (fib4_dec_ttl(skb)) {
		stats_count(EPX_DROP_NAT_FAILED, skb->len); /* the header may be half-written */
		return TC_ACT_SHOT;
	}
	skb->priority = fib4_tos2priority(tos);
	if (out_flags & EPX_IF_PEER) {
		/* into a local pod: its host-side egress hook will not run, do its work now */
		if (epx_is_drop(fib4_egress_work(skb, p, cfg, now)))
			return TC_ACT_SHOT;
		stats_count(EPX_EV_HOST_ROUTED_PEER, skb->len);
		return bpf_redirect_peer(out, 0);
	}
	__builtin_memset(nh, 0, sizeof(*nh));
	nh->nh_family = FIB4_AF_INET;
	nh->ipv4_nh = next_hop;
	stats_count(EPX_EV_HOST_ROUTED_NEIGH, skb->len);
	return fib4_redirect_neigh(out, nh, sizeof(*nh), 0);
skip:
	stats_count(EPX_EV_HOST_STACK_SKIP, skb->len);
	return TC_ACT_OK;
stack:
	stats_count(EPX_EV_HOST_STACK_FIB, skb->len);
	return TC_ACT_OK;
}

#endif /* EPX_FIB4_H */
