/* IPv4 packet parsing shared by the TC and XDP programs: one parser, so both see the same facts.
 *
 * Malformed packets (bad version, IHL < 5, total length shorter than the header or longer than
 * the frame, TCP/UDP/SCTP header cut short, TCP data offset < 5) get a drop reason: the kernel would
 * drop them too, and nothing later has to second-guess a header. IP options are fine: the L4
 * header is found from the IHL.
 *
 * Fragments: the first fragment carries the ports; its (src, dst, IP id, proto) -> ports are
 * remembered in epx_frag4 so that later fragments, which carry no L4 header, get the same
 * translation of their addresses. A later fragment seen before its first one (reordering, or a
 * datagram that never had a first fragment here) cannot be matched to a connection and passes
 * untouched under EPX_PASS_FRAG_UNKNOWN.
 */
#ifndef EPX_PKT4_H
#define EPX_PKT4_H

#include "lib/maps.h"

#define EPX_FRAG_NONE 0
#define EPX_FRAG_FIRST 1
#define EPX_FRAG_LATER 2

#define EPX_IP_MF 0x2000
#define EPX_IP_OFFSET 0x1fff

#define EPX_TCP_FIN 0x01
#define EPX_TCP_SYN 0x02
#define EPX_TCP_RST 0x04
#define EPX_TCP_ACK 0x10

#include "lib/sctp.h" /* after EPX_IP_*: it reads them */

/* Linear bytes the programs read: Ethernet + the longest IP header + a TCP header. */
#define EPX_PULL_LEN (ETH_HLEN + EPX_MAX_IP_HLEN + sizeof(struct tcphdr))

struct pkt4 {
	__be32 saddr;
	__be32 daddr;
	__be16 sport;
	__be16 dport;
	__be16 ip_id;
	__u16 l4_off;   /* offset of the L4 header from the start of the frame */
	__u16 ip_hlen;  /* IHL * 4 */
	__u8 proto;
	__u8 frag;      /* EPX_FRAG_* */
	__u8 tcp_flags; /* TCP's flags; SCTP: its first chunk as the TCP flag that means the same to the
			 * connection table (pkt4_sctp_flags), so that one state machine serves both */
};

/* SCTP's first chunk in TCP's words: INIT opens an association (SYN); ABORT and SHUTDOWN
 * COMPLETE end it with nothing kept on either side (RST: its masquerade port is free at once).
 * Everything else (DATA, SACK, HEARTBEAT, the rest of the handshakes) is 0, an ordinary packet. */
static __always_inline __u8 pkt4_sctp_flags(__u8 chunk)
{
	if (chunk == SCTP4_CHUNK_INIT)
		return EPX_TCP_SYN;
	if (chunk == SCTP4_CHUNK_ABORT || chunk == SCTP4_CHUNK_SHUTDOWN_COMPLETE)
		return EPX_TCP_RST;
	return 0;
}

/* Fill `p` from a frame; `wire_len` is the whole frame's length (linear or not).
 * Returns 0 for a TCP/UDP/SCTP packet, else the epx_reason to count (a pass or a drop). */
static __always_inline __u32 pkt4_parse(void *data, void *data_end, __u32 wire_len, struct pkt4 *p)
{
	struct ethhdr *eth = data;
	struct iphdr *ip;
	void *l4;
	__u32 hlen, tot;
	__u16 frag_off;

	if ((void *)(eth + 1) > data_end || eth->h_proto != epx_htons(ETH_P_IP))
		return EPX_PASS_NOT_IPV4;
	ip = (void *)(eth + 1);
	if ((void *)(ip + 1) > data_end)
		return EPX_DROP_MALFORMED_IP;
	hlen = ip->ihl * 4;
	tot = epx_ntohs(ip->tot_len);
	if (ip->version != 4 || hlen < sizeof(struct iphdr) || tot < hlen || tot > wire_len - ETH_HLEN)
		return EPX_DROP_MALFORMED_IP;
	p->saddr = ip->saddr;
	p->daddr = ip->daddr;
	p->proto = ip->protocol;
	p->ip_id = ip->id;
	p->ip_hlen = hlen;
	p->l4_off = ETH_HLEN + hlen;
	if (p->proto != IPPROTO_TCP && p->proto != IPPROTO_UDP && p->proto != IPPROTO_SCTP)
		return EPX_PASS_NOT_L4;

	frag_off = epx_ntohs(ip->frag_off);
	if (frag_off & EPX_IP_OFFSET) {
		p->frag = EPX_FRAG_LATER; /* no L4 header: ports come from epx_frag4 */
		return 0;
	}
	p->frag = (frag_off & EPX_IP_MF) ? EPX_FRAG_FIRST : EPX_FRAG_NONE;

	l4 = (void *)ip + hlen;
	if (p->proto == IPPROTO_TCP) {
		struct tcphdr *tcp = l4;

		if ((void *)(tcp + 1) > data_end || tot < hlen + sizeof(*tcp) || tcp->doff < 5)
			return EPX_DROP_MALFORMED_L4;
		p->sport = tcp->source;
		p->dport = tcp->dest;
		p->tcp_flags = ((__u8 *)tcp)[13];
	} else if (p->proto == IPPROTO_SCTP) {
		struct sctp4_hdr *sctp = l4;
		__u8 *chunk = (void *)(sctp + 1);

		if ((void *)(sctp + 1) > data_end || tot < hlen + sizeof(*sctp))
			return EPX_DROP_MALFORMED_L4;
		p->sport = sctp->source;
		p->dport = sctp->dest;
		/* a packet without a chunk, or whose chunk lies past the pulled bytes, reads as DATA:
		 * nothing the connection table acts on */
		if ((void *)(chunk + 1) <= data_end && tot >= hlen + sizeof(*sctp) + 1)
			p->tcp_flags = pkt4_sctp_flags(*chunk);
	} else {
		struct udphdr *udp = l4;

		if ((void *)(udp + 1) > data_end || tot < hlen + sizeof(*udp))
			return EPX_DROP_MALFORMED_L4;
		p->sport = udp->source;
		p->dport = udp->dest;
	}
	return 0;
}

/* Remember a first fragment's ports, or recover a later fragment's. Returns 0 or
 * EPX_PASS_FRAG_UNKNOWN. */
static __always_inline __u32 pkt4_frag_ports(struct pkt4 *p)
{
	struct frag4_key key = { .saddr = p->saddr, .daddr = p->daddr, .id = p->ip_id, .proto = p->proto };
	struct frag4_ports *ports;

	if (p->frag == EPX_FRAG_FIRST) {
		struct frag4_ports val = { .sport = p->sport, .dport = p->dport };

		epx_update(epx_frag4, &key, &val);
		return 0;
	}
	if (p->frag != EPX_FRAG_LATER)
		return 0;
	ports = epx_lookup(epx_frag4, &key);
	if (!ports)
		return EPX_PASS_FRAG_UNKNOWN;
	p->sport = ports->sport;
	p->dport = ports->dport;
	return 0;
}

/* TC: make the headers linear (and writable), then parse. */
static __always_inline __u32 pkt4_parse_skb(struct __sk_buff *skb, struct pkt4 *p)
{
	__u32 len = skb->len < EPX_PULL_LEN ? skb->len : EPX_PULL_LEN;
	__u32 reason;

	if ((void *)(long)skb->data + len > (void *)(long)skb->data_end)
		bpf_skb_pull_data(skb, len); /* on failure the bounds checks below catch it */
	reason = pkt4_parse((void *)(long)skb->data, (void *)(long)skb->data_end, skb->len, p);
	if (reason)
		return reason;
	return pkt4_frag_ports(p);
}

#endif /* EPX_PKT4_H */
