"""ebpf-proxy: a Kubernetes service proxy with kube-proxy's semantics and an eBPF datapath."""

__version__ = "0.1.0"
