"""The jump part of the iptables drift audit, on iptables-save text without a kernel.

Several of our jumps leave the same built-in chain (filter INPUT holds four), and a real node's
built-in chains are long with other software's rules; the audit must canonicalise each of those
chains once per drift() call, not once per jump into it, and still find each missing jump.
"""

from __future__ import annotations

import shlex
from collections import Counter

import pytest

from ebpf_proxy.datapath.iptables import chains as ch
from ebpf_proxy.datapath.iptables.ruleset import TABLE_ORDER, Ruleset
from ebpf_proxy.explain import audit_iptables
from ebpf_proxy.explain.audit import MISSING

# someone else's rules in every built-in chain we jump from (a firewall manager's, say)
FOREIGN = ("-s 198.51.100.0/24 -j DROP", "-p tcp -m tcp --dport 22 -j ACCEPT", "-i lo -j ACCEPT")


def _saved(skip: ch.JumpRule | None = None) -> dict[str, str]:
    """iptables-save text per table: each built-in chain with the foreign rules and our jumps."""
    lines: dict[str, list[str]] = {t: [f"*{t}"] for t in TABLE_ORDER}
    builtin = sorted({(j.table, j.chain) for j in ch.JUMP_RULES})
    for table, chain in builtin:
        lines[table].append(f":{chain} ACCEPT [0:0]")
        lines[table] += [f"-A {chain} {rule}" for rule in FOREIGN]
    for jump in ch.JUMP_RULES:
        if jump is not skip:
            lines[jump.table].append(f"-A {jump.chain} {shlex.join(jump.rule_args)}")
    return {t: "\n".join([*body, "COMMIT"]) + "\n" for t, body in lines.items()}


@pytest.fixture
def canonicalised(monkeypatch) -> Counter:
    """Counts how often each rule (as its tokens) is canonicalised during the test."""
    seen: Counter = Counter()
    real = audit_iptables.canonical

    def counting(tokens):
        seen[tuple(tokens)] += 1
        return real(tokens)

    monkeypatch.setattr(audit_iptables, "canonical", counting)
    return seen


def test_each_builtin_chain_rule_is_canonicalised_once(canonicalised):
    drifts, _, _ = audit_iptables.drift(Ruleset({}), _saved())
    assert drifts == []
    assert max(Counter(j.chain for j in ch.JUMP_RULES).values()) > 1  # else this proves nothing
    foreign = {tuple(shlex.split(rule)) for rule in FOREIGN}
    chains_per_table = {t: {j.chain for j in ch.JUMP_RULES if j.table == t} for t in TABLE_ORDER}
    # a foreign rule stands once in every built-in chain we jump from: read once per chain
    for tokens in foreign:
        assert canonicalised[tokens] == sum(len(c) for c in chains_per_table.values()), tokens


@pytest.mark.parametrize("skip", ch.JUMP_RULES, ids=lambda j: f"{j.table}-{j.chain}-{j.target}")
def test_each_missing_jump_is_found_and_named(skip):
    drifts, _, _ = audit_iptables.drift(Ruleset({}), _saved(skip))
    assert [(d.kind, d.what, d.key) for d in drifts] == [
        (MISSING, "iptables jump", f"{skip.table} {skip.chain} -> {skip.target}")]
