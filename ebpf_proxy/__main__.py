"""`python -m ebpf_proxy` is the same CLI as `ebpf-proxy` (the lab starts agents this way)."""

from ebpf_proxy.cli import main

main()
