"""Why did this packet go there? `trace`, `verify` and `audit`, over both datapaths.

Sits between the datapaths and the CLI (import-linter layers in pyproject.toml): it reads what a
datapath put in the kernel (pinned maps and programs, iptables rules) and what the API says (via
k8s/), and explains or compares; nothing below it imports it.

- result.py      the one answer shape (Trace, Step), its JSON and its one-line story
- packet.py      the packet a trace is about (FlowSpec): addresses, protocol, where it enters
- ebpf_trace.py  trace_ebpf: the eBPF datapath's answer, from its pinned programs run in trace mode
"""
