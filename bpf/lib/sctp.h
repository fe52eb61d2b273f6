/* SCTP: its common header, and the CRC32c update a port rewrite needs.
 *
 * SCTP (RFC 9260, formerly RFC 4960) starts every packet with a 12-byte common header: source
 * port, destination port (at the offsets of TCP's and UDP's), verification tag, checksum. The
 * checksum is CRC32c (Castagnoli, RFC 3309; RFC 4960 appendix B) over the whole SCTP packet
 * with the checksum field taken as zero. There is no pseudo-header: an address rewrite leaves it
 * alone, a port rewrite does not. It is not a one's-complement sum, so bpf_l4_csum_replace cannot
 * update it; but a CRC is linear over GF(2), which makes an update just as cheap:
 *
 *   For messages of equal length, crc(M ^ D) = crc(M) ^ crc_raw(D), where crc_raw is the CRC
 *   without its initial value and final xor (they are the same affine constants on both sides
 *   and cancel). A port rewrite is D = d0 d1 d2 d3 0 0 ... 0 (L bytes in all, L the SCTP
 *   length): the four port bytes xored old ^ new, then zeros. In CRC32c's reflected
 *   representation (bit 31 of a word is the coefficient of x^0, the first bit on the wire
 *   the highest power), crc_raw of a message m(x) is m(x) * x^32 mod P, and D(x) is
 *   d(x) * x^(8 (L - 4)), so
 *       crc_raw(D) = d(x) * x^(8 L) mod P
 *   with d the four bytes read as a little-endian word. x^(8 L) mod P is a product of the
 *   constants x^(2^(k+3)) mod P for the bits k set in L (square-and-multiply over a table of
 *   16 of them, since L < 2^16), each product a 32-step shift-and-xor. Constant time, no loop
 *   over the payload, which the program need not even have in linear memory.
 *
 * Byte order: the kernel (sctp_compute_cksum) stores cpu_to_le32(~crc), the standard CRC32c
 * value little-endian, as scapy does; so the field read as a little-endian word is the CRC, and
 * the update xors the delta into it byte by byte from its lowest byte.
 *
 * Offloaded CRCs (what nf_nat's sctp_manip_pkt does: recompute the CRC unless the skb is
 * CHECKSUM_PARTIAL). An SCTP stack that leaves its CRC to the device (veths and most NICs have
 * NETIF_F_SCTP_CRC; GSO packets always do) writes 0 in the field and marks the skb
 * CHECKSUM_PARTIAL with csum_not_inet; the device, or skb_crc32c_csum_help on the way out of one
 * without the offload, computes the CRC over the packet as it then is, including the field's
 * current content. So the field must stay 0 there, and the rewritten ports are then simply
 * covered. BPF cannot read skb->ip_summed; a field that is 0 is what such a packet carries, and
 * is left as it is. A fully computed CRC32c that happens to be 0 (one packet in 2^32) keeps
 * its stale value and is dropped by the receiver, as a corrupted packet; the other way round
 * (xoring a delta into a pending CRC) would corrupt every offloaded packet.
 *
 * A CRC of an invalid packet stays invalid (the delta carries the error along): its receiver
 * drops it, as conntrack would have tracked it as INVALID and left it untranslated.
 *
 * Fragments: the CRC covers the whole datagram, whose length L a first fragment does not tell;
 * a port rewrite of one is refused (EPX_DROP_SCTP_FRAG; conntrack reassembles first, which BPF
 * cannot). SCTP fragments its messages into chunks itself and avoids IP fragmentation (it
 * follows the path MTU), so such packets are rare. An address-only rewrite does not touch the
 * CRC and works for fragments as for UDP.
 */
#ifndef EPX_SCTP_H
#define EPX_SCTP_H

#include <uapi/linux/ipv6.h>
#include "lib/common.h"

/* The furthest an IPv6 packet's SCTP header may start (pkt6.h walks no further: its
 * EPX_PULL6_LEN less a TCP header) */
#define SCTP_L4_OFF6_MAX (ETH_HLEN + 40 + EPX_IPV6_MAX_EXTLEN)

/* The common header (include/linux/sctp.h's struct sctphdr, which is not UAPI). */
struct sctp4_hdr {
	__be16 source;
	__be16 dest;
	__be32 vtag;
	__le32 checksum; /* CRC32c, little-endian (see above) */
};

/* Chunk types (RFC 9260 section 3.2) the connection table looks at: the first chunk of a
 * packet. INIT starts an association, ABORT and SHUTDOWN COMPLETE end it on both sides. */
#define SCTP4_CHUNK_INIT 1
#define SCTP4_CHUNK_ABORT 6
#define SCTP4_CHUNK_SHUTDOWN_COMPLETE 14

#define SCTP4_CRC32C_POLY 0x82f63b78u /* x^32 mod P, reflected: Castagnoli's polynomial */

/* a * b mod P in the reflected representation (zlib's multmodp for CRC32c): for each power of x
 * in a, from x^0 (bit 31) up, add b, then multiply b by x. Branch-free: the verifier walks it
 * once whatever the values. */
static __always_inline __u32 sctp4_crc32c_mul(__u32 a, __u32 b)
{
	__u32 p = 0;

	for (int i = 0; i < 32; i++) {
		p ^= b & -((a >> (31 - i)) & 1);
		b = (b >> 1) ^ (SCTP4_CRC32C_POLY & -(b & 1));
	}
	return p;
}

/* Multiply p by x^(2^(k+3)) mod P (the constant c) when bit k of len is set. The 16 constants
 * are x^8, x^16, x^32 = P, then each the square of the one before; tests/bpf/test_tc_sctp.py
 * recomputes them from the polynomial and compares them with this file. */
#define SCTP4_X8POW_STEP(k, c)                                                                                         \
	if (len & (1u << (k)))                                                                                         \
	p = sctp4_crc32c_mul(p, c)

/* x^(8 len) mod P, len < 2^16: square-and-multiply over the table. */
static __always_inline __u32 sctp4_crc32c_x8pow(__u32 len)
{
	__u32 p = 0x80000000u; /* x^0 */

	SCTP4_X8POW_STEP(0, 0x00800000u);
	SCTP4_X8POW_STEP(1, 0x00008000u);
	SCTP4_X8POW_STEP(2, 0x82f63b78u);
	SCTP4_X8POW_STEP(3, 0x6ea2d55cu);
	SCTP4_X8POW_STEP(4, 0x18b8ea18u);
	SCTP4_X8POW_STEP(5, 0x510ac59au);
	SCTP4_X8POW_STEP(6, 0xb82be955u);
	SCTP4_X8POW_STEP(7, 0xb8fdb1e7u);
	SCTP4_X8POW_STEP(8, 0x88e56f72u);
	SCTP4_X8POW_STEP(9, 0x74c360a4u);
	SCTP4_X8POW_STEP(10, 0xe4172b16u);
	SCTP4_X8POW_STEP(11, 0x0d65762au);
	SCTP4_X8POW_STEP(12, 0x35d73a62u);
	SCTP4_X8POW_STEP(13, 0x28461564u);
	SCTP4_X8POW_STEP(14, 0xbf455269u);
	SCTP4_X8POW_STEP(15, 0xe2ea32dcu);
	return p;
}

/* The four port bytes of an SCTP header (source, destination, in wire order) as the
 * little-endian word the CRC math reads them as (see above): wire byte i is bits 8i..8i+7. */
static __always_inline __u32 sctp4_ports_word(__be16 sport, __be16 dport)
{
	__u16 s = epx_ntohs(sport), d = epx_ntohs(dport); /* host order: the first byte on the wire is the high one */

	return (__u32)(s >> 8) | ((__u32)(s & 0xff) << 8) | ((__u32)(d >> 8) << 16) | ((__u32)(d & 0xff) << 24);
}

/* Update the CRC32c of the SCTP packet in `skb` whose ports were `ports_before`
 * (sctp4_ports_word) when it was parsed, unless they did not change, or the field is 0 (a CRC
 * still to be computed, see above). Family-free, as the CRC is: an IPv4 packet's SCTP header
 * follows its IP header; an IPv6 packet's lies at `l4_off6` from the frame's start (past its
 * extension headers, which the parser walked: pkt6.h), 0 when the parser found no SCTP there
 * or the packet is no longer it (a REJECT turned it into an ICMPv6 error: tc6.h).
 * Everything else is read from the packet as it is now: this runs after the translations, where
 * nothing of them is left on tc_ingress's 512-byte stack, which is full (tc_lb.c: tc_sctp_done).
 * Not SCTP (any more: a REJECT turned it into ICMP or ICMPv6) or a later fragment: nothing to
 * do. Returns 0, or -1 when the header cannot be read.
 *
 * Direct packet access, no helper buffers. The headers are linear and writable (pkt4_parse_skb
 * and pkt6_parse_skb pulled them; the rewrites since keep them so). A CHECKSUM_COMPLETE skb's csum
 * is kept right with bpf_csum_update: unlike TCP's and UDP's, this change is not cancelled out by
 * a checksum field of the one's-complement kind. */
static __always_inline int sctp_crc_update(struct __sk_buff *skb, __u32 ports_before, __u32 l4_off6)
{
	void *data = (void *)(long)skb->data, *data_end = (void *)(long)skb->data_end;
	struct ethhdr *eth = data;
	struct sctp4_hdr *sctp;
	__u32 off, len, d, old, crc, sum;

	if ((void *)(eth + 1) > data_end)
		return 0;
	if (eth->h_proto == epx_htons(ETH_P_IP)) {
		struct iphdr *ip = (void *)(eth + 1);

		if ((void *)(ip + 1) > data_end || ip->protocol != IPPROTO_SCTP ||
		    (ip->frag_off & epx_htons(EPX_IP_OFFSET)))
			return 0;
		off = ETH_HLEN + ip->ihl * 4;
		len = epx_ntohs(ip->tot_len) + ETH_HLEN - off; /* the SCTP length: IP total length - IP header */
	} else if (eth->h_proto == epx_htons(ETH_P_IPV6) && l4_off6) {
		struct ipv6hdr *ip6 = (void *)(eth + 1);

		if ((void *)(ip6 + 1) > data_end)
			return 0;
		off = l4_off6;
		len = ETH_HLEN + sizeof(*ip6) + epx_ntohs(ip6->payload_len);
		if (off > SCTP_L4_OFF6_MAX || off > len)
			return -1;
		len -= off;
	} else {
		return 0;
	}
	sctp = data + off;
	if ((void *)(sctp + 1) > data_end)
		return -1;
	d = ports_before ^ sctp4_ports_word(sctp->source, sctp->dest);
	old = sctp->checksum; /* the wire bytes as a native word */
	if (!d || !old)
		return 0; /* ports unchanged, or the CRC is pending (offloaded): computed later over the new ports */
	/* crc_raw of the change: d * x^(8 L), L = the SCTP length */
	crc = epx_le32_to_cpu(old) ^ sctp4_crc32c_mul(d, sctp4_crc32c_x8pow(len));
	sctp->checksum = epx_cpu_to_le32(crc);
	/* the one's-complement difference of the two words, for skb->csum: csum_add(~old, new) */
	sum = ~old + sctp->checksum;
	sum += sum < sctp->checksum;
	bpf_csum_update(skb, sum);
	return 0;
}

#endif /* EPX_SCTP_H */
