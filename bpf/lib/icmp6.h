/* kube-proxy's REJECT for IPv6 (ip6tables REJECT --reject-with icmp6-port-unreachable): an
 * ICMPv6 destination unreachable, port unreachable (type 1, code 4) to the client.
 *
 * Built in place, as icmp4_reject: Ethernet addresses swapped, a new IPv6 header (the source is
 * the frontend address the client used), the ICMPv6 header, then the quote: the offending
 * packet's IPv6 header, the extension headers pkt6.h walked and the first 8 L4 bytes, which is
 * what the client's stack needs to find its socket. The quote is copied through the per-CPU
 * scratch (struct scratch6: up to 304 bytes do not fit the stack), and the caller bounces the
 * frame out of the device it came in on. The ICMPv6 checksum covers the pseudo-header (source,
 * destination, upper-layer length, next header 58) and the whole message.
 *
 * CHECKSUM_PARTIAL (see icmp4.h, also for SCTP, quoted the same way, whose pending CRC32c the
 * pod's offloading veth leaves alone): a local pod's packet usually arrives with its checksum still
 * owed at csum_start (the original L4 header, frame offset l4_off) + 16 (TCP) or + 6 (UDP), and
 * the kernel computes it over [csum_start, end] if the reply leaves through a device without TX
 * checksum offload. IPv4 pads its header with zero options; IPv6 has no header options, and the
 * ICMPv6 message alone does not sum to zero (its checksum covers the pseudo-header), so for such
 * packets a destination-options header is put between the IPv6 and ICMPv6 headers, laid out so
 * that the pending completion is a no-op: the header runs EPX_ICMP6_PARTIAL_PAD bytes past
 * csum_start, both checksum positions fall on zero option data, and a compensation value (in an
 * experimental option, RFC 4727 type 0x1E: "skip if unknown") makes [csum_start, end] sum to
 * zero, so the kernel writes 0 over 0. Bytes of the header before csum_start are one more
 * experimental option of zeros; no padding run is longer than the 7 bytes Linux accepts.
 *   offset from csum_start:  +2 0x1E,4  +4 compensation  +6 0 0  +8 0x1E,8  +10..+17 zeros
 *                            +18 PadN,4  +20..+23 zeros   (then the ICMPv6 header)
 * Replies to other clients carry no extension header.
 */
#ifndef EPX_ICMP6_H
#define EPX_ICMP6_H

#include <uapi/linux/icmpv6.h>
#include "lib/csum.h"
#include "lib/pkt6.h"

#define EPX_ICMP6_HOP_LIMIT 64
#define EPX_ICMP6_DEST_UNREACH 1
#define EPX_ICMP6_PORT_UNREACH 4
#define EPX_IPV6_OPT_EXP 0x1e /* RFC 4727 experimental option: action 00 (skip), not changed en route */
#define EPX_IPV6_OPT_PADN 1

/* The destination-options header of the padded layout into s->opts, for a packet whose L4 header
 * followed `d` bytes of extension headers (a multiple of 8), compensation still 0. Returns its length. */
static __always_inline __u32 icmp6_partial_opts(struct scratch6 *s, __u32 d)
{
	__u32 len = d + EPX_ICMP6_PARTIAL_PAD;

	__builtin_memset(s->opts, 0, sizeof(s->opts));
	if (d > EPX_IPV6_MAX_EXTLEN)
		return 0;
	s->opts[0] = EPX_NEXTHDR_ICMP;
	s->opts[1] = len / 8 - 1;
	if (d) { /* bytes 2 .. d+1: zeros in an option the receiver skips */
		s->opts[2] = EPX_IPV6_OPT_EXP;
		s->opts[3] = d - 2;
	}
	s->opts[d + 2] = EPX_IPV6_OPT_EXP;
	s->opts[d + 3] = 4;
	s->opts[d + 8] = EPX_IPV6_OPT_EXP;
	s->opts[d + 9] = 8;
	s->opts[d + 18] = EPX_IPV6_OPT_PADN;
	s->opts[d + 19] = 4;
	return len;
}

/* Rewrite the skb into the ICMPv6 error for `p`; `partial_safe` asks for the padded layout (a
 * client that may have sent CHECKSUM_PARTIAL). Returns 0 (caller redirects) or
 * EPX_DROP_REJECT_FAILED (the packet may be half-written). */
static __always_inline __u32 icmp6_reject(struct __sk_buff *skb, const struct pkt6 *p, struct scratch6 *s,
					  int partial_safe)
{
	__u32 qlen = p->l4_off - ETH_HLEN + 8;
	__u32 d = p->l4_off - ETH_HLEN - EPX_IPV6_HLEN; /* the original extension headers' bytes */
	__u32 olen = 0, icmp_off;
	struct ipv6hdr ip6 = {};
	struct icmp6hdr icmp = {};
	struct ethhdr eth;
	__u8 mac[ETH_ALEN];
	__be32 words[2];
	__s64 sum, qsum;

	if (qlen < EPX_IPV6_HLEN + 8 || qlen > EPX_ICMP6_QUOTE_MAX || skb->len < ETH_HLEN + qlen)
		return EPX_DROP_REJECT_FAILED;
	if (partial_safe && !(d & 7)) /* AH can leave a 4-byte multiple: no 8-byte header ends there */
		olen = icmp6_partial_opts(s, d);
	if (olen > EPX_ICMP6_OPTS_MAX)
		return EPX_DROP_REJECT_FAILED;
	icmp_off = ETH_HLEN + EPX_IPV6_HLEN + olen;
	if (bpf_skb_load_bytes(skb, 0, &eth, sizeof(eth)) || bpf_skb_load_bytes(skb, ETH_HLEN, s->quote, qlen))
		return EPX_DROP_REJECT_FAILED;
	__builtin_memcpy(mac, eth.h_source, ETH_ALEN);
	__builtin_memcpy(eth.h_source, eth.h_dest, ETH_ALEN);
	__builtin_memcpy(eth.h_dest, mac, ETH_ALEN);

	ip6.version = 6;
	ip6.payload_len = epx_htons(olen + sizeof(icmp) + qlen);
	ip6.nexthdr = olen ? EPX_NEXTHDR_DEST : EPX_NEXTHDR_ICMP;
	ip6.hop_limit = EPX_ICMP6_HOP_LIMIT;
	__builtin_memcpy(&ip6.saddr, &p->daddr, sizeof(ip6.saddr));
	__builtin_memcpy(&ip6.daddr, &p->saddr, sizeof(ip6.daddr));
	icmp.icmp6_type = EPX_ICMP6_DEST_UNREACH;
	icmp.icmp6_code = EPX_ICMP6_PORT_UNREACH;

	/* the message: header (checksum 0) and quote (a multiple of 4 bytes, as bpf_csum_diff needs) */
	qsum = bpf_csum_diff(NULL, 0, (__be32 *)s->quote, qlen, 0);
	if (qsum < 0)
		return EPX_DROP_REJECT_FAILED;
	sum = bpf_csum_diff(NULL, 0, (__be32 *)&icmp, sizeof(icmp), (__u32)qsum);
	/* the pseudo-header: both addresses (adjacent in the header), length, next header */
	if (sum >= 0)
		sum = bpf_csum_diff(NULL, 0, (__be32 *)&ip6.saddr, 2 * sizeof(ip6.saddr), (__u32)sum);
	words[0] = epx_htonl(sizeof(icmp) + qlen);
	words[1] = epx_htonl(EPX_NEXTHDR_ICMP);
	if (sum >= 0)
		sum = bpf_csum_diff(NULL, 0, words, sizeof(words), (__u32)sum);
	if (sum < 0)
		return EPX_DROP_REJECT_FAILED;
	icmp.icmp6_cksum = csum_fold(sum);

	if (olen) {
		/* compensation: [csum_start, end] = options from d on + the message must sum to zero */
		sum = bpf_csum_diff(NULL, 0, (__be32 *)&s->opts[d], EPX_ICMP6_PARTIAL_PAD, (__u32)qsum);
		if (sum >= 0)
			sum = bpf_csum_diff(NULL, 0, (__be32 *)&icmp, sizeof(icmp), (__u32)sum);
		if (sum < 0)
			return EPX_DROP_REJECT_FAILED;
		*(__sum16 *)&s->opts[d + 4] = csum_fold(sum);
	}

	if (bpf_skb_change_tail(skb, icmp_off + sizeof(icmp) + qlen, 0) ||
	    bpf_skb_store_bytes(skb, 0, &eth, sizeof(eth), 0) ||
	    bpf_skb_store_bytes(skb, ETH_HLEN, &ip6, sizeof(ip6), 0) ||
	    (olen && bpf_skb_store_bytes(skb, ETH_HLEN + sizeof(ip6), s->opts, olen, 0)) ||
	    bpf_skb_store_bytes(skb, icmp_off, &icmp, sizeof(icmp), 0) ||
	    bpf_skb_store_bytes(skb, icmp_off + sizeof(icmp), s->quote, qlen, 0))
		return EPX_DROP_REJECT_FAILED;
	return 0;
}

#endif /* EPX_ICMP6_H */
