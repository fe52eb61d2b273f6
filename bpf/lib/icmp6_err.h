/* ICMPv6 errors about translated connections: icmp4_err.h's twin (read its header comment first:
 * why, which translation, the four cases and the checksum rules are the same).
 *
 * An ICMPv6 error (RFC 4443: every type below 128; among them destination unreachable, packet too
 * big, time exceeded, parameter problem) quotes as much of the offending packet as fits in 1280
 * bytes: its IPv6 header, extension headers, then the L4 header. If that packet belongs to a
 * connection we translate, the error gets the translation its reply would get, as
 * nf_nat_icmpv6_reply_translation does; without it a client never learns the path MTU toward a
 * Service (IPv6 routers do not fragment: packet too big is the only way) and its connection stalls.
 *
 *   ingress  quoted (masq addr:port -> backend)  CT4_REV_SNAT: outer dst and quoted src = client
 *            quoted (frontend -> client)         CT4_SVC:      outer dst and quoted src = backend
 *   egress   quoted (client -> backend)          CT4_REV_DNAT: outer src and quoted dst = frontend
 *            quoted (backend -> client)          CT4_SNAT:     outer src and quoted dst = masq addr:port
 * looked up read-only (an error changes no connection) with nat6.h's *_owns predicates, the ones
 * the packet path honours a half by.
 *
 * Differences from IPv4:
 *   - no IP header checksum, outer or quoted;
 *   - the ICMPv6 checksum covers a pseudo-header with the outer addresses: the outer rewrite fixes
 *     it as a TCP/UDP checksum is fixed (nat6_store_addr, BPF_F_PSEUDO_HDR);
 *   - a 16-byte quoted address goes through csum_quoted_replace16 (csum.h: the quoted L4
 *     checksum, whose pseudo-header holds it, and the ICMPv6 checksum, as a bpf_csum_diff);
 *   - the quote's extension headers are walked within pkt6.h's limits (EPX_IPV6_MAX_EXTHDRS
 *     headers, EPX_IPV6_MAX_EXTLEN bytes). A longer chain is passed untouched under
 *     EPX_PASS_ICMP6_EXTHDRS: unlike a packet (EPX_DROP_IPV6_EXTHDRS), an error left untranslated
 *     reaches nothing it could not reach before, so it is not dropped; a header the quote cuts
 *     short is EPX_PASS_ICMP_MALFORMED (checked first, as pkt6_parse does);
 *   - a quoted fragment header: EPX_PASS_ICMP6_FRAG (the packet path passes IPv6 fragments
 *     untranslated, EPX_PASS_IPV6_FRAG, so no connection of ours can be the one quoted).
 * As IPv4: a quote cut short or not IPv6 is EPX_PASS_ICMP_MALFORMED, a quoted protocol other than
 * TCP/UDP or no connection EPX_PASS_ICMP_NO_CT, ICMPv6 that is not an error (echo, neighbour
 * discovery) keeps EPX_PASS_IPV6_NOT_L4, and a fragmented error never gets here (pkt6_parse:
 * EPX_PASS_IPV6_FRAG). The quoted TCP checksum is updated only when the whole TCP header is
 * quoted, the quoted UDP checksum unless 0, as the kernel does; the ICMPv6 checksum incrementally.
 */
#ifndef EPX_ICMP6_ERR_H
#define EPX_ICMP6_ERR_H

#include <uapi/linux/icmpv6.h>
#include "lib/csum.h"
#include "lib/nat6.h"

#define EPX_ICMP6_INFOMSG_MASK 0x80 /* RFC 4443 2.1: types 0-127 are errors, 128-255 informational */

/* Where the quoted packet lies (its addresses and ports are in the reversed key, see below). */
struct icmp6_err {
	__u32 csum_off;   /* the ICMPv6 checksum */
	__u32 in_off;     /* the quoted IPv6 header */
	__u32 in_l4_off;  /* the quoted L4 header */
	__u32 in_l4_csum; /* the quoted L4 checksum, 0: not rewritten (not quoted, or UDP's "none") */
};

/* Parse the ICMPv6 error of `p` (pkt6_parse said PASS_IPV6_NOT_L4, next header ICMPv6) into `e`,
 * and into `q` the quote *reversed* (its destination as q's source, its ports swapped), kind 0:
 * the packet this error answers as a reply, whose key its translation is looked up by. Returns 0,
 * or the reason to pass it untouched. */
static __always_inline __u32 icmp6_err_parse(struct __sk_buff *skb, const struct pkt6 *p, struct icmp6_err *e,
					     struct ct6_key *q)
{
	__be16 plen, ports[4];
	__u8 type, hdr[8], ext[2], nh;
	__u32 end, off, ext_end;

	if (bpf_skb_load_bytes(skb, ETH_HLEN + offsetof(struct ipv6hdr, payload_len), &plen, sizeof(plen)))
		return EPX_PASS_IPV6_NOT_L4;
	end = ETH_HLEN + EPX_IPV6_HLEN + epx_ntohs(plen); /* pkt6_parse checked it; the frame may carry padding past it */
	if (p->l4_off + sizeof(struct icmp6hdr) > end || bpf_skb_load_bytes(skb, p->l4_off, &type, sizeof(type)))
		return EPX_PASS_IPV6_NOT_L4;
	if (type & EPX_ICMP6_INFOMSG_MASK)
		return EPX_PASS_IPV6_NOT_L4;

	e->csum_off = p->l4_off + offsetof(struct icmp6hdr, icmp6_cksum);
	e->in_off = p->l4_off + sizeof(struct icmp6hdr);
	if (e->in_off + EPX_IPV6_HLEN > end || bpf_skb_load_bytes(skb, e->in_off, hdr, sizeof(hdr)))
		return EPX_PASS_ICMP_MALFORMED;
	if (hdr[0] >> 4 != 6)
		return EPX_PASS_ICMP_MALFORMED;
	nh = hdr[offsetof(struct ipv6hdr, nexthdr)];
	if (bpf_skb_load_bytes(skb, e->in_off + offsetof(struct ipv6hdr, daddr), &q->saddr, sizeof(q->saddr)) ||
	    bpf_skb_load_bytes(skb, e->in_off + offsetof(struct ipv6hdr, saddr), &q->daddr, sizeof(q->daddr)))
		return EPX_PASS_ICMP_MALFORMED;

	/* pkt6_parse's walk and limits, in its order (cut short, then too long), over the quote */
	off = e->in_off + EPX_IPV6_HLEN;
	ext_end = off + EPX_IPV6_MAX_EXTLEN;
#pragma unroll
	for (int i = 0; i < EPX_IPV6_MAX_EXTHDRS; i++) {
		if (!pkt6_is_exthdr(nh))
			break;
		if (off + sizeof(ext) > end || bpf_skb_load_bytes(skb, off, ext, sizeof(ext)))
			return EPX_PASS_ICMP_MALFORMED;
		off += pkt6_exthdr_len(nh, ext[1]);
		nh = ext[0];
		if (off > end)
			return EPX_PASS_ICMP_MALFORMED; /* cut short by the quote's end */
		if (off > ext_end)
			return EPX_PASS_ICMP6_EXTHDRS;
	}
	if (nh == EPX_NEXTHDR_FRAGMENT)
		return EPX_PASS_ICMP6_FRAG;
	if (pkt6_is_exthdr(nh))
		return EPX_PASS_ICMP6_EXTHDRS; /* the walk ended before the chain did */
	if (nh != IPPROTO_TCP && nh != IPPROTO_UDP && nh != IPPROTO_SCTP)
		return EPX_PASS_ICMP_NO_CT; /* we translate no other protocol */
	e->in_l4_off = off;
	/* the first 8 L4 bytes: the ports and (UDP) checksum */
	if (off + sizeof(ports) > end || bpf_skb_load_bytes(skb, off, ports, sizeof(ports)))
		return EPX_PASS_ICMP_MALFORMED;
	q->sport = ports[1];
	q->dport = ports[0];
	q->proto = nh;
	q->kind = 0;
	q->pad = 0;
	e->in_l4_csum = 0; /* SCTP: its quoted CRC32c stays, as icmp4_err.h leaves IPv4's */
	if (nh == IPPROTO_UDP && ports[3])
		e->in_l4_csum = off + offsetof(struct udphdr, check);
	else if (nh == IPPROTO_TCP && off + sizeof(struct tcphdr) <= end)
		e->in_l4_csum = off + offsetof(struct tcphdr, check);
	return 0;
}

/* Apply the translation "the packet side `side` (NAT4_SRC/NAT4_DST) becomes addr:port" to the
 * error whose reversed quote is `q`: the outer `side`, the quoted other side. Returns
 * EPX_ICMP_RELATED or EPX_DROP_NAT_FAILED (the packet may be half-written: conntrack drops it then
 * too). */
static __always_inline __u32 icmp6_err_rewrite(struct __sk_buff *skb, const struct pkt6 *p, const struct icmp6_err *e,
					       const struct ct6_key *q, int side, const struct epx_in6 *addr, __be16 port)
{
	int src = side == NAT4_SRC;
	/* the quoted header's side opposite to `side`, which q holds reversed */
	const struct epx_in6 *in_addr = src ? &q->saddr : &q->daddr;
	__be16 in_port = src ? q->sport : q->dport;
	__u32 in_addr_off = e->in_off + (src ? offsetof(struct ipv6hdr, daddr) : offsetof(struct ipv6hdr, saddr));
	__u32 in_port_off = e->in_l4_off + (src ? offsetof(struct udphdr, dest) : offsetof(struct udphdr, source));
	const struct epx_in6 *out_addr = src ? &p->saddr : &p->daddr;
	__u32 out_addr_off = ETH_HLEN + (src ? offsetof(struct ipv6hdr, saddr) : offsetof(struct ipv6hdr, daddr));
	int udp = q->proto == IPPROTO_UDP;
	struct epx_in6 new_addr = *addr; /* a map entry's: read once */

	if (!in6_eq(in_addr, &new_addr) &&
	    csum_quoted_replace16(skb, in_addr_off, e->in_l4_csum, udp, e->csum_off, in_addr->w, new_addr.w))
		return EPX_DROP_NAT_FAILED;
	if (in_port != port &&
	    csum_quoted_replace(skb, in_port_off, e->in_l4_csum, udp, e->csum_off, in_port, port, sizeof(port)))
		return EPX_DROP_NAT_FAILED;
	if (!in6_eq(out_addr, &new_addr) && nat6_store_addr(skb, out_addr_off, e->csum_off, out_addr, &new_addr, 0))
		return EPX_DROP_NAT_FAILED;
	return EPX_ICMP_RELATED;
}

/* The quoted header's `side` (NAT4_SRC/NAT4_DST) port, `old`, becomes `port` (a remapped
 * connection's client port, CT4_S_REMAP: icmp4_err_quoted_port). Returns 0 or -1. */
static __always_inline int icmp6_err_quoted_port(struct __sk_buff *skb, const struct icmp6_err *e, __u8 proto, int side,
						 __be16 old, __be16 port)
{
	__u32 off = e->in_l4_off + (side == NAT4_SRC ? offsetof(struct udphdr, source) : offsetof(struct udphdr, dest));

	if (old == port)
		return 0;
	return csum_quoted_replace(skb, off, e->in_l4_csum, proto == IPPROTO_UDP, e->csum_off, old, port, sizeof(port));
}

/* Ingress: the error is about a packet toward a masquerade address (the backend's path answered
 * the masqueraded client), or about a reply the client's host refused (it names the frontend).
 * Uses s->key (the reversed quote) and s->owner. */
static __always_inline __u32 icmp6_err_ingress(struct __sk_buff *skb, struct scratch6 *s, const struct pkt6 *p,
					       const struct lb4_config *cfg, __u64 now)
{
	struct icmp6_err e = {};
	struct ct6_entry *half, *owner;
	__u32 reason = icmp6_err_parse(skb, p, &e, &s->key);

	if (reason)
		return reason;
	s->key.kind = CT4_REV_SNAT;
	if (nat6_is_masq_dest(cfg, p->cfg6, &s->key.daddr, s->key.dport) && (half = epx_lookup(epx_ct6, &s->key))) {
		owner = ct6_owner(s, &half->nat_addr, half->nat_port, half, s->key.proto, now, 1);
		if (nat6_rev_snat_owns(owner, &s->key))
			return icmp6_err_rewrite(skb, p, &e, &s->key, NAT4_DST, &half->nat_addr,
						 ct6_rev_snat_port(half, &s->key));
	}
	s->key.kind = CT4_SVC;
	owner = ct6_find_svc(&s->key, now);
	if (owner) {
		/* a remapped connection (CT4_S_REMAP): the quoted client is given the port the backend knows */
		if (icmp6_err_quoted_port(skb, &e, s->key.proto, NAT4_DST, s->key.sport, ct6_wire_port(owner, s->key.sport)))
			return EPX_DROP_NAT_FAILED;
		return icmp6_err_rewrite(skb, p, &e, &s->key, NAT4_DST, &owner->nat_addr, owner->nat_port);
	}
	return EPX_PASS_ICMP_NO_CT;
}

/* Egress: the error is about a client's packet (it quotes the backend as destination), or about
 * a reply going to a masqueraded backend (it quotes the client as destination). Uses s->key and
 * s->owner. */
static __always_inline __u32 icmp6_err_egress(struct __sk_buff *skb, struct scratch6 *s, const struct pkt6 *p,
					      __u64 now)
{
	struct icmp6_err e = {};
	struct ct6_entry *half, *owner;
	__u32 reason = icmp6_err_parse(skb, p, &e, &s->key);

	if (reason)
		return reason;
	/* forward SNAT first, as tc6_egress orders them */
	s->key.kind = CT4_SNAT;
	half = epx_lookup(epx_ct6, &s->key);
	if (half) {
		owner = ct6_owner(s, &s->key.saddr, ct6_snat_cport(half, &s->key), half, s->key.proto, now, 1);
		if (nat6_snat_owns(owner, half, &s->key))
			return icmp6_err_rewrite(skb, p, &e, &s->key, NAT4_SRC, &half->nat_addr, half->nat_port);
	}
	s->key.kind = CT4_REV_DNAT;
	half = epx_lookup(epx_ct6, &s->key);
	if (half) {
		__be16 cport = ct6_rev_dnat_cport(half, &s->key);

		owner = ct6_owner(s, &s->key.daddr, cport, half, s->key.proto, now, 1);
		if (ct6_rev_dnat_owns(owner, &s->key, cport)) {
			/* a remapped connection (CT4_S_REMAP): the quoted client gets its own port back */
			if (icmp6_err_quoted_port(skb, &e, s->key.proto, NAT4_SRC, s->key.dport, cport))
				return EPX_DROP_NAT_FAILED;
			return icmp6_err_rewrite(skb, p, &e, &s->key, NAT4_SRC, &half->nat_addr, half->nat_port);
		}
	}
	return EPX_PASS_ICMP_NO_CT;
}

#endif /* EPX_ICMP6_ERR_H */
