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

#endif /* EPX_CSUM_H */
