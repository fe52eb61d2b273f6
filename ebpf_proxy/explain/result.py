"""What a trace answers, in one shape for both datapaths, with its JSON and its story.

The JSON is a stable interface (issue "Explain every packet"), exactly:
  {"datapath": "ebpf"|"iptables", "verdict": "dnat"|"drop"|"reject"|"pass"|"accept",
   "reason": str, "service": "ns/name:portName"|null, "backends": ["ip:port", ...],
   "masquerade": bool, "sourceAfter": "ip"|null,
   "steps": [{"hook": str, "program"|"chain": str, "action": str}]}
`backends` is every backend this packet could reach (the whole set the decision chose among),
sorted, an IPv6 one as "[ip]:port"; `sourceAfter` is the source address the backend sees (null when nothing reaches one).
"""

from __future__ import annotations

import ipaddress
import json
from dataclasses import dataclass, field
from typing import Any

from ebpf_proxy.explain.packet import split_host_port

DATAPATHS = ("ebpf", "iptables")
VERDICTS = ("dnat", "drop", "reject", "pass", "accept")


@dataclass(frozen=True)
class Step:
    """One hook the packet met: `hook` is where (xdp, tc-ingress, PREROUTING, ...), `unit` the
    program or chain that ran there, `action` what it did, in words."""

    hook: str
    unit: str
    action: str
    kind: str = "program"  # "program" (ebpf) or "chain" (iptables): the JSON key of `unit`

    def to_json(self) -> dict[str, str]:
        return {"hook": self.hook, self.kind: self.unit, "action": self.action}


@dataclass(frozen=True)
class Trace:
    datapath: str
    verdict: str
    reason: str
    service: str | None = None
    backends: tuple[str, ...] = ()
    masquerade: bool = False
    source_after: str | None = None
    steps: tuple[Step, ...] = ()
    story: str = ""  # the human sentence; "" means: make one from the fields
    details: dict[str, Any] = field(default_factory=dict, compare=False)  # extra facts for the story

    def __post_init__(self) -> None:
        if self.datapath not in DATAPATHS:
            raise ValueError(f"datapath {self.datapath!r} is not one of {DATAPATHS}")
        if self.verdict not in VERDICTS:
            raise ValueError(f"verdict {self.verdict!r} is not one of {VERDICTS}")
        object.__setattr__(self, "backends", tuple(sorted(set(self.backends), key=_addr_key)))

    def to_json(self) -> dict[str, Any]:
        return {
            "datapath": self.datapath,
            "verdict": self.verdict,
            "reason": self.reason,
            "service": self.service,
            "backends": list(self.backends),
            "masquerade": self.masquerade,
            "sourceAfter": self.source_after,
            "steps": [s.to_json() for s in self.steps],
        }

    def dumps(self) -> str:
        return json.dumps(self.to_json())

    def sentence(self) -> str:
        """One line a person reads first: what happened and which field decided it."""
        if self.story:
            return self.story
        svc = f" {self.service}" if self.service else ""
        if self.verdict == "dnat":
            seen = "the node's address (masqueraded)" if self.masquerade else "the client's address"
            return (f"dnat{svc}: to one of {', '.join(self.backends)}; the backend sees {seen}"
                    + (f" ({self.source_after})" if self.source_after else ""))
        return f"{self.verdict}{svc}: {self.reason}"

    def render(self) -> str:
        """The human form: the sentence, then one line per step."""
        lines = [f"[{self.datapath}] {self.sentence()}"]
        for s in self.steps:
            lines.append(f"  {s.hook:<14} {s.unit:<28} {s.action}")
        return "\n".join(lines)


def _addr_key(addr: str) -> tuple[int, int, int]:
    """Sort key of "ip:port" / "[ipv6]:port": IPv4 first, then by address and port."""
    host, port = split_host_port(addr)
    ip = ipaddress.ip_address(host)
    return ip.version, int(ip), int(port or 0)
