"""Drift audit: does the kernel still hold what the datapath last programmed?

Between syncs something else can change the kernel: an operator's `iptables -F`, another
agent's `bpftool map delete`, a CNI that flushes tc filters, a restore that half-failed outside
our knowledge. kube-proxy only finds out at its next full sync (hourly); until then packets
follow rules nobody wrote. The audit compares, entry by entry, what the kernel holds with what
the datapath believes it wrote at its last sync (never with the API server's newer state: what
changed since is the next sync's business, not drift), names every difference, and can repair
exactly those differences without a full sync.

One `Drift` per differing object: `kind` is missing (ours, gone), extra (in our chains or maps,
written by nobody we know) or stale (there, but not what we wrote); `what` names the object type
("service frontend", "iptables rule", ...), `key` the object, `detail` the difference.
The per-datapath comparisons live in audit_ebpf.py and audit_iptables.py; `audit()` picks one.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

MISSING = "missing"
EXTRA = "extra"
STALE = "stale"
KINDS = (MISSING, EXTRA, STALE)


@dataclass(frozen=True, order=True)
class Drift:
    kind: str  # MISSING, EXTRA or STALE
    what: str  # the object type: "service frontend", "backend", "iptables rule", ...
    key: str  # which one: "10.96.0.10:53/udp", "nat KUBE-SERVICES rule 3", ...
    detail: str = ""  # the difference, in words: "slot 1 holds backend 7, not 9"

    def __str__(self) -> str:
        return f"{self.kind} {self.what} {self.key}" + (f": {self.detail}" if self.detail else "")


@dataclass
class AuditReport:
    """What one audit found (and, with repair, what it wrote back)."""

    mode: str
    checked: dict[str, int] = field(default_factory=dict)  # objects compared, by type
    drifts: list[Drift] = field(default_factory=list)
    repaired: bool = False
    writes: int = 0  # kernel writes the repair made

    @property
    def clean(self) -> bool:
        return not self.drifts

    def counts(self) -> dict[str, int]:
        """Drifts by kind (every kind present, zero included: a gauge per kind)."""
        out = dict.fromkeys(KINDS, 0)
        for d in self.drifts:
            out[d.kind] += 1
        return out

    def to_json(self) -> dict[str, Any]:
        return {"mode": self.mode, "clean": self.clean, "checked": dict(self.checked),
                "counts": self.counts(), "drifts": [asdict(d) for d in self.drifts],
                "repaired": self.repaired, "writes": self.writes}

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> AuditReport:
        return cls(mode=doc["mode"], checked=dict(doc.get("checked", {})),
                   drifts=[Drift(**d) for d in doc.get("drifts", [])],
                   repaired=bool(doc.get("repaired")), writes=int(doc.get("writes", 0)))

    def lines(self) -> list[str]:
        """The report for a terminal: one line per drift, then a summary."""
        out = [str(d) for d in self.drifts]
        checked = ", ".join(f"{n} {what}" for what, n in sorted(self.checked.items()))
        if self.clean:
            out.append(f"{self.mode}: no drift ({checked} checked)")
        else:
            c = self.counts()
            out.append(f"{self.mode}: {len(self.drifts)} drifted ({c[MISSING]} missing, {c[EXTRA]} extra, "
                       f"{c[STALE]} stale; {checked} checked)")
            if self.repaired:
                out.append(f"repaired with {self.writes} writes")
        return out


class AuditUnavailable(RuntimeError):
    """The datapath has nothing to compare yet (no sync has completed) or cannot be read."""


def merge(reports: list[tuple[int, AuditReport]]) -> AuditReport:
    """One report for a node's family datapaths, primary first: the secondary family's objects
    and drifts named with its family ("IPv6 iptables rule"), so a dual-stack node's audit says
    which family drifted. One report is returned as it is."""
    if len(reports) == 1:
        return reports[0][1]
    merged = AuditReport(mode=" + ".join(f"{r.mode} (IPv{family})" for family, r in reports))
    for i, (family, report) in enumerate(reports):
        prefix = "" if i == 0 else f"IPv{family} "
        for what, n in report.checked.items():
            merged.checked[prefix + what] = merged.checked.get(prefix + what, 0) + n
        merged.drifts += [Drift(d.kind, prefix + d.what, d.key, d.detail) for d in report.drifts]
        merged.repaired = merged.repaired or report.repaired
        merged.writes += report.writes
    return merged


def audit(datapath: object, repair: bool = False, memo: dict | None = None) -> AuditReport:
    """Audit `datapath` (an EbpfDatapath or IptablesDatapath after a sync), repairing with `repair`;
    `memo` is a dict the caller keeps between audits of one datapath, to skip what was proven.

    The caller must keep syncs out meanwhile (the agent holds its datapath lock). Chosen by the
    datapath's mode, so an iptables node never imports the eBPF side."""
    mode = getattr(datapath, "mode", "")
    if mode == "ebpf":
        from ebpf_proxy.explain import audit_ebpf  # noqa: PLC0415

        return audit_ebpf.audit(datapath, repair)  # type: ignore[arg-type]
    if mode == "iptables":
        from ebpf_proxy.explain import audit_iptables  # noqa: PLC0415

        return audit_iptables.audit(datapath, repair, memo)  # type: ignore[arg-type]
    raise AuditUnavailable(f"datapath {type(datapath).__name__} (mode {mode!r}): no drift audit for this mode")
