"""Why did this packet go there? `trace`, `verify` and `audit`, over both datapaths.

Sits between the datapaths and the CLI (import-linter layers in pyproject.toml): it reads what a
datapath put in the kernel (pinned maps and programs, iptables rules) and what the API says (via
k8s/), and explains or compares; nothing below it imports it.

- result.py      the one answer shape (Trace, Step), its JSON and its one-line story
- packet.py      the packet a trace is about (FlowSpec): addresses, protocol, where it enters
- iptables_rules.py  iptables rules as data: iptables-save text (legacy or nft) or our Ruleset
- iptables_walk.py   a new connection walked through those rules hook by hook, every branch
- iptables_answer.py those branches summed up as one Trace (verdict, reason, backends, steps)
- iptables_live.py   the node's live rules (right backend), addresses and masquerade address
- ebpf_trace.py  trace_ebpf: the eBPF datapath's answer, from its pinned programs run in trace mode
- expect.py        the model's statement of a flow's outcome (verify's third opinion)
- verify.py        every frontend x sender of a node, put to the model and to each tracer
- state.py         a node's desired state from listed API objects, as its agent builds it
- audit.py         drift of the kernel from the last sync (Drift, AuditReport); picks one of:
- audit_iptables.py  iptables-save against the applied ruleset, in one canonical spelling
- audit_ebpf.py    the maps and devices against the service entries and node facts last written
                   (the service maps first summed: datapath/ebpf/digest.py)
"""
