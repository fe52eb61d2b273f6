/* Trace mode (see common.h): recognise a trace run, and record what it decided in epx_trace.
 *
 * Every helper that may write state takes a `struct epx_trace_rec *tr`: NULL for a live packet,
 * the record for a trace run. The entry programs call their logic once with a literal NULL and
 * once with the record, and everything is always_inline, so the compiler folds every `if (tr)`
 * away in the live copy: the live path costs the one test of the signal, nothing more.
 *
 * trace_skb_requested  TC: mark and cb[0] carry the trace signal
 * trace_xdp_requested  XDP: data_meta holds a struct epx_trace_meta
 * trace_begin          the record of this CPU, cleared, with the caller's nonce and the hook
 * trace_skb_begin      trace_begin for a TC run: the nonce from cb[1], the device from the skb
 * trace_service        frontend matched: the service as the maps held it
 * trace_policy         lb4_policy's choice: origin, scope, masquerade
 * trace_backend        the backend chosen (or the one the connection table holds)
 * trace_backend6       the same for an IPv6 backend (EPX_TRACE_F_IPV6: backend_addr6)
 * trace_snat6          egress masquerade of an IPv6 connection (snat_addr6)
 */
#ifndef EPX_TRACE_H
#define EPX_TRACE_H

#include "lib/maps.h"

static __always_inline int trace_skb_requested(const struct __sk_buff *skb)
{
	return skb->mark == EPX_TRACE_MARK && skb->cb[0] == EPX_TRACE_MAGIC;
}

static __always_inline struct epx_trace_meta *trace_xdp_meta(const struct xdp_md *ctx)
{
	struct epx_trace_meta *meta = (void *)(long)ctx->data_meta;

	if ((void *)(meta + 1) > (void *)(long)ctx->data || meta->magic != EPX_TRACE_MAGIC)
		return NULL;
	return meta;
}

static __always_inline struct epx_trace_rec *trace_begin(__u32 nonce, __u8 hook)
{
	__u32 zero = 0;
	struct epx_trace_rec *tr = epx_lookup(epx_trace, &zero);

	if (!tr)
		return NULL;
	__builtin_memset(tr, 0, sizeof(*tr));
	tr->nonce = nonce;
	tr->hook = hook;
	return tr;
}

/* Both TC entries open a trace run the same way; one place keeps the nonce's slot (cb[1], see
 * common.h) and the recorded device from drifting apart between ingress and egress. */
static __always_inline struct epx_trace_rec *trace_skb_begin(const struct __sk_buff *skb, __u8 hook)
{
	struct epx_trace_rec *tr = trace_begin(skb->cb[1], hook);

	if (tr)
		tr->ifindex = skb->ifindex;
	return tr;
}

static __always_inline void trace_service(struct epx_trace_rec *tr, const struct lb4_service *svc)
{
	if (!tr)
		return;
	tr->flags |= EPX_TRACE_F_SERVICE;
	tr->svc_id = svc->id;
	tr->svc_flags = svc->flags;
	tr->svc_count = svc->count;
	tr->svc_local_count = svc->local_count;
}

static __always_inline void trace_policy(struct epx_trace_rec *tr, __u8 origin, __u8 scope, __u8 masq)
{
	if (!tr)
		return;
	tr->flags |= EPX_TRACE_F_POLICY;
	tr->origin = origin;
	tr->scope = scope;
	tr->masq = masq ? EPX_TRACE_MASQ_POLICY : 0;
}

static __always_inline void trace_backend(struct epx_trace_rec *tr, __u32 backend_id, __be32 addr, __be16 port)
{
	if (!tr)
		return;
	tr->flags |= EPX_TRACE_F_BACKEND;
	tr->backend_id = backend_id;
	tr->backend_addr = addr;
	tr->backend_port = port;
}

static __always_inline void trace_backend6(struct epx_trace_rec *tr, __u32 backend_id, const struct epx_in6 *addr,
					   __be16 port)
{
	if (!tr)
		return;
	tr->flags |= EPX_TRACE_F_BACKEND | EPX_TRACE_F_IPV6;
	tr->backend_id = backend_id;
	__builtin_memcpy(tr->backend_addr6, addr->w, sizeof(tr->backend_addr6));
	tr->backend_port = port;
}

static __always_inline void trace_snat6(struct epx_trace_rec *tr, const struct epx_in6 *addr, __be16 port)
{
	if (!tr)
		return;
	tr->flags |= EPX_TRACE_F_SNAT | EPX_TRACE_F_IPV6;
	__builtin_memcpy(tr->snat_addr6, addr->w, sizeof(tr->snat_addr6));
	tr->snat_port = port;
}

#endif /* EPX_TRACE_H */
