"""A rendered ruleset as data, and the `iptables-restore --noflush` input that moves the kernel to it.

The ruleset is kept per chain (chain -> its "-A" lines) because that is the unit iptables-restore
can replace atomically without touching anything else: with --noflush, a `:CHAIN - [0:0]` line
flushes just that chain, and `-X CHAIN` (after the flush) deletes it. Comparing two rulesets chain
by chain is then what makes a partial sync: only chains whose text changed are sent.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Collection, Iterable, Iterator, Mapping
from dataclasses import dataclass, field

from ebpf_proxy.datapath.iptables.chains import FILTER, NAT, is_service_chain

# kube-proxy writes the filter table first, then nat; keep that order in every restore input.
TABLE_ORDER = (FILTER, NAT)

Chains = Mapping[str, tuple[str, ...]]  # chain name -> its rule lines, in order


@dataclass(frozen=True)
class Ruleset:
    """Every chain this datapath owns, per table, with its complete content."""

    tables: Mapping[str, Chains]

    def chains(self, table: str) -> Chains:
        return self.tables.get(table, {})

    def rule_count(self, table: str) -> int:
        return sum(len(rules) for rules in self.chains(table).values())


@dataclass(frozen=True)
class RestorePlan:
    """Which chains to (re)write and which to delete, per table."""

    write: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    delete: Mapping[str, tuple[str, ...]] = field(default_factory=dict)

    @property
    def empty(self) -> bool:
        return not any(self.write.values()) and not any(self.delete.values())

    def count(self, what: str) -> int:
        return sum(len(chains) for chains in getattr(self, what).values())

    def text(self, ruleset: Ruleset) -> str:
        """The iptables-restore input: per table, chain lines (which flush), rules, then deletions.

        Deletions come last so that every chain still referring to a deleted chain has already
        been flushed and rewritten by the time `-X` runs.
        """
        out: list[str] = []
        for table in TABLE_ORDER:
            write = self.write.get(table, ())
            delete = self.delete.get(table, ())
            if not write and not delete:
                continue
            out.append(f"*{table}")
            out.extend(f":{chain} - [0:0]" for chain in (*write, *delete))
            for chain in write:
                out.extend(ruleset.chains(table)[chain])
            out.extend(f"-X {chain}" for chain in delete)
            out.append("COMMIT")
        return "\n".join(out) + "\n" if out else ""


def full_plan(new: Ruleset, existing: Mapping[str, Iterable[str]], proven: Collection[str] = ()) -> RestorePlan:
    """Rewrite every chain of `new`; delete the per-service chains found in the kernel but not in `new`.

    `existing` comes from iptables-save, so chains left by an earlier run (or by a failed sync)
    are collected too; only per-service chains are deleted, as kube-proxy does, since any other
    chain might belong to someone else. The `proven` tables are left alone: the kernel is proved
    to hold them as `new` has them already (proof.py), so no chain is stale there.
    """
    write = {table: () if table in proven else tuple(new.chains(table)) for table in TABLE_ORDER}
    delete = {
        table: () if table in proven else tuple(
            sorted(c for c in existing.get(table, ()) if is_service_chain(c) and c not in new.chains(table))
        )
        for table in TABLE_ORDER
    }
    return RestorePlan(write=write, delete=delete)


def partial_plan(old: Ruleset, new: Ruleset) -> RestorePlan:
    """Rewrite only the chains whose content differs from `old` (the kernel's state); delete the vanished ones.

    Safe because a chain with unchanged text cannot refer to a deleted chain: `new` has no rule
    jumping to a chain absent from `new`, so a chain that jumped there changed and is rewritten.
    """
    write = {
        table: tuple(c for c, rules in new.chains(table).items() if old.chains(table).get(c) != rules)
        for table in TABLE_ORDER
    }
    delete = {table: tuple(c for c in old.chains(table) if c not in new.chains(table)) for table in TABLE_ORDER}
    return RestorePlan(write=write, delete=delete)


def parse_save(text: str) -> dict[str, dict[str, list[str]]]:
    """iptables-save output -> table -> chain -> "-A" lines (chains without rules included)."""
    tables: dict[str, dict[str, list[str]]] = {}
    current: dict[str, list[str]] | None = None
    for line in text.splitlines():
        if line.startswith("*"):
            current = tables.setdefault(line[1:].strip(), {})
        elif current is None:
            continue
        elif line.startswith(":"):
            current.setdefault(_declared_chain(line), [])
        elif line.startswith("-A "):
            current.setdefault(_rule_chain(line), []).append(line)
    return tables


class SaveNotGrouped(ValueError):
    """iptables-save printed one chain's rules in two places (neither backend does): the caller
    reads that table with parse_save instead."""


def _lines(text: str) -> Iterator[str]:
    """The lines of `text` one at a time: splitlines() would hold every line of a 10 MB
    iptables-save (~110,000 str objects at 10,000 Services) at once."""
    start, end = 0, len(text)
    while start < end:
        stop = text.find("\n", start)
        if stop < 0:
            stop = end
        yield text[start:stop]
        start = stop + 1


def _rule_chain(line: str) -> str:
    """The chain of an "-A CHAIN ..." line."""
    stop = line.find(" ", 3)
    return line[3:] if stop < 0 else line[3:stop]


def _declared_chain(line: str) -> str:
    """The chain of a ":CHAIN POLICY [packets:bytes]" line."""
    return line[1:].split(None, 1)[0]


def chain_runs(text: str) -> Iterator[tuple[str, list[str]]]:
    """Each chain of one table's iptables-save text with its "-A" lines, one chain at a time, so
    that a reader holds one chain, not the table: the chains with rules as their rules come
    (both backends print a chain's rules together, in chain order), then the declared chains
    without rules, with []. Raises SaveNotGrouped when a chain's rules come in two places."""
    has_rules: dict[str, bool] = {}  # every chain named so far: declared (False) or its rules read (True)
    chain: str | None = None
    rules: list[str] = []
    for line in _lines(text):
        if line.startswith("-A "):
            name = _rule_chain(line)
            if name != chain:
                if chain is not None:
                    yield chain, rules
                if has_rules.get(name):
                    raise SaveNotGrouped(f"iptables-save: the rules of chain {name} come in two places")
                has_rules[name] = True
                chain, rules = name, []
            rules.append(line)
        elif line.startswith(":"):
            has_rules.setdefault(_declared_chain(line), False)
    if chain is not None:
        yield chain, rules
    for name, read in has_rules.items():
        if not read:
            yield name, []


def saved_chains(text: str, keep_rules: Collection[str]) -> dict[str, list[str]]:
    """Every chain of one table's iptables-save text, with the "-A" lines of the chains in
    `keep_rules` only ([] for the others): what a full sync needs (which chains exist, to delete
    stale ones, and the built-in chains our jumps go in), without a list of every rule line.

    Found by regular expressions that start at a newline (a literal the engine searches for fast),
    not by walking the lines: at 10,000 Services the text is ~110,000 lines, which the walk took
    0.10-0.18 s to read on the agent's start, under the GIL its initial list needs (these, ~0.05 s).
    The declared chains come first, in order, then any chain that only has rules (iptables-save
    declares every chain; a hand-made text may not)."""
    if text.startswith((":", "-A ")):
        text = "\n" + text  # the first line, too, follows a newline
    chains: dict[str, list[str]] = {name: [] for name in _DECLARED_CHAIN.findall(text)}
    for name in dict.fromkeys(_RULE_CHAIN.findall(text)):
        if name not in chains:
            chains[name] = []
    if keep_rules:
        for line, name in _rules_of(frozenset(keep_rules)).findall(text):
            chains[name].append(line)
    return chains


_DECLARED_CHAIN = re.compile(r"\n:(\S+)")  # ":CHAIN POLICY [packets:bytes]"
_RULE_CHAIN = re.compile(r"\n-A (\S+)")


@functools.lru_cache(maxsize=64)
def _rules_of(chains: frozenset[str]) -> re.Pattern[str]:
    """Finds each whole "-A" line of one of `chains` (after a newline), as (line, chain)."""
    names = "|".join(re.escape(name) for name in sorted(chains))
    return re.compile(rf"\n(-A ({names})(?:[ \t][^\n]*)?)(?=\n|$)")


_TABLE_HEADER = re.compile(r"\n\*(\S+)[ \t]*(?=\n|$)")  # after a newline, as saved_chains' patterns


def table_sections(text: str) -> dict[str, str]:
    """Each table's part of an iptables-save of every table (the one the backend detection reads;
    after its "*table" line, up to the next one), by table name. A table the save does not show is
    not there: the kernel has not made it in this namespace yet, so it holds no chain of ours (a
    save of that table alone would make it, showing its built-in chains without rules; a full
    sync creates what it needs either way)."""
    if text.startswith("*"):
        text = "\n" + text  # the first line, too, follows a newline
    headers = list(_TABLE_HEADER.finditer(text))
    return {m.group(1): text[m.end():headers[i + 1].start() if i + 1 < len(headers) else len(text)]
            for i, m in enumerate(headers)}


