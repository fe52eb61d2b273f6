"""kube-proxy's iptables mode: the fallback datapath and the reference the eBPF mode is compared against."""

from ebpf_proxy.datapath.iptables.apply import IptablesError, RestoreError
from ebpf_proxy.datapath.iptables.datapath import IptablesDatapath
from ebpf_proxy.datapath.iptables.render import render

__all__ = ["IptablesDatapath", "IptablesError", "RestoreError", "render"]
