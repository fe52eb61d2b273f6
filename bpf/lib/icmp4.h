/* kube-proxy's REJECT for a service without usable endpoints: ICMP port unreachable to the client.
 *
 * The packet is turned into the ICMP error in place (Ethernet addresses swapped, a new IP and
 * ICMP header, then the original IP header with its options and the first 8 L4 bytes, as
 * RFC 792 quotes them) and bounced out of the device it came in on. A TCP client sees
 * "connection refused", a UDP client's next call fails with ECONNREFUSED, as with iptables.
 * The source of the error is the frontend address the client used.
 *
 * A packet from a local pod usually arrives CHECKSUM_PARTIAL (the pod's veth offloads its
 * checksum): the kernel still owes a checksum at csum_start + csum_offset, i.e. the original
 * L4 header + 16 (TCP) or + 6 (UDP), and computes it in software over [csum_start, end] if the
 * packet leaves through a device without TX checksum offload. BPF cannot clear that state, so
 * for such packets the reply is laid out to make that computation a no-op: the IP header gets
 * 12 zero bytes of options (End of Option List), which puts csum_start on them and both
 * possible checksum positions on zero bytes (an option byte, or the ICMP "unused" field); the
 * range then sums to a valid checksum already (zeros + a valid ICMP message), so the kernel
 * writes 0 over 0. Replies to other clients carry no options.
 *
 * SCTP (any protocol: kube-proxy's REJECT rule matches SCTP too) is quoted the same way: the
 * IP header and 8 bytes, its ports and verification tag, which is what the client's SCTP
 * (sctp_v4_err) needs to find its association. A pod's SCTP packet whose CRC32c the pod left to
 * its veth is CHECKSUM_PARTIAL with csum_not_inet, csum_offset 8: a software completion would
 * write a CRC32c (not a zero) over the padding's bytes 8-11, and no layout makes that a no-op.
 * It does not happen: the reply goes back out of the pod's own host-side veth, which offloads
 * SCTP CRCs (tx-checksum-sctp, on by default on veths), so nothing is computed on the way and
 * the pod's ICMP receive path accepts a CHECKSUM_PARTIAL skb as checked. With that offload
 * turned off on the host side, such a reply would fail its IP checksum at the pod: the client
 * then times out instead of being refused.
 */
#ifndef EPX_ICMP4_H
#define EPX_ICMP4_H

#include "lib/csum.h"
#include "lib/pkt4.h"

#define EPX_ICMP_TOS 0xc0 /* IPTOS_PREC_INTERNETCONTROL, as the kernel's own ICMP errors */
#define EPX_ICMP_TTL 64
#define EPX_ICMP_PARTIAL_PAD 12 /* see above: csum_offset 16 lands on ICMP bytes 4-5 */

_Static_assert(sizeof(((struct ct4_ring *)0)->fib) >= EPX_MAX_IP_HLEN - sizeof(struct iphdr),
	       "the reject's padding comes from ct4_ring's scratch");

/* Rewrite the skb into the ICMP error for `p`; `partial_safe` asks for the padded layout (a
 * client that may have sent CHECKSUM_PARTIAL). Returns 0 (caller redirects) or
 * EPX_DROP_REJECT_FAILED. */
static __always_inline __u32 icmp4_reject(struct __sk_buff *skb, const struct pkt4 *p, int partial_safe)
{
	__u8 quote[EPX_ICMP_QUOTE_MAX];
	__u32 zero = 0;
	/* the padding's zeros come from this CPU's scratch (common.h: ct4_ring.fib), not the stack:
	 * tc_ingress's 512 bytes are full */
	struct ct4_ring *scratch = epx_lookup(epx_ct4_ring, &zero);
	struct ethhdr eth;
	struct iphdr ip = {};
	struct icmphdr icmp = {};
	__u8 mac[ETH_ALEN];
	__u32 qlen = p->ip_hlen + 8;
	__u32 padlen = 0, icmp_off;
	__s64 sum;

	if (p->frag == EPX_FRAG_LATER || qlen < sizeof(struct iphdr) + 8 || qlen > EPX_ICMP_QUOTE_MAX)
		return EPX_DROP_REJECT_FAILED;
	/* the padding must start where the original L4 header did: our header is as long as the
	 * original one plus the pad, which an IHL of 15 at most allows */
	if (partial_safe && p->ip_hlen + EPX_ICMP_PARTIAL_PAD <= EPX_MAX_IP_HLEN)
		padlen = p->ip_hlen - sizeof(ip) + EPX_ICMP_PARTIAL_PAD;
	if (padlen > EPX_MAX_IP_HLEN - sizeof(ip))
		return EPX_DROP_REJECT_FAILED;
	icmp_off = ETH_HLEN + sizeof(ip) + padlen;
	if (bpf_skb_load_bytes(skb, 0, &eth, sizeof(eth)) || bpf_skb_load_bytes(skb, ETH_HLEN, quote, qlen))
		return EPX_DROP_REJECT_FAILED;
	if (padlen) {
		if (!scratch)
			return EPX_DROP_REJECT_FAILED;
		__builtin_memset(&scratch->fib, 0, sizeof(scratch->fib));
	}

	__builtin_memcpy(mac, eth.h_source, ETH_ALEN);
	__builtin_memcpy(eth.h_source, eth.h_dest, ETH_ALEN);
	__builtin_memcpy(eth.h_dest, mac, ETH_ALEN);

	ip.version = 4;
	ip.ihl = (sizeof(ip) + padlen) / 4;
	ip.tos = EPX_ICMP_TOS;
	ip.tot_len = epx_htons(sizeof(ip) + padlen + sizeof(icmp) + qlen);
	ip.id = (__be16)bpf_get_prandom_u32();
	ip.ttl = EPX_ICMP_TTL;
	ip.protocol = IPPROTO_ICMP;
	ip.saddr = p->daddr;
	ip.daddr = p->saddr;
	sum = bpf_csum_diff(NULL, 0, (__be32 *)&ip, sizeof(ip), 0);
	if (sum < 0)
		return EPX_DROP_REJECT_FAILED;
	ip.check = csum_fold(sum);

	icmp.type = ICMP_DEST_UNREACH;
	icmp.code = ICMP_PORT_UNREACH;
	sum = bpf_csum_diff(NULL, 0, (__be32 *)&icmp, sizeof(icmp), 0);
	if (sum < 0)
		return EPX_DROP_REJECT_FAILED;
	sum = bpf_csum_diff(NULL, 0, (__be32 *)quote, qlen, sum);
	if (sum < 0)
		return EPX_DROP_REJECT_FAILED;
	icmp.checksum = csum_fold(sum);

	/* zero options add nothing to the IP checksum computed above */
	if (bpf_skb_change_tail(skb, icmp_off + sizeof(icmp) + qlen, 0) ||
	    bpf_skb_store_bytes(skb, 0, &eth, sizeof(eth), 0) ||
	    bpf_skb_store_bytes(skb, ETH_HLEN, &ip, sizeof(ip), 0) ||
	    (padlen && scratch && bpf_skb_store_bytes(skb, ETH_HLEN + sizeof(ip), &scratch->fib, padlen, 0)) ||
	    bpf_skb_store_bytes(skb, icmp_off, &icmp, sizeof(icmp), 0) ||
	    bpf_skb_store_bytes(skb, icmp_off + sizeof(icmp), quote, qlen, 0))
		return EPX_DROP_REJECT_FAILED;
	return 0;
}

#endif /* EPX_ICMP4_H */
