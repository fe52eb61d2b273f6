"""From every way a connection can go through the rules (iptables_walk's paths) to one Trace.

Paths differ only where the kernel picks at random or by session affinity, so they normally
agree on the verdict; they differ in the backend reached and, for a pod reaching itself through
its Service (hairpin), in masquerade, which the answer says in words. `reason` is kube-proxy's
own comment on the deciding rule ("default/web:http has no local endpoints"), and `service` the
"ns/name:port" those comments carry; the sentence spells out what the comment means.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import replace
from typing import TYPE_CHECKING

from ebpf_proxy.explain.iptables_rules import Rule
from ebpf_proxy.explain.packet import FlowSpec
from ebpf_proxy.explain.result import Step, Trace

if TYPE_CHECKING:
    from ebpf_proxy.explain.iptables_walk import WalkPath

_SERVICE_RE = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?/[a-z]([-a-z0-9]*[a-z0-9])?(:[-a-z0-9]+)?$")


def generic_comment(comment: str) -> bool:
    """kube-proxy's fixed plumbing comments ("kubernetes service portals", ...): they name no service."""
    return comment.startswith("kubernetes ")


_ORDER = ("dnat", "reject", "drop", "accept", "pass")
_ENTRY_CHAINS = ("KUBE-SERVICES", "KUBE-NODEPORTS")
_ENTRY_PREFIXES = ("KUBE-EXT-", "KUBE-FW-", "KUBE-XLB-")


def _verdict(p: WalkPath) -> str:
    return p.end or ("dnat" if p.dnat else "accept" if p.kube_accept else "pass")


def service_of(comment: str | None) -> str | None:
    """The "ns/name[:port]" a kube-proxy comment names ("default/web:http cluster IP" -> "default/web:http")."""
    for word in (comment or "").split():
        if _SERVICE_RE.match(word):
            return word
    return None


def summarise(paths: list[WalkPath], flow: FlowSpec, notes: Iterable[str] = ()) -> Trace:
    """One Trace for every way the connection can go: the verdict is the first of
    dnat, reject, drop, accept, pass that any path reaches (paths differ only where the kernel picks
    at random, so in practice they all agree; `details["verdicts"]` shows it when they do not)."""
    verdicts = [_verdict(p) for p in paths]
    verdict = next(v for v in _ORDER if v in verdicts)
    chosen = [p for p, v in zip(paths, verdicts) if v == verdict]
    first = chosen[0]
    service = next((s for p in chosen for r in p.rules if (s := service_of(r.comment))), None)
    backends = tuple(dict.fromkeys(p.dnat for p in chosen if p.dnat))
    masq = [p for p in chosen if p.snat]
    masquerade = verdict not in ("drop", "reject") and bool(masq)
    if verdict in ("drop", "reject"):
        source_after = None
    else:
        source_after = masq[0].snat if masquerade else flow.src
    details: dict = {"paths": len(paths), "notes": list(notes)}
    if len(set(verdicts)) > 1:
        details["verdicts"] = sorted(set(verdicts))
    story = ""
    reason = _reason(verdict, first, flow)
    if verdict == "dnat" and masquerade and len(masq) < len(chosen):
        only = sorted({p.dnat for p in masq if p.dnat})
        details["masqueradedVia"] = only
        story = (f"dnat{' ' + service if service else ''}: to one of {', '.join(sorted(backends))}; masqueraded "
                 f"only via {', '.join(only)} (a backend reaching itself: hairpin), else the backend sees {flow.src}")
    elif verdict in ("drop", "reject") and first.decider is not None:
        story = _why(verdict, service, reason, first.decider)
    trace = Trace("iptables", verdict, reason, service, backends, masquerade, source_after,
                  _steps(paths), story=story, details=details)
    if details["notes"]:  # e.g. a dump without its filter table: say what was not checked
        trace = replace(trace, story=f"{trace.sentence()} [{'; '.join(details['notes'])}]")
    return trace


def _reason(verdict: str, p: WalkPath, flow: FlowSpec) -> str:
    if verdict in ("drop", "reject", "accept"):
        if p.decider is None:
            return p.policy or "a chain's policy"
        said = p.decider.comment or p.decider.where
        if p.marked_by and any(m.kind == "mark" for m in p.decider.matches):
            said += f" (marked by: {p.marked_by})"  # e.g. kube-proxy < 1.22's KUBE-MARK-DROP
        return said
    if verdict == "dnat":
        said = [f"{r.comment} node port" if r.chain == "KUBE-NODEPORTS" and service_of(r.comment) == r.comment
                else r.comment for r in p.rules
                if r.comment and not generic_comment(r.comment) and r.table == "nat"
                and (r.chain in _ENTRY_CHAINS or r.chain.startswith(_ENTRY_PREFIXES))]
        said = list(dict.fromkeys(said))
        return "; ".join(said) if said else f"DNAT by {next(r for r in reversed(p.rules) if r.target == 'DNAT').where}"
    return f"no rule translates, drops or rejects {flow.dst}:{flow.dport}/{flow.protocol.lower}: not a service here"


def _why(verdict: str, service: str | None, reason: str, rule: Rule) -> str:
    """The drop/reject sentence, with what kube-proxy's comment means spelt out."""
    head = f"{verdict}{' ' + service if service else ''}: {reason}"
    if "has no local endpoints" in reason:
        policy = "internalTrafficPolicy" if rule.chain == "KUBE-SERVICES" else "externalTrafficPolicy"
        return f"{head} ({policy}: Local, and none of its ready endpoints runs on this node)"
    if "has no endpoints" in reason:
        return f"{head} (no ready endpoint anywhere: the client gets ICMP port unreachable)"
    return head


def _steps(paths: list[WalkPath]) -> tuple[Step, ...]:
    """Every chain entered, in order, hook by hook; where paths fork, each branch's chains follow
    the branch point (a chain visit identical in two paths is listed once)."""
    hooks = max((len(p.stages) for p in paths), default=0)
    out: list[Step] = []
    for h in range(hooks):
        seen: set[tuple[str, str, tuple[str, ...]]] = set()
        for p in paths:
            if h >= len(p.stages):
                continue
            end = p.stages[h + 1] if h + 1 < len(p.stages) else len(p.visits)
            for v in p.visits[p.stages[h]:end]:
                key = (v.hook, v.chain, v.actions)
                if key not in seen:
                    seen.add(key)
                    out.append(Step(v.hook, v.chain, "; ".join(v.actions) or "no rule matched: return", kind="chain"))
    return tuple(out)
