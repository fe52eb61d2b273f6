/* [::1]:<nodePort> of an externalTrafficPolicy=Local NodePort without a local endpoint: dropped on
 * the node's loopback device (tc_lo in tc_lb.c), as kube-proxy drops it.
 *
 * kube-proxy's IPv6 ruleset never DNATs [::1]:<nodePort> (localhost NodePorts are IPv4's: its
 * KUBE-NODEPORTS jump carries `! -d ::1/128`), so such a connection reaches the node's own stack.
 * For a Service with endpoints but none on this node and eTP=Local, the filter chain
 * KUBE-EXTERNAL-SERVICES (hooked in INPUT for ctstate NEW, which a packet crosses on `lo`) has
 * `-m addrtype --dst-type LOCAL --dport <nodePort> -j DROP` ("has no local endpoints"), which ::1
 * matches: the SYN (or the UDP datagram) vanishes and the client times out. Every other
 * [::1]:<nodePort> is refused by the kernel, in both modes (no endpoint at all: kube-proxy's REJECT;
 * eTP=Cluster, or a local endpoint: nothing listens).
 *
 * Why a packet program on `lo`, and not the socket LB (connect6/sendmsg6 see the call first):
 * kube-proxy's outcome is a silent drop, and a sock_addr program cannot give one. It can only fail
 * the call (EPERM/ECONNREFUSED: at once, not a timeout, and a UDP sendmsg must succeed) or rewrite
 * the destination, and the kernel has no address whose packets a local sender's route silently
 * discards (blackhole, unreachable and prohibit routes all fail connect()/sendmsg() with EINVAL,
 * EHOSTUNREACH, EACCES). Dropping the packet itself on lo's ingress is exactly kube-proxy's DROP
 * in INPUT: TCP retransmits its SYN until the client gives up, a datagram is lost, and the
 * decision is the one tc_ingress makes for such a NodePort from outside (lb6_policy with an
 * external origin: EPX_DROP_NO_LOCAL_EXTERNAL), over the same epx_svc6 entry.
 *
 * Cost: every packet on the node's lo runs tc_lo. A packet that is not IPv6 (all of IPv4's
 * loopback traffic) leaves after one test of skb->protocol; an IPv6 one costs a few reads, and
 * only a new TCP connection (SYN without ACK) or a UDP datagram to ::1 costs an epx_svc6 lookup.
 * Measured once (BPF_PROG_TEST_RUN, best of 5 x 200k runs, 2 cores; an empty SCHED_CLS program
 * takes 29 ns there): IPv4 27 ns and an IPv6 ACK 29 ns (nothing added), an IPv6 SYN to ::1 49 ns
 * (+20 ns, once per connection), the drop itself 58 ns.
 * Packets it lets through are not counted: lo carries the node's own traffic, not service traffic
 * (the socket LB already decided the node's calls to Services); its drops are, under
 * EPX_DROP_LOCALHOST6_NO_LOCAL. As kube-proxy's rule matches new connections only, a TCP packet
 * other than a SYN passes (an established connection to something listening there is left alone).
 * Not traced: `explain` runs the socket LB for the node's own calls, and leaves ::1 alone there.
 *
 * Where: the lo of the agent's network namespace (devices.py). On a production node that is the
 * host's own lo, which the product owns as it owns its other devices' filters; in the lab it is a
 * node namespace's lo, never the machine's.
 */
#ifndef EPX_LO6_H
#define EPX_LO6_H

#include "lib/lb6.h"
#include "lib/pkt6.h"

/* Linear bytes lo6_decide reads: Ethernet + IPv6 + TCP up to its flags byte. */
#define EPX_LO6_PULL_LEN (ETH_HLEN + EPX_IPV6_HLEN + 14)

/* EPX_DROP_LOCALHOST6_NO_LOCAL for a packet kube-proxy's filter rule drops, else EPX_CONTINUE.
 * Its own few reads, not pkt6_parse: the packets in question are the node's own, built by its
 * stack with TCP or UDP right after the IPv6 header (one carrying extension headers passes, as does
 * anything malformed, which the kernel's input checks then see); and pkt6_parse inlined alone here
 * was compiled into a form the verifier rejects (its bound checks merged into bitwise ORs). */
static __always_inline __u32 lo6_decide(struct __sk_buff *skb)
{
	struct lb6_key key = {};
	struct lb4_choice c = {};
	struct lb4_service *svc;
	struct lb4_config *cfg;
	const struct lb6_config *cfg6;
	struct ipv6hdr *ip6;
	struct epx_in6 saddr;
	void *data, *data_end;
	__u8 *l4;
	__u32 zero = 0, pull;

	if (skb->protocol != epx_htons(ETH_P_IPV6))
		return EPX_CONTINUE;
	cfg6 = pkt6_config();
	if (!pkt6_served(cfg6))
		return EPX_CONTINUE;
	pull = skb->len < EPX_LO6_PULL_LEN ? skb->len : EPX_LO6_PULL_LEN;
	if ((void *)(long)skb->data + pull > (void *)(long)skb->data_end)
		bpf_skb_pull_data(skb, pull); /* on failure the bounds checks below catch it */
	data = (void *)(long)skb->data;
	data_end = (void *)(long)skb->data_end;
	ip6 = data + ETH_HLEN;
	l4 = (__u8 *)(ip6 + 1);
	if ((void *)(l4 + 8) > data_end) /* the UDP header, or TCP's ports */
		return EPX_CONTINUE;
	if (ip6->daddr.in6_u.u6_addr32[0] || ip6->daddr.in6_u.u6_addr32[1] || ip6->daddr.in6_u.u6_addr32[2] ||
	    ip6->daddr.in6_u.u6_addr32[3] != epx_htonl(1))
		return EPX_CONTINUE;
	if (ip6->nexthdr == IPPROTO_TCP) {
		if ((void *)(l4 + 14) > data_end || (l4[13] & (EPX_TCP_SYN | EPX_TCP_ACK)) != EPX_TCP_SYN)
			return EPX_CONTINUE;
	} else if (ip6->nexthdr != IPPROTO_UDP) {
		return EPX_CONTINUE;
	}
	/* the NodePort key (any of this node's addresses, as lb6_lookup_service): TCP and UDP have
	 * their destination port at the same offset */
	key.port = *(__be16 *)(l4 + 2);
	key.proto = ip6->nexthdr;
	__builtin_memcpy(&saddr, &ip6->saddr, sizeof(saddr));
	svc = epx_lookup(epx_svc6, &key);
	cfg = epx_lookup(epx_config, &zero);
	if (!svc || !cfg)
		return EPX_CONTINUE;
	if (lb6_policy(svc, &saddr, EPX_ORIGIN_EXTERNAL, lb6_flags(cfg, cfg6), &c) != EPX_DROP_NO_LOCAL_EXTERNAL)
		return EPX_CONTINUE;
	return EPX_DROP_LOCALHOST6_NO_LOCAL;
}

#endif /* EPX_LO6_H */
