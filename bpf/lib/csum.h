/* Checksum helpers for in-place rewrites (see PLATFORM.md pitfall 1).
 *
 * An address is part of the L4 pseudo-header: BPF_F_PSEUDO_HDR tells the kernel so, which also
 * keeps CHECKSUM_PARTIAL skbs (offloaded: the field holds only the pseudo-header sum) right.
 * A UDP checksum of 0 means "none" and must stay 0: BPF_F_MARK_MANGLED_0.
 */
#ifndef EPX_CSUM_H
#define EPX_CSUM_H

#include "lib/common.h"

static __always_inline __u32 csum_l4_offset(__u8 proto)
{
	return proto == IPPROTO_TCP ? offsetof(struct tcphdr, check) : offsetof(struct udphdr, check);
}

static __always_inline __u64 csum_l4_flags(__u8 proto)
{
	return proto == IPPROTO_UDP ? BPF_F_MARK_MANGLED_0 : 0;
}

/* Fold a 32-bit one's-complement partial sum (bpf_csum_diff's result) into a 16-bit checksum. */
static __always_inline __sum16 csum_fold(__u32 csum)
{
	csum = (csum & 0xffff) + (csum >> 16);
	csum = (csum & 0xffff) + (csum >> 16);
	return (__sum16)~csum;
}

/* Replace the 2- or 4-byte field at `off` inside a quoted packet (an ICMP or ICMPv6 error's
 * quote; old value `from`, new `to`, a __be16 zero-extended) and keep both checksums around it
 * right: the quoted L4 checksum at `quoted_csum` that covers the field (0: none, or not quoted;
 * for an address it is its pseudo-header that covers it, the same one's-complement sum), which
 * `mangled0` (UDP) keeps from becoming 0 ("no checksum"), and the message's own checksum at
 * `msg_csum`, which covers both. All of it is payload to the skb: plain field updates
 * (bpf_l3_csum_replace), no pseudo-header or CHECKSUM_PARTIAL bookkeeping. Returns 0 or -1. */
static __always_inline int csum_quoted_replace(struct __sk_buff *skb, __u32 off, __u32 quoted_csum, int mangled0,
					       __u32 msg_csum, __be32 from, __be32 to, __u32 size)
{
	__sum16 old_csum, new_csum;
	__be16 to16 = (__be16)to;

	if (quoted_csum) {
		if (bpf_skb_load_bytes(skb, quoted_csum, &old_csum, sizeof(old_csum)) ||
		    bpf_l3_csum_replace(skb, quoted_csum, from, to, size) ||
		    bpf_skb_load_bytes(skb, quoted_csum, &new_csum, sizeof(new_csum)))
			return -1;
		if (!new_csum && mangled0) {
			new_csum = (__sum16)0xffff; /* the kernel's CSUM_MANGLED_0; the same one's-complement value */
			if (bpf_skb_store_bytes(skb, quoted_csum, &new_csum, sizeof(new_csum), 0))
				return -1;
		}
		if (bpf_l3_csum_replace(skb, msg_csum, old_csum, new_csum, sizeof(new_csum)))
			return -1;
	}
	if (bpf_l3_csum_replace(skb, msg_csum, from, to, size))
		return -1;
	if (size == sizeof(__be32))
		return bpf_skb_store_bytes(skb, off, &to, sizeof(to), 0) ? -1 : 0;
	return bpf_skb_store_bytes(skb, off, &to16, sizeof(to16), 0) ? -1 : 0;
}

#endif /* EPX_CSUM_H */
