/* Per-CPU counters: every packet a program looks at is counted under exactly one epx_reason;
 * the EPX_EV_* slots count events (an eviction), not packets. */
#ifndef EPX_STATS_H
#define EPX_STATS_H

#include "lib/maps.h"

static __always_inline int epx_is_drop(__u32 reason)
{
	return (reason >= EPX_DROP_FIRST && reason <= EPX_DROP_LAST) || reason == EPX_DROP_CT_FULL ||
	       reason == EPX_DROP_HANDOVER_HELD || reason == EPX_DROP_MALFORMED_IPV6 || reason == EPX_DROP_IPV6_EXTHDRS ||
	       reason == EPX_DROP_SCTP_FRAG || reason == EPX_DROP_LOCALHOST6_NO_LOCAL;
}

static __always_inline void stats_count(__u32 reason, __u32 bytes)
{
	struct epx_stat *s = epx_lookup(epx_stats, &reason);

	if (s) { /* per-CPU slot: no atomics needed */
		s->packets++;
		s->bytes += bytes;
	}
}

#endif /* EPX_STATS_H */
