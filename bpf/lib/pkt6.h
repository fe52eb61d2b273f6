/* IPv6 packet parsing shared by the TC and XDP programs (pkt4.h's counterpart): one parser, so
 * both see the same facts.
 *
 * Extension headers are where an IPv6 parser breaks or is bypassed, so they are walked, bounded:
 * up to EPX_IPV6_MAX_EXTHDRS hop-by-hop, routing, destination-options or authentication headers
 * before TCP/UDP/SCTP, which is where the ports are (a service packet carrying a few options is still
 * a service packet). What the walk cannot handle gets a named, counted verdict, never a guess:
 *   - a fragment header: EPX_PASS_IPV6_FRAG (no IPv6 fragment tracking yet; pkt4.h's epx_frag4
 *     has no IPv6 twin);
 *   - more headers than the walk takes, or a chain whose L4 header lies beyond EPX_PULL6_LEN:
 *     EPX_DROP_IPV6_EXTHDRS, dropped rather than passed, so that no chain of options can carry a
 *     new connection past the service rules (eTP=Local, source ranges) to a frontend address;
 *   - an IPv6 or extension header cut short by the frame or by the payload length, a payload
 *     length longer than the frame, a version other than 6: EPX_DROP_MALFORMED_IPV6 (the kernel
 *     drops those too);
 *   - no TCP/UDP/SCTP at the end of the chain (ICMPv6, neighbour discovery, ESP, no next
 *     header): EPX_PASS_IPV6_NOT_L4, untouched;
 *   - a TCP/UDP/SCTP header cut short, a TCP data offset < 5: EPX_DROP_MALFORMED_L4 (as IPv4).
 * SCTP is parsed as pkt4.h parses it: its ports, and its first chunk as a TCP flag (pkt4_sctp_flags).
 * A frame whose Ethernet type is not IPv6 gets EPX_PASS_NOT_IPV4 (neither family).
 */
#ifndef EPX_PKT6_H
#define EPX_PKT6_H

#include <uapi/linux/ipv6.h>
#include "lib/pkt4.h"

#define EPX_IPV6_MAX_EXTHDRS 4   /* extension headers walked before TCP/UDP */
#define EPX_IPV6_HLEN 40         /* sizeof(struct ipv6hdr) */

/* next-header values (include/net/ipv6.h's NEXTHDR_*, which is not UAPI) */
#define EPX_NEXTHDR_HOP 0
#define EPX_NEXTHDR_ROUTING 43
#define EPX_NEXTHDR_FRAGMENT 44
#define EPX_NEXTHDR_AUTH 51
#define EPX_NEXTHDR_ICMP 58
#define EPX_NEXTHDR_DEST 60

/* Linear bytes the programs read: Ethernet + IPv6 + the extension headers walked + TCP. */
#define EPX_PULL6_LEN (ETH_HLEN + EPX_IPV6_HLEN + EPX_IPV6_MAX_EXTLEN + sizeof(struct tcphdr))

struct pkt6 {
	struct epx_in6 saddr;
	struct epx_in6 daddr;
	__be16 sport;
	__be16 dport;
	__u16 l4_off; /* offset of the L4 header from the start of the frame */
	__u8 proto;
	__u8 tcp_flags;
	/* epx_config6, looked up once by pkt6_parse (non-NULL when it returns 0): every later reader
	 * of the same packet (lb6_flags, ct6_create, nat6_rev_snat, icmp6_err) takes it from here */
	const struct lb6_config *cfg6;
};

static __always_inline int in6_eq(const struct epx_in6 *a, const struct epx_in6 *b)
{
	return a->w[0] == b->w[0] && a->w[1] == b->w[1] && a->w[2] == b->w[2] && a->w[3] == b->w[3];
}

static __always_inline int in6_is_zero(const struct epx_in6 *a)
{
	return !(a->w[0] | a->w[1] | a->w[2] | a->w[3]);
}

static __always_inline int pkt6_is_exthdr(__u8 nh)
{
	return nh == EPX_NEXTHDR_HOP || nh == EPX_NEXTHDR_ROUTING || nh == EPX_NEXTHDR_DEST || nh == EPX_NEXTHDR_AUTH;
}

/* The length of extension header `nh` whose length field says `hdrlen`: AH counts 4-byte units
 * minus 2 (RFC 4302), the others 8-byte units minus 1. Shared with icmp6_err.h's walk of a quote. */
static __always_inline __u32 pkt6_exthdr_len(__u8 nh, __u8 hdrlen)
{
	return nh == EPX_NEXTHDR_AUTH ? ((__u32)hdrlen + 2) * 4 : ((__u32)hdrlen + 1) * 8;
}

/* The node's IPv6 configuration (epx_config6): looked up once per packet or call, and passed
 * down from there (struct pkt6's cfg6, lb6_flags' argument). */
static __always_inline const struct lb6_config *pkt6_config(void)
{
	__u32 zero = 0;

	return epx_lookup(epx_config6, &zero);
}

/* Does the eBPF datapath serve IPv6 on this node (CFG6_F_ON)? Until the agent says so, every
 * entry (TC, XDP) leaves IPv6 untouched, as before the programs knew IPv6: nothing parsed,
 * dropped or counted but EPX_PASS_IPV6_OFF. */
static __always_inline int pkt6_served(const struct lb6_config *cfg6)
{
	return cfg6 && (cfg6->flags & CFG6_F_ON);
}

/* Fill `p` from a frame; `wire_len` is the whole frame's length (linear or not). Returns 0 for a
 * TCP/UDP packet, else the epx_reason to count (see the header comment). */
static __always_inline __u32 pkt6_parse(void *data, void *data_end, __u32 wire_len, struct pkt6 *p)
{
	struct ethhdr *eth = data;
	struct ipv6hdr *ip6;
	__u32 off = EPX_IPV6_HLEN, end;
	__u8 nh;

	if ((void *)(eth + 1) > data_end || eth->h_proto != epx_htons(ETH_P_IPV6))
		return EPX_PASS_NOT_IPV4;
	p->cfg6 = pkt6_config();
	if (!pkt6_served(p->cfg6))
		return EPX_PASS_IPV6_OFF;
	ip6 = (void *)(eth + 1);
	if ((void *)(ip6 + 1) > data_end || wire_len < ETH_HLEN + EPX_IPV6_HLEN)
		return EPX_DROP_MALFORMED_IPV6;
	end = EPX_IPV6_HLEN + epx_ntohs(ip6->payload_len); /* from the IPv6 header; bytes past it are padding */
	if (ip6->version != 6 || end > wire_len - ETH_HLEN)
		return EPX_DROP_MALFORMED_IPV6;
	__builtin_memcpy(&p->saddr, &ip6->saddr, sizeof(p->saddr));
	__builtin_memcpy(&p->daddr, &ip6->daddr, sizeof(p->daddr));
	nh = ip6->nexthdr;

#pragma unroll
	for (int i = 0; i < EPX_IPV6_MAX_EXTHDRS; i++) {
		struct ipv6_opt_hdr *h;

		if (!pkt6_is_exthdr(nh))
			break;
		if (off + sizeof(*h) > end)
			return EPX_DROP_MALFORMED_IPV6; /* cut short by the payload length */
		h = (void *)ip6 + off;
		if ((void *)(h + 1) > data_end)
			return off + sizeof(*h) > wire_len - ETH_HLEN ? EPX_DROP_MALFORMED_IPV6 : EPX_DROP_IPV6_EXTHDRS;
		off += pkt6_exthdr_len(nh, h->hdrlen);
		nh = h->nexthdr;
		if (off > end)
			return EPX_DROP_MALFORMED_IPV6;
		if (off > EPX_IPV6_HLEN + EPX_IPV6_MAX_EXTLEN)
			return EPX_DROP_IPV6_EXTHDRS;
	}
	if (nh == EPX_NEXTHDR_FRAGMENT)
		return EPX_PASS_IPV6_FRAG;
	if (pkt6_is_exthdr(nh))
		return EPX_DROP_IPV6_EXTHDRS; /* the walk ended before the chain did */
	p->proto = nh;
	p->l4_off = ETH_HLEN + off;
	if (nh != IPPROTO_TCP && nh != IPPROTO_UDP && nh != IPPROTO_SCTP)
		return EPX_PASS_IPV6_NOT_L4;

	if (nh == IPPROTO_TCP) {
		struct tcphdr *tcp = (void *)ip6 + off;

		if (end < off + sizeof(*tcp) || (void *)(tcp + 1) > data_end || tcp->doff < 5)
			return EPX_DROP_MALFORMED_L4;
		p->sport = tcp->source;
		p->dport = tcp->dest;
		p->tcp_flags = ((__u8 *)tcp)[13];
	} else if (nh == IPPROTO_SCTP) {
		struct sctp4_hdr *sctp = (void *)ip6 + off;
		__u8 *chunk = (void *)(sctp + 1);

		if (end < off + sizeof(*sctp) || (void *)(sctp + 1) > data_end)
			return EPX_DROP_MALFORMED_L4;
		p->sport = sctp->source;
		p->dport = sctp->dest;
		/* as pkt4.h: a chunk missing or past the pulled bytes reads as DATA */
		if ((void *)(chunk + 1) <= data_end && end >= off + sizeof(*sctp) + 1)
			p->tcp_flags = pkt4_sctp_flags(*chunk);
	} else {
		struct udphdr *udp = (void *)ip6 + off;

		if (end < off + sizeof(*udp) || (void *)(udp + 1) > data_end)
			return EPX_DROP_MALFORMED_L4;
		p->sport = udp->source;
		p->dport = udp->dest;
	}
	return 0;
}

/* TC: make the headers linear (and writable), then parse. */
static __always_inline __u32 pkt6_parse_skb(struct __sk_buff *skb, struct pkt6 *p)
{
	__u32 len = skb->len < EPX_PULL6_LEN ? skb->len : EPX_PULL6_LEN;

	if ((void *)(long)skb->data + len > (void *)(long)skb->data_end)
		bpf_skb_pull_data(skb, len); /* on failure the bounds checks catch it */
	return pkt6_parse((void *)(long)skb->data, (void *)(long)skb->data_end, skb->len, p);
}

#endif /* EPX_PKT6_H */
