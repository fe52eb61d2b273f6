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

/* Keep both checksums around a field of a quoted packet right (an ICMP or ICMPv6 error's quote)
 * for its change from `from` to `to`: the quoted L4 checksum at `quoted_csum` that covers the
 * field (0: none, or not quoted; for an address it is its pseudo-header that covers it, the same
 * one's-complement sum), which `mangled0` (UDP) keeps from becoming 0 ("no checksum"), and the
 * message's own checksum at `msg_csum`, which covers both. `size` is 2 or 4 (`from`/`to` the old
 * and new value, a __be16 zero-extended), or 0 for a wider field: `to` is then the difference
 * bpf_csum_diff gave and `from` 0 (an IPv6 address, csum_quoted_replace16). All of it is payload
 * to the skb: plain field updates (bpf_l3_csum_replace), no pseudo-header or CHECKSUM_PARTIAL
 * bookkeeping. The field itself is not written. Returns 0 or -1. */
static __always_inline int csum_quoted_update(struct __sk_buff *skb, __u32 quoted_csum, int mangled0, __u32 msg_csum,
					      __be32 from, __be32 to, __u32 size)
{
	__sum16 old_csum, new_csum;

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
	return bpf_l3_csum_replace(skb, msg_csum, from, to, size) ? -1 : 0;
}

/* Replace the 2- or 4-byte field at `off` inside a quoted packet (old value `from`, new `to`, a
 * __be16 zero-extended) with both checksums around it (csum_quoted_update). Returns 0 or -1. */
static __always_inline int csum_quoted_replace(struct __sk_buff *skb, __u32 off, __u32 quoted_csum, int mangled0,
					       __u32 msg_csum, __be32 from, __be32 to, __u32 size)
{
	__be16 to16 = (__be16)to;

	if (csum_quoted_update(skb, quoted_csum, mangled0, msg_csum, from, to, size))
		return -1;
	if (size == sizeof(__be32))
		return bpf_skb_store_bytes(skb, off, &to, sizeof(to), 0) ? -1 : 0;
	return bpf_skb_store_bytes(skb, off, &to16, sizeof(to16), 0) ? -1 : 0;
}

/* Replace the 16-byte field at `off` inside a quoted packet (an IPv6 address: four __be32 words,
 * old `from`, new `to`) with both checksums around it (csum_quoted_update). Returns 0 or -1. */
static __always_inline int csum_quoted_replace16(struct __sk_buff *skb, __u32 off, __u32 quoted_csum, int mangled0,
						 __u32 msg_csum, const __be32 *from, const __be32 *to)
{
	__s64 diff = bpf_csum_diff((__be32 *)from, 16, (__be32 *)to, 16, 0);

	if (diff < 0 || csum_quoted_update(skb, quoted_csum, mangled0, msg_csum, 0, (__be32)diff, 0))
		return -1;
	return bpf_skb_store_bytes(skb, off, (void *)to, 16, 0) ? -1 : 0;
}

#endif /* EPX_CSUM_H */
