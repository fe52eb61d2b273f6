/* ARP requests that would announce a loopback address (tc_egress).
 *
 * A node socket bound to 127.0.0.1 that the socket LB sent to a backend (127.0.0.1:<nodePort>,
 * rule 8) leaves with its loopback source until tc_egress masquerades it. When the next hop's
 * neighbour entry is not resolved yet, the kernel's ARP request for it takes the queued packet's
 * source as its sender address, i.e. 127.0.0.1, which no neighbour answers (127/8 is martian on
 * the wire); with kube-proxy the source is already masqueraded when the request is made. Such a
 * request gets the masquerade address as sender instead, which is what arp_announce=2 would pick.
 */
#ifndef EPX_ARP4_H
#define EPX_ARP4_H

#include "lib/maps.h"
#include "lib/sock4.h"

#define EPX_ARPHRD_ETHER 1
#define EPX_ARPOP_REQUEST 1
/* sender protocol address: Ethernet header + ARP fixed header (8) + sender hardware address (6) */
#define EPX_ARP_SPA_OFF (ETH_HLEN + 8 + ETH_ALEN)

struct epx_arp_eth_ipv4 {
	__be16 htype;
	__be16 ptype;
	__u8 hlen;
	__u8 plen;
	__be16 op;
	__u8 sha[ETH_ALEN];
	__be32 spa;
} __attribute__((packed));

/* Returns EPX_ARP_MASQ when the sender address was rewritten, else 0. */
static __always_inline __u32 arp4_masq_loopback_sender(struct __sk_buff *skb, const struct lb4_config *cfg)
{
	void *data = (void *)(long)skb->data, *data_end = (void *)(long)skb->data_end;
	struct ethhdr *eth = data;
	struct epx_arp_eth_ipv4 *arp = (void *)(eth + 1);
	__be32 spa;

	if ((void *)(arp + 1) > data_end || eth->h_proto != epx_htons(ETH_P_ARP))
		return 0;
	if (arp->htype != epx_htons(EPX_ARPHRD_ETHER) || arp->ptype != epx_htons(ETH_P_IP) || arp->hlen != ETH_ALEN ||
	    arp->plen != 4 || arp->op != epx_htons(EPX_ARPOP_REQUEST))
		return 0;
	spa = arp->spa;
	if (!epx_is_loopback(spa) || !cfg->snat_addr)
		return 0;
	if (bpf_skb_store_bytes(skb, EPX_ARP_SPA_OFF, &cfg->snat_addr, sizeof(cfg->snat_addr), 0))
		return 0;
	return EPX_ARP_MASQ;
}

#endif /* EPX_ARP4_H */
