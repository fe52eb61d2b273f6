"""Walk one new connection through a node's iptables rules, the way the kernel would, and explain it.

The hooks, in the kernel's order for kube-proxy's chains:
  from a pod or from outside   nat PREROUTING, then the routing decision on the (maybe DNATed)
                               destination: filter INPUT if it is a local address, else filter
                               FORWARD and nat POSTROUTING
  from the node itself         nat OUTPUT, filter OUTPUT, nat POSTROUTING, and filter INPUT when
                               the destination is local (the packet loops back through lo)

Where the kernel would pick at random (`-m statistic`) or by memory (`-m recent --rcheck`, session
affinity), the walk takes every branch: the answer is "one of N", and `backends` lists every DNAT
target a new connection can reach. The connection is NEW: conntrack's state is NEW, plus DNAT
once a destination was translated. Unknown matches and targets are errors naming the rule,
never silently taken as matching: an explanation that guessed would be worse than none.

Masquerade is not inferred from KUBE-MARK-MASQ: the walk runs nat POSTROUTING, so it is exactly
what KUBE-POSTROUTING does with the mark (and any other SNAT/MASQUERADE rule on the node).
"""

from __future__ import annotations

import functools
import ipaddress
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from ebpf_proxy.explain.iptables_answer import generic_comment, summarise
from ebpf_proxy.explain.iptables_rules import Chain, Match, Rule, Tables
from ebpf_proxy.explain.packet import FlowSpec, host_port, is_loopback, split_host_port
from ebpf_proxy.explain.result import Trace

MAX_DEPTH = 64  # chain nesting; deeper means a loop
MAX_PATHS = 4096  # forks multiply; far more than any service has endpoints x affinity branches
_PROTO_NUMBERS = {"6": "tcp", "17": "udp", "132": "sctp"}


class WalkError(ValueError):
    """The walk cannot decide; the message names the rule (table, chain, position, text) at fault."""


@dataclass(frozen=True)
class NodeFacts:
    """What the rules alone do not say about the node.

    `local_ips`: its addresses (`-m addrtype LOCAL`; 127.0.0.0/8 and ::1 are always local). `masquerade_ip`:
    the source MASQUERADE picks (the primary address of the default-route device). `route_dev`:
    the device a destination is routed out of, for `-o` matches (None: `-o` cannot be decided).
    """

    local_ips: frozenset[str] = frozenset()
    masquerade_ip: str | None = None
    route_dev: Callable[[str], str | None] | None = None

    def is_local(self, ip: str) -> bool:
        return ip in self.local_ips or is_loopback(ip)


@dataclass(frozen=True)
class Visit:
    hook: str
    chain: str
    actions: tuple[str, ...] = ()


@dataclass(frozen=True)
class WalkPath:
    """One way the connection can go (forks copy it)."""

    src: str
    dst: str
    dport: int
    mark: int = 0
    dnat: str | None = None  # "ip:port" once DNATed
    snat: str | None = None  # the source after SNAT/MASQUERADE
    end: str | None = None  # drop | reject: the connection stops here
    decider: Rule | None = None  # the rule that dropped/rejected/accepted it
    kube_accept: Rule | None = None  # an ACCEPT in one of kube-proxy's chains (e.g. a health-check port)
    policy: str | None = None  # "filter FORWARD policy DROP" when a chain's policy dropped it
    marked_by: str | None = None  # the comment of the rule that led to the last MARK (KUBE-MARK-DROP's caller)
    rules: tuple[Rule, ...] = ()  # every rule whose condition matched, in order
    visits: tuple[Visit, ...] = ()
    stages: tuple[int, ...] = ()  # index in `visits` where each hook starts

    def act(self, at: int, action: str) -> WalkPath:
        v = self.visits[at]
        return replace(self, visits=(*self.visits[:at], replace(v, actions=(*v.actions, action)), *self.visits[at + 1:]))


@dataclass
class _Walker:
    tables: Tables
    flow: FlowSpec
    node: NodeFacts
    forks: int = 0
    notes: list[str] = field(default_factory=list)

    # ---- the hooks -----------------------------------------------------------------------------
    def walk(self) -> list[WalkPath]:
        start = WalkPath(src=self.flow.src, dst=self.flow.dst, dport=self.flow.dport)
        if self.flow.origin == "host":
            paths = self.hook("nat", "OUTPUT", [start])
            paths = self.hook("filter", "OUTPUT", paths)
            paths = self.hook("nat", "POSTROUTING", paths)
            # a local destination loops back through lo: filter INPUT (nat PREROUTING is not
            # consulted again, the connection's NAT was decided in OUTPUT)
            return [q for p in paths
                    for q in (self.hook("filter", "INPUT", [p]) if self.node.is_local(p.dst) else [p])]
        out: list[WalkPath] = []
        for p in self.hook("nat", "PREROUTING", [start]):
            if self.node.is_local(p.dst):
                out += self.hook("filter", "INPUT", [p])
            else:
                out += self.hook("nat", "POSTROUTING", self.hook("filter", "FORWARD", [p]))
        return out

    def hook(self, table: str, hook: str, paths: list[WalkPath]) -> list[WalkPath]:
        """Run the built-in chain `hook` of `table` on every path still going; fall-through meets its policy."""
        chain = self.tables.chain(table, hook)
        if chain is None:
            if not self.tables.has_table(table):
                note = f"the rules hold no {table} table: {table} {hook} was not checked"
                if note not in self.notes:
                    self.notes.append(note)
            return paths
        label = "filter OUTPUT" if (table, hook) == ("filter", "OUTPUT") else hook
        out = []
        for p in paths:
            if p.end:
                out.append(p)
                continue
            p = replace(p, stages=(*p.stages, len(p.visits)))
            for q, how in self.run(chain, label, p, 0):
                if how == "return":
                    policy = chain.policy or "ACCEPT"
                    q = q.act(p.stages[-1], f"policy {policy}")
                    if policy == "DROP":
                        q = replace(q, end="drop", decider=None, policy=f"{table} {hook} policy DROP")
                out.append(q)
        return out

    # ---- one chain -----------------------------------------------------------------------------
    def run(self, chain: Chain, hook: str, p: WalkPath, depth: int) -> list[tuple[WalkPath, str]]:
        """Enter `chain`; every way out as (path, how), how: return, accept, drop, reject, dnat, snat."""
        if depth > MAX_DEPTH:
            raise WalkError(f"{chain.name}: chains nested more than {MAX_DEPTH} deep (a jump loop?)")
        at = len(p.visits)
        p = replace(p, visits=(*p.visits, Visit(hook, chain.name)))
        out: list[tuple[WalkPath, str]] = []
        work = [(p, 0)]
        while work:
            p, i = work.pop()
            while True:
                if i >= len(chain.rules):
                    out.append((p, "return"))
                    break
                rule = chain.rules[i]
                verdict = self.matches(rule, p, hook)
                if verdict is False:
                    i += 1
                    continue
                if verdict == "fork":  # the kernel may or may not take this rule: walk both
                    self._fork()
                    work.append((p, i + 1))
                p = replace(p, rules=(*p.rules, rule))
                going = []
                for q, how in self.target(chain, hook, rule, p, at, depth):
                    if how == "continue":
                        going.append(q)
                    else:
                        out.append((q, how))
                if not going:
                    break
                p, i = going[0], i + 1
                work.extend((q, i) for q in reversed(going[1:]))
        return out

    def _fork(self) -> None:
        self.forks += 1
        if self.forks > MAX_PATHS:
            raise WalkError(f"more than {MAX_PATHS} ways through the rules: giving up (kube-proxy's rules never fork "
                            "this much)")

    # ---- targets ----------------------------------------------------------------------------------
    def target(self, chain: Chain, hook: str, rule: Rule, p: WalkPath, at: int, depth: int) -> list[tuple[WalkPath, str]]:
        """The ways out of a matched rule; how == "continue": go on with the next rule of this chain."""
        t = rule.target
        if t is None:  # no target: the rule only counts; its comment may still say something
            return [(p.act(at, f"(no target){_quoted(rule)}") if rule.comment else p, "continue")]
        sub = self.tables.chain(rule.table, t)
        if sub is not None and sub.policy is None:
            verb = "goto" if rule.goto else "jump"
            p = p.act(at, f"{verb} {t}{_branch_label(chain, rule)}{_quoted(rule)}")
            return [(q, "return" if how == "return" and rule.goto else "continue" if how == "return" else how)
                    for q, how in self.run(sub, hook, p, depth + 1)]
        if t == "RETURN":
            return [(p.act(at, "RETURN" + _quoted(rule)), "return")]
        if t == "ACCEPT":
            kube = rule.chain.startswith("KUBE-")
            p = replace(p, decider=rule, kube_accept=rule if kube else p.kube_accept)
            return [(p.act(at, "ACCEPT" + _quoted(rule)), "accept")]
        if t in ("DROP", "REJECT"):
            p = replace(p, end=t.lower(), decider=rule)
            return [(p.act(at, t + _quoted(rule)), t.lower())]
        if t == "DNAT":
            return [self._dnat(rule, p, at)]
        if t in ("MASQUERADE", "SNAT"):
            return [self._snat(rule, p, at)]
        if t == "MARK":
            mark = _apply_mark(rule, p.mark)
            why = next((r.comment for r in reversed(p.rules) if r.comment and not generic_comment(r.comment)), None)
            return [(replace(p, mark=mark, marked_by=why).act(at, f"MARK {p.mark:#x} → {mark:#x}"), "continue")]
        if t in ("LOG", "NFLOG"):
            return [(p, "continue")]
        if sub is not None:
            raise WalkError(f"{rule.where}: jumps to the built-in chain {t}")
        raise WalkError(f"{rule.where}: target {t} is neither a chain of the {rule.table} table nor a target "
                        "the walk knows (ACCEPT, DROP, REJECT, RETURN, DNAT, SNAT, MASQUERADE, MARK, LOG)")

    def _dnat(self, rule: Rule, p: WalkPath, at: int) -> tuple[WalkPath, str]:
        if rule.table != "nat":
            raise WalkError(f"{rule.where}: DNAT outside the nat table")
        to = rule.target_args.get("--to-destination")
        if not to:
            raise WalkError(f"{rule.where}: DNAT without --to-destination")
        host, port = split_host_port(to)
        if "-" in to or not self._of_flow_family(host) or (port is not None and not port.isdigit()):
            raise WalkError(f"{rule.where}: DNAT --to-destination {to}: only one IPv{self.flow.family} "
                            f"address[:port] is supported")
        dport = int(port) if port else p.dport
        dest = host_port(host, dport)
        return replace(p, dst=host, dport=dport, dnat=dest).act(at, f"DNAT to {dest}"), "dnat"

    def _snat(self, rule: Rule, p: WalkPath, at: int) -> tuple[WalkPath, str]:
        if rule.target == "MASQUERADE":
            addr = self.node.masquerade_ip
            if addr is None:
                raise WalkError(f"{rule.where}: MASQUERADE, but the node's masquerade address was not given")
            text = f"MASQUERADE to {addr}"
        else:
            to = rule.target_args.get("--to-source") or ""
            addr = split_host_port(to)[0]
            if not self._of_flow_family(addr):
                raise WalkError(f"{rule.where}: SNAT --to-source {to!r}: only one IPv{self.flow.family} address "
                                "is supported")
            text = f"SNAT to {to}"
        return replace(p, snat=addr).act(at, text + _quoted(rule)), "snat"

    def _of_flow_family(self, text: str) -> bool:
        try:
            return ipaddress.ip_address(text).version == self.flow.family
        except ValueError:
            return False

    # ---- matches ------------------------------------------------------------------------------------
    def matches(self, rule: Rule, p: WalkPath, hook: str):
        """True, False, or "fork" (the kernel decides at random or by memory: both can happen)."""
        fork = False
        for m in rule.matches:
            got = self._one(rule, m, p, hook)
            if got == "fork":
                fork = True
            elif got == m.negate:
                return False
        return "fork" if fork else True

    def _in_dev(self, hook: str) -> str | None:
        if self.flow.origin == "host":
            return "lo" if hook == "INPUT" else ""  # "": generated here, no input device
        return self.flow.in_iface

    def _one(self, rule: Rule, m: Match, p: WalkPath, hook: str):
        """The match's own truth (before its `!`), or "fork"."""
        k, v = m.kind, m.value
        if k in ("src", "dst"):
            return _in_networks(p.src if k == "src" else p.dst, v, rule)
        if k == "proto":
            return v in ("all", "0") or _PROTO_NUMBERS.get(v, v) == self.flow.protocol.lower
        if k in ("dport", "sport", "dports", "sports", "ports"):
            ports = {"dport": (p.dport,), "dports": (p.dport,), "sport": (self.flow.sport,),
                     "sports": (self.flow.sport,), "ports": (p.dport, self.flow.sport)}[k]
            return any(_port_in(port, v, rule) for port in ports)
        if k in ("src-type", "dst-type"):
            types = {t.upper() for t in v.split(",")}
            if types != {"LOCAL"}:
                raise WalkError(f"{rule.where}: addrtype {v}: only LOCAL (what kube-proxy uses) is supported")
            return self.node.is_local(p.src if k == "src-type" else p.dst)
        if k == "mark":
            value, _, mask = v.partition("/")
            try:
                return p.mark & (int(mask, 0) if mask else 0xFFFFFFFF) == int(value, 0)
            except ValueError:
                raise WalkError(f"{rule.where}: --mark {v} is not a number[/mask]") from None
        if k == "ctstate":  # a new connection: NEW, and DNAT once its destination was translated
            states = {"NEW"} | ({"DNAT"} if p.dnat else set()) | ({"SNAT"} if p.snat else set())
            return bool(states & {s.strip().upper() for s in v.split(",")})
        if k == "statistic":
            return "fork"
        if k == "recent":
            return "fork" if v in ("rcheck", "update") else True
        if k == "in":
            dev = self._in_dev(hook)
            if dev is None:
                raise WalkError(f"{rule.where}: matches the input device (-i {v}), but the flow does not say "
                                "which device it enters through (give --in-iface)")
            return _iface(dev, v)
        if k == "out":
            dev = self.node.route_dev(p.dst) if self.node.route_dev else None
            if dev is None:
                raise WalkError(f"{rule.where}: matches the output device (-o {v}), but the route to {p.dst} "
                                "is not known")
            return _iface(dev, v)
        raise WalkError(f"{rule.where}: cannot evaluate {v} (the walk knows -s -d -p -i -o and the matches tcp, "
                        "udp, sctp, multiport, addrtype, mark, statistic, recent, conntrack, state, comment, nfacct)")


def walk(tables: Tables, flow: FlowSpec, node: NodeFacts) -> Trace:
    """Every way `flow` (a new connection) can go through `tables` on `node`, as one Trace."""
    w = _Walker(tables, flow, node)
    return summarise(w.walk(), flow, w.notes)


def _branch_label(chain: Chain, rule: Rule) -> str:
    """" (k of N)" on the jumps of a random spread; " (session affinity)" on `--rcheck` jumps."""
    if any(m.kind == "recent" and m.value in ("rcheck", "update") for m in rule.matches):
        return " (session affinity)"
    spread = [r for r in chain.rules if any(m.kind == "statistic" for m in r.matches)]
    if not spread:
        return ""
    n = len(spread) + 1
    if rule in spread:
        return f" ({spread.index(rule) + 1} of {n})"
    rest = [r for r in chain.rules[chain.rules.index(spread[-1]) + 1:] if r.target]
    return f" ({n} of {n})" if rest and rest[0] is rule else ""



@functools.lru_cache(maxsize=4096)
def _network(text: str) -> ipaddress.IPv4Network | ipaddress.IPv6Network:
    return ipaddress.ip_network(text, strict=False)




def _quoted(rule: Rule) -> str:
    """The rule's comment for a step, unless it is one of the fixed "kubernetes ..." plumbing comments
    (the chain names say as much)."""
    return f' "{rule.comment}"' if rule.comment and not generic_comment(rule.comment) else ""


def _in_networks(ip: str, value: str, rule: Rule) -> bool:
    addr = ipaddress.ip_address(ip)
    for part in value.split(","):
        try:
            net = _network(part)
        except ValueError:
            raise WalkError(f"{rule.where}: {part!r} is not an address or CIDR") from None
        if addr in net:
            return True
    return False


def _port_in(port: int, value: str, rule: Rule) -> bool:
    for part in value.split(","):
        lo, sep, hi = part.partition(":")
        try:
            low = int(lo) if lo else 0
            high = int(hi) if sep and hi else (65535 if sep else low)
        except ValueError:
            raise WalkError(f"{rule.where}: {part!r} is not a port or port range") from None
        if low <= port <= high:
            return True
    return False


def _iface(dev: str, pattern: str) -> bool:
    return dev.startswith(pattern[:-1]) if pattern.endswith("+") else dev == pattern


def _apply_mark(rule: Rule, mark: int) -> int:
    a = rule.target_args
    try:
        if "--set-xmark" in a or "--set-mark" in a:
            key = "--set-xmark" if "--set-xmark" in a else "--set-mark"
            value, _, mask = (a[key] or "").partition("/")
            v, m = int(value, 0), int(mask, 0) if mask else 0xFFFFFFFF
            return ((mark & ~m) ^ v if key == "--set-xmark" else (mark & ~m) | v) & 0xFFFFFFFF
        if "--or-mark" in a:
            return mark | int(a["--or-mark"] or "", 0)
        if "--and-mark" in a:
            return mark & int(a["--and-mark"] or "", 0)
        if "--xor-mark" in a:
            return mark ^ int(a["--xor-mark"] or "", 0)
    except ValueError:
        raise WalkError(f"{rule.where}: the MARK value is not a number") from None
    raise WalkError(f"{rule.where}: MARK without --set-xmark, --set-mark, --or-mark, --and-mark or --xor-mark")
