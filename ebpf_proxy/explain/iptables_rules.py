"""iptables rules as data the walker can evaluate: parsed from `iptables-save` text or from our Ruleset.

Two sources must read the same way, because `trace` compares what we meant with what the kernel
holds: the text of `iptables-legacy-save` / `iptables-nft-save` on a node (which prints
`-d 10.96.0.1/32`, `-j MARK --set-xmark 0x4000/0x4000`, counters with `-c`), and the `Ruleset`
our renderer produces (which has only our chains: the built-in chains' jumps into them are the
`JUMP_RULES` that the datapath inserts one by one, added here in the order the kernel ends up
with).

Parsing is strict about form (a missing option value, a rule outside a table, an option no
loaded match knows: `RulesError` naming the line) but lazy about meaning: a match module the
walker cannot evaluate (`-m physdev`, `-m set`, ...) is kept as `unknown` and only fails when a
packet actually reaches that rule, so a node with other software's rules can still be traced
through the chains kube-proxy's packets take.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ebpf_proxy.datapath.iptables import chains as ch
from ebpf_proxy.datapath.iptables.ruleset import Ruleset

BUILTIN_CHAINS = {
    "nat": ("PREROUTING", "INPUT", "OUTPUT", "POSTROUTING"),
    "filter": ("INPUT", "FORWARD", "OUTPUT"),
    "mangle": ("PREROUTING", "INPUT", "FORWARD", "OUTPUT", "POSTROUTING"),
    "raw": ("PREROUTING", "OUTPUT"),
}

# Options each match module takes: option -> number of values (0: a flag).
_PORTS = {"--dport": 1, "--destination-port": 1, "--sport": 1, "--source-port": 1}
MODULE_OPTIONS: dict[str, dict[str, int]] = {
    "tcp": _PORTS,
    "udp": _PORTS,
    "sctp": _PORTS,
    "multiport": {"--dports": 1, "--destination-ports": 1, "--sports": 1, "--source-ports": 1, "--ports": 1},
    "comment": {"--comment": 1},
    "addrtype": {"--src-type": 1, "--dst-type": 1},
    "mark": {"--mark": 1},
    "statistic": {"--mode": 1, "--probability": 1, "--every": 1, "--packet": 1},
    "recent": {"--name": 1, "--rcheck": 0, "--update": 0, "--set": 0, "--remove": 0, "--seconds": 1,
               "--reap": 0, "--hitcount": 1, "--rttl": 0, "--rsource": 0, "--rdest": 0, "--mask": 1},
    "conntrack": {"--ctstate": 1},
    "state": {"--state": 1},
    "nfacct": {"--nfacct-name": 1},
}
# The options that are a match in their own right (the rest only qualify one: --seconds, --name, ...).
_MATCH_OPTIONS = {
    "--dport": "dport", "--destination-port": "dport", "--sport": "sport", "--source-port": "sport",
    "--dports": "dports", "--destination-ports": "dports", "--sports": "sports", "--source-ports": "sports",
    "--ports": "ports", "--src-type": "src-type", "--dst-type": "dst-type", "--mark": "mark",
    "--ctstate": "ctstate", "--state": "ctstate",
}
_GENERIC = {"-s": "src", "--source": "src", "-d": "dst", "--destination": "dst", "-p": "proto",
            "--protocol": "proto", "-i": "in", "--in-interface": "in", "-o": "out", "--out-interface": "out"}


class RulesError(ValueError):
    """Rules that cannot be read; the message names the table, chain and line at fault."""


@dataclass(frozen=True)
class Match:
    """One condition of a rule. `kind`: src, dst, proto, in, out, dport, sport, dports, sports,
    ports, src-type, dst-type, mark, ctstate, statistic, recent, or unknown (`value` names it)."""

    kind: str
    value: Any
    negate: bool = False


@dataclass(frozen=True)
class Rule:
    table: str
    chain: str
    index: int  # 1-based position in its chain, as `iptables -L --line-numbers` counts
    text: str  # the rule as written ("-A CHAIN ..."), for messages and steps
    line: int | None  # line in the save text (None: built from a Ruleset)
    matches: tuple[Match, ...] = ()
    target: str | None = None  # None: no -j/-g (the rule only counts packets)
    target_args: Mapping[str, str | None] = field(default_factory=dict)
    goto: bool = False
    comment: str | None = None

    @property
    def where(self) -> str:
        at = f", line {self.line}" if self.line is not None else ""
        return f"{self.table} {self.chain} rule {self.index}{at}: {self.text}"


@dataclass(frozen=True)
class Chain:
    name: str
    rules: tuple[Rule, ...]
    policy: str | None  # ACCEPT/DROP for a built-in chain, None for a user chain


@dataclass(frozen=True)
class Tables:
    """table -> chain name -> Chain."""

    tables: Mapping[str, Mapping[str, Chain]]

    def chain(self, table: str, name: str) -> Chain | None:
        return self.tables.get(table, {}).get(name)

    def has_table(self, table: str) -> bool:
        return table in self.tables


class _ChainsBuilder:
    def __init__(self) -> None:
        self.tables: dict[str, dict[str, list[Rule]]] = {}
        self.policies: dict[str, dict[str, str | None]] = {}

    def declare(self, table: str, chain: str, policy: str | None) -> None:
        self.tables.setdefault(table, {}).setdefault(chain, [])
        self.policies.setdefault(table, {})[chain] = policy

    def add(self, table: str, tokens: list[str], text: str, line: int | None) -> None:
        chains = self.tables.setdefault(table, {})
        chain = tokens[1]
        if chain not in chains:
            self.declare(table, chain, "ACCEPT" if chain in BUILTIN_CHAINS.get(table, ()) else None)
        chains[chain].append(parse_rule(table, tokens, text, line, index=len(chains[chain]) + 1))

    def build(self) -> Tables:
        return Tables({t: {c: Chain(c, tuple(rules), self.policies[t].get(c)) for c, rules in chains.items()}
                       for t, chains in self.tables.items()})


_TOKEN = re.compile(r'"((?:[^"\\]|\\.)*)"|(\S+)')
_ESCAPE = re.compile(r"\\(.)")


def split_words(text: str, where: str) -> list[str]:
    """Shell-like words, as iptables-save quotes them ("..." with backslash escapes). A regex, not
    shlex, for the common case: shlex takes seconds over a 10,000-service dump."""
    if '"' not in text and "'" not in text and "\\" not in text:
        return text.split()
    if "'" not in text:
        tokens = []
        for m in _TOKEN.finditer(text):
            if m.group(1) is not None:
                tokens.append(_ESCAPE.sub(r"\1", m.group(1)))
            elif '"' in m.group(2) or "\\" in m.group(2):
                break  # quotes inside a word, or unbalanced: let shlex decide
            else:
                tokens.append(m.group(2))
        else:
            return tokens
    try:
        return shlex.split(text)
    except ValueError as exc:  # unbalanced quotes
        raise RulesError(f"{where}: {exc}: {text}") from None


def parse_save(text: str, source: str = "iptables-save") -> Tables:
    """Every table of an iptables-save dump (with or without -c counters)."""
    b = _ChainsBuilder()
    table: str | None = None
    for no, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if line.startswith("[") and "]" in line:  # `iptables-save -c`: "[pkts:bytes] -A ..."
            line = line.split("]", 1)[1].strip()
        if not line or line.startswith("#"):
            continue
        where = f"{source} line {no}"
        if line.startswith("*"):
            table = line[1:].strip()
            b.tables.setdefault(table, {})
            b.policies.setdefault(table, {})
        elif line == "COMMIT":
            table = None
        elif table is None:
            raise RulesError(f"{where}: {line!r} is outside a table (no *nat/*filter line before it)")
        elif line.startswith(":"):
            parts = line[1:].split()
            if not parts:
                raise RulesError(f"{where}: chain line without a name: {line!r}")
            policy = parts[1] if len(parts) > 1 and parts[1] != "-" else None
            b.declare(table, parts[0], policy)
        elif line.startswith("-A "):
            tokens = split_words(line, where)
            if len(tokens) < 2:
                raise RulesError(f"{where}: -A without a chain: {line!r}")
            b.add(table, tokens, line, no)
        elif line.startswith(("-X ", "-F ", "-N ")):
            continue  # restore-input commands: nothing to walk
        else:
            raise RulesError(f"{where}: not an iptables-save line: {line!r}")
    return b.build()


def from_ruleset(ruleset: Ruleset, jump_rules: Iterable[ch.JumpRule] = ch.JUMP_RULES) -> Tables:
    """Our rendered Ruleset plus the built-in chains' jumps into it, as the kernel holds them:
    each jump is inserted at position 1 when missing, so the last one ensured comes first."""
    b = _ChainsBuilder()
    for table in ("filter", "nat"):
        for chain in BUILTIN_CHAINS[table]:
            b.declare(table, chain, "ACCEPT")
    per_chain: dict[tuple[str, str], list[ch.JumpRule]] = {}
    for jump in jump_rules:
        per_chain.setdefault((jump.table, jump.chain), []).append(jump)
    for (table, chain), jumps in per_chain.items():
        for jump in reversed(jumps):
            tokens = ["-A", chain, *jump.rule_args]
            b.add(table, tokens, shlex.join(tokens), None)
    for table, chains in ruleset.tables.items():
        for chain, lines in chains.items():
            b.declare(table, chain, None)
            for line in lines:
                b.add(table, split_words(line, f"ruleset {table} {chain}"), line, None)
    return b.build()


def parse_rule(table: str, tokens: list[str], text: str, line: int | None, index: int) -> Rule:
    """One "-A CHAIN ..." rule, tokenised, into matches and a target."""
    chain = tokens[1]
    at = f"{table} {chain} rule {index}" + (f", line {line}" if line is not None else "")

    def fail(why: str) -> RulesError:
        return RulesError(f"{at}: {why}: {text}")

    matches: list[Match] = []
    modules: list[str] = []
    comment: str | None = None
    target: str | None = None
    goto = False
    target_args: dict[str, str | None] = {}
    negate = False
    i = 2

    def value(opt: str) -> str:
        if i + 1 >= len(tokens):
            raise fail(f"{opt} needs a value")
        return tokens[i + 1]

    while i < len(tokens):
        tok = tokens[i]
        if tok == "!":
            if negate:
                raise fail("two '!' in a row")
            negate = True
            i += 1
            continue
        if tok in ("-j", "--jump", "-g", "--goto"):
            if negate:
                raise fail(f"'!' before {tok}")
            target, goto = value(tok), tok in ("-g", "--goto")
            target_args = _target_args(tokens[i + 2:], fail)
            break
        if tok in _GENERIC:
            kind = _GENERIC[tok]
            val = value(tok)
            matches.append(Match(kind, val.lower() if kind == "proto" else val, negate))
            if kind == "proto" and val.lower() in ("tcp", "udp", "sctp"):
                modules.append(val.lower())  # -p tcp makes --dport usable without -m tcp
            i += 2
        elif tok in ("-m", "--match"):
            if negate:
                raise fail("'!' before -m")
            mod = value(tok)
            modules.append(mod)
            if mod not in MODULE_OPTIONS:
                matches.append(Match("unknown", f"-m {mod}"))
            i += 2
        elif tok.startswith("--"):
            mod = next((m for m in reversed(modules) if tok in MODULE_OPTIONS.get(m, {})), None)
            if mod is None:
                if any(m not in MODULE_OPTIONS for m in modules):
                    # an option of a module we do not evaluate: it is already an `unknown` match
                    i += 1
                    while i < len(tokens) and not tokens[i].startswith("-") and tokens[i] != "!":
                        i += 1
                    negate = False
                    continue
                raise fail(f"option {tok} belongs to no match loaded before it")
            n = MODULE_OPTIONS[mod][tok]
            val = value(tok) if n else None
            i += 1 + n
            if tok == "--comment":
                comment = val
            elif tok in _MATCH_OPTIONS:
                matches.append(Match(_MATCH_OPTIONS[tok], val, negate))
            elif mod == "statistic" and tok == "--mode":
                matches.append(Match("statistic", val, negate))
            elif mod == "recent" and tok in ("--rcheck", "--update", "--set", "--remove"):
                matches.append(Match("recent", tok[2:], negate))
            elif negate:
                raise fail(f"'!' before {tok}, which is not a match")
        else:
            raise fail(f"unexpected {tok!r}")
        negate = False
    if negate:
        raise fail("'!' at the end of the rule")
    return Rule(table, chain, index, text, line, tuple(matches), target, target_args, goto, comment)


def _target_args(tokens: list[str], fail) -> dict[str, str | None]:
    """A target's options: "--opt value" pairs and "--flag"s (iptables-save prints targets last)."""
    out: dict[str, str | None] = {}
    i = 0
    while i < len(tokens):
        opt = tokens[i]
        if not opt.startswith("--"):
            raise fail(f"unexpected {opt!r} after the target")
        if i + 1 < len(tokens) and not tokens[i + 1].startswith("--"):
            out[opt] = tokens[i + 1]
            i += 2
        else:
            out[opt] = None
            i += 1
    return out
