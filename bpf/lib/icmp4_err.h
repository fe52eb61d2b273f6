/* ICMP errors about translated connections: what conntrack's "related" NAT does for kube-proxy.
 *
 * An ICMP error (destination unreachable incl. fragmentation needed, time exceeded, parameter
 * problem, source quench, redirect: the kernel's icmp_is_err set) quotes the IP header and the
 * first bytes of the packet it is about. If that packet belongs to a connection we translate,
 * the error must be translated too, or the host it reaches finds no socket for the quoted tuple
 * and ignores it: a TCP client then never learns the path MTU and its large segments stall.
 *
 * The quoted packet travelled the other way: a packet with the *reverse* of the quoted tuple is
 * what this hook would translate (the error "is a reply" to the quoted packet). So the error gets
 * exactly that packet's translation, looked up read-only in the same halves (nat4.h's *_owns
 * predicates), and applied as nf_nat_icmp_reply_translation applies it:
 *   - the outer header's side the packet path rewrites (source on egress, destination on ingress)
 *     becomes the new address, whoever sent the error (a router's address becomes the frontend,
 *     as with conntrack);
 *   - the quoted header's other side becomes the new address and port;
 *   - checksums: outer IP; quoted IP; the quoted L4 checksum when the quote holds it (UDP: when
 *     not 0; TCP: only when the quote holds a whole TCP header, the kernel's own rule; SCTP:
 *     never, see below), and the
 *     ICMP checksum for every quoted byte changed. The ICMP checksum is updated incrementally:
 *     the kernel recomputes it, which is the same result for a valid error; an invalid one stays
 *     invalid and its receiver drops it (conntrack would not have translated it either).
 *
 * Where it applies (the lookups are those of nat4.h / lb4.h for the reversed tuple):
 *   ingress  quoted (masq addr:port -> backend)  CT4_REV_SNAT: outer dst and quoted src = client
 *            quoted (frontend -> client)         CT4_SVC:      outer dst and quoted src = backend
 *   egress   quoted (client -> backend)          CT4_REV_DNAT: outer src and quoted dst = frontend
 *            quoted (backend -> client)          CT4_SNAT:     outer src and quoted dst = masq addr:port
 * The first and third are errors about the client's packets (from a router on the backend's path,
 * from the backend, or from this node's own forwarding after tc_ingress translated the packet:
 * those egress toward the client); the second and fourth errors the client's host sends about
 * replies. An error changes no connection state (conntrack does not refresh a connection for a
 * related packet), so a trace run takes the same path.
 *
 * SCTP's quoted CRC32c is left as it is. The SCTP receiving the error (sctp_v4_err) finds its
 * association by the quoted ports and verification tag and never checks the quoted CRC, which a
 * truncated quote could not match anyway; conntrack (sctp_manip_pkt) rewrites it only when the
 * quote holds the whole 12-byte header, with a CRC32c of the truncated quote, as meaningless.
 *
 * Untouched and counted: errors quoting no such connection (EPX_PASS_ICMP_NO_CT: also a later
 * fragment, or a protocol other than TCP/UDP/SCTP, quoted), errors whose quote is cut short or not
 * IPv4 (EPX_PASS_ICMP_MALFORMED), fragmented errors and ICMP that is not an error (PASS_NOT_L4).
 * The IPv6 twin (icmp6_err.h) has the same shape and shares csum.h's csum_quoted_replace; its
 * ICMPv6 checksum also covers a pseudo-header (the outer addresses), and there is no quoted IP
 * header checksum to fix.
 */
#ifndef EPX_ICMP4_ERR_H
#define EPX_ICMP4_ERR_H

#include "lib/csum.h"
#include "lib/nat4.h"

/* Where the quoted packet lies, and what it says. */
struct icmp4_err {
	__u32 csum_off;    /* the ICMP checksum */
	__u32 in_off;      /* the quoted IP header */
	__u32 in_l4_off;   /* the quoted L4 header */
	__u32 in_l4_csum;  /* the quoted L4 checksum, 0: not rewritten (not quoted, or UDP's "none") */
	__be32 saddr;      /* quoted addresses and ports */
	__be32 daddr;
	__be16 sport;
	__be16 dport;
	__u8 proto;
};

/* The ICMP types whose message quotes an offending packet (the kernel's icmp_is_err). */
static __always_inline int icmp4_is_err(__u8 type)
{
	return type == ICMP_DEST_UNREACH || type == ICMP_SOURCE_QUENCH || type == ICMP_REDIRECT ||
	       type == ICMP_TIME_EXCEEDED || type == ICMP_PARAMETERPROB;
}

/* Parse the ICMP error of `p` (pkt4_parse said PASS_NOT_L4, protocol ICMP) into `e`.
 * Returns 0, or the reason to pass it untouched. */
static __always_inline __u32 icmp4_err_parse(struct __sk_buff *skb, const struct pkt4 *p, struct icmp4_err *e)
{
	struct iphdr outer, in;
	struct icmphdr icmp;
	__be16 ports[4];
	__u32 end, in_hlen;

	if (bpf_skb_load_bytes(skb, ETH_HLEN, &outer, sizeof(outer)))
		return EPX_PASS_NOT_L4;
	if (outer.frag_off & epx_htons(EPX_IP_MF | EPX_IP_OFFSET))
		return EPX_PASS_NOT_L4; /* a fragment: conntrack would see it reassembled, we do not */
	end = ETH_HLEN + epx_ntohs(outer.tot_len); /* the frame may carry padding past it */
	if (p->l4_off + sizeof(icmp) > end || bpf_skb_load_bytes(skb, p->l4_off, &icmp, sizeof(icmp)))
		return EPX_PASS_NOT_L4;
	if (!icmp4_is_err(icmp.type))
		return EPX_PASS_NOT_L4;

	e->csum_off = p->l4_off + offsetof(struct icmphdr, checksum);
	e->in_off = p->l4_off + sizeof(icmp);
	if (e->in_off + sizeof(in) > end || bpf_skb_load_bytes(skb, e->in_off, &in, sizeof(in)))
		return EPX_PASS_ICMP_MALFORMED;
	in_hlen = in.ihl * 4;
	if (in.version != 4 || in_hlen < sizeof(in))
		return EPX_PASS_ICMP_MALFORMED;
	if (in.protocol != IPPROTO_TCP && in.protocol != IPPROTO_UDP && in.protocol != IPPROTO_SCTP)
		return EPX_PASS_ICMP_NO_CT; /* we translate no other protocol */
	if (in.frag_off & epx_htons(EPX_IP_OFFSET))
		return EPX_PASS_ICMP_NO_CT; /* a later fragment quotes no ports */
	e->in_l4_off = e->in_off + in_hlen;
	/* RFC 792: the quote holds at least 8 bytes of the L4 header, the ports and (UDP) checksum */
	if (e->in_l4_off + sizeof(ports) > end || bpf_skb_load_bytes(skb, e->in_l4_off, ports, sizeof(ports)))
		return EPX_PASS_ICMP_MALFORMED;
	e->saddr = in.saddr;
	e->daddr = in.daddr;
	e->sport = ports[0];
	e->dport = ports[1];
	e->proto = in.protocol;
	e->in_l4_csum = 0; /* SCTP: its CRC32c stays (see above) */
	if (in.protocol == IPPROTO_UDP && ports[3])
		e->in_l4_csum = e->in_l4_off + offsetof(struct udphdr, check);
	else if (in.protocol == IPPROTO_TCP && e->in_l4_off + sizeof(struct tcphdr) <= end)
		e->in_l4_csum = e->in_l4_off + offsetof(struct tcphdr, check);
	return 0;
}

/* Apply the translation "the packet side `side` (NAT4_SRC/NAT4_DST) becomes addr:port" to the
 * error: the outer `side`, the quoted other side. Returns EPX_ICMP_RELATED or EPX_DROP_NAT_FAILED
 * (the packet may be half-written: conntrack drops it then too). */
static __always_inline __u32 icmp4_err_rewrite(struct __sk_buff *skb, const struct pkt4 *p, const struct icmp4_err *e,
					       int side, __be32 addr, __be16 port)
{
	/* the quoted header's side opposite to `side` */
	__be32 in_addr = side == NAT4_SRC ? e->daddr : e->saddr;
	__be16 in_port = side == NAT4_SRC ? e->dport : e->sport;
	__u32 in_addr_off = e->in_off + (side == NAT4_SRC ? offsetof(struct iphdr, daddr) : offsetof(struct iphdr, saddr));
	__u32 in_port_off = e->in_l4_off + (side == NAT4_SRC ? offsetof(struct udphdr, dest) : offsetof(struct udphdr, source));
	__be32 out_addr = side == NAT4_SRC ? p->saddr : p->daddr;
	__u32 out_addr_off = ETH_HLEN + (side == NAT4_SRC ? offsetof(struct iphdr, saddr) : offsetof(struct iphdr, daddr));
	__u32 in_check = e->in_off + offsetof(struct iphdr, check);
	__sum16 old_check, new_check;

	if (in_addr != addr) {
		/* quoted IP header checksum first, then the address with the L4 pseudo-header */
		if (bpf_skb_load_bytes(skb, in_check, &old_check, sizeof(old_check)) ||
		    bpf_l3_csum_replace(skb, in_check, in_addr, addr, sizeof(addr)) ||
		    bpf_skb_load_bytes(skb, in_check, &new_check, sizeof(new_check)) ||
		    bpf_l3_csum_replace(skb, e->csum_off, old_check, new_check, sizeof(new_check)) ||
		    csum_quoted_replace(skb, in_addr_off, e->in_l4_csum, e->proto == IPPROTO_UDP, e->csum_off, in_addr, addr,
					sizeof(addr)))
			return EPX_DROP_NAT_FAILED;
	}
	if (in_port != port && csum_quoted_replace(skb, in_port_off, e->in_l4_csum, e->proto == IPPROTO_UDP, e->csum_off,
						   in_port, port, sizeof(port)))
		return EPX_DROP_NAT_FAILED;
	if (out_addr != addr) {
		if (bpf_l3_csum_replace(skb, ETH_HLEN + offsetof(struct iphdr, check), out_addr, addr, sizeof(addr)) ||
		    bpf_skb_store_bytes(skb, out_addr_off, &addr, sizeof(addr), 0))
			return EPX_DROP_NAT_FAILED;
	}
	return EPX_ICMP_RELATED;
}

/* The quoted header's `side` (NAT4_SRC/NAT4_DST) port, `old`, becomes `port` (a remapped
 * connection's client port, CT4_S_REMAP; the other rewrites are icmp4_err_rewrite's). Returns 0
 * or -1. */
static __always_inline int icmp4_err_quoted_port(struct __sk_buff *skb, const struct icmp4_err *e, int side, __be16 old,
						 __be16 port)
{
	__u32 off = e->in_l4_off + (side == NAT4_SRC ? offsetof(struct udphdr, source) : offsetof(struct udphdr, dest));

	if (old == port)
		return 0;
	return csum_quoted_replace(skb, off, e->in_l4_csum, e->proto == IPPROTO_UDP, e->csum_off, old, port, sizeof(port));
}

/* Ingress: the error is about a packet toward a masquerade address (the backend's path answered
 * the masqueraded client), or about a reply the client's host refused (it names the frontend). */
static __always_inline __u32 icmp4_err_ingress(struct __sk_buff *skb, const struct pkt4 *p, const struct lb4_config *cfg,
					       __u64 now)
{
	struct icmp4_err e = {};
	struct ct4_key key;
	struct ct4_entry *half, *owner;
	__u32 reason = icmp4_err_parse(skb, p, &e);

	if (reason)
		return reason;
	/* the reversed quote: the packet this error answers as a reply */
	key = ct4_key_make(e.daddr, e.saddr, e.dport, e.sport, e.proto, CT4_REV_SNAT);
	if (nat4_is_masq_dest(cfg, key.daddr, key.dport) && (half = epx_lookup(epx_ct4, &key))) {
		owner = ct4_owner(half->nat_addr, half->nat_port, half, e.proto, now, 1);
		if (nat4_rev_snat_owns(owner, &key))
			return icmp4_err_rewrite(skb, p, &e, NAT4_DST, half->nat_addr, ct4_rev_snat_port(half, &key));
	}
	key.kind = CT4_SVC;
	owner = ct4_find_svc(&key, now);
	if (owner) {
		/* a remapped connection (CT4_S_REMAP): the quoted client is given the port the backend knows */
		if (icmp4_err_quoted_port(skb, &e, NAT4_DST, e.dport, ct4_wire_port(owner, e.dport)))
			return EPX_DROP_NAT_FAILED;
		return icmp4_err_rewrite(skb, p, &e, NAT4_DST, owner->nat_addr, owner->nat_port);
	}
	return EPX_PASS_ICMP_NO_CT;
}

/* Egress: the error is about a client's packet (it quotes the backend as destination), or about
 * a reply going to a masqueraded backend (it quotes the client as destination). */
static __always_inline __u32 icmp4_err_egress(struct __sk_buff *skb, const struct pkt4 *p, __u64 now)
{
	struct icmp4_err e = {};
	struct ct4_key key;
	struct ct4_entry *half, *owner;
	__u32 reason = icmp4_err_parse(skb, p, &e);

	if (reason)
		return reason;
	/* forward SNAT first, as tc_egress orders them */
	key = ct4_key_make(e.daddr, e.saddr, e.dport, e.sport, e.proto, CT4_SNAT);
	half = epx_lookup(epx_ct4, &key);
	if (half) {
		owner = ct4_owner(key.saddr, ct4_snat_cport(half, &key), half, e.proto, now, 1);
		if (nat4_snat_owns(owner, half, &key))
			return icmp4_err_rewrite(skb, p, &e, NAT4_SRC, half->nat_addr, half->nat_port);
	}
	key.kind = CT4_REV_DNAT;
	half = epx_lookup(epx_ct4, &key);
	if (half) {
		__be16 cport = ct4_rev_dnat_cport(half, &key);

		owner = ct4_owner(key.daddr, cport, half, e.proto, now, 1);
		if (ct4_rev_dnat_owns(owner, &key, cport)) {
			/* a remapped connection (CT4_S_REMAP): the quoted client gets its own port back */
			if (icmp4_err_quoted_port(skb, &e, NAT4_SRC, e.sport, cport))
				return EPX_DROP_NAT_FAILED;
			return icmp4_err_rewrite(skb, p, &e, NAT4_SRC, half->nat_addr, half->nat_port);
		}
	}
	return EPX_PASS_ICMP_NO_CT;
}

#endif /* EPX_ICMP4_ERR_H */
