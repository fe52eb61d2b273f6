"""datapath/ebpf: the eBPF datapath (`EbpfDatapath`), its programs' loader, maps and devices.

Importing it needs neither bcc nor root: bcc is imported when the first sync compiles the
programs, so `--mode auto` and `ebpf-proxy cleanup` can import this on any machine.
"""

from ebpf_proxy.datapath.ebpf.datapath import EbpfDatapath

__all__ = ["EbpfDatapath"]
