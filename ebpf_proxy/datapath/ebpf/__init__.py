"""datapath/ebpf: the eBPF datapath (`EbpfDatapath`), its programs' loader, maps and devices.

Importing it needs neither bcc nor root: bcc is imported only by the short-lived process that
compiles the programs (compile.py, started by the first sync when no pinned build fits), never by
the agent itself, so `--mode auto` and `ebpf-proxy cleanup` can import this on any machine.
"""

from ebpf_proxy.datapath.ebpf.datapath import EbpfDatapath

__all__ = ["EbpfDatapath"]
