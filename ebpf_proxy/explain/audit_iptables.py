"""The drift audit of the iptables datapath: iptables-save against the ruleset the last sync applied.

The kernel never prints a rule as we wrote it: `-d 10.96.0.10` comes back `-d 10.96.0.10/32`
(`-d fd00::10` as `-d fd00::10/128` from ip6tables-save),
`-m tcp -p tcp --dport 80` as `-p tcp -m tcp --dport 80`, `--or-mark 0x004000` as
`--set-xmark 0x4000/0x4000`, `--probability 0.1000000000` as the fixed-point value the kernel
holds, printed with eleven decimals (`0.10000000009`: _probability), the recent match
with its defaults (`--mask 255.255.255.255 --rsource`, or `--mask ffff:...:ffff` for IPv6) spelled
out, IPv6 addresses in their one canonical spelling (also in DNAT's `--to-destination [addr]:port`),
and the legacy and nft backends agree on none of this by contract. So both sides are reduced to a canonical form (the
generic matches as a set, each match module with its options as a set, the target with its
options in one spelling) that is equal exactly when the kernel rule does what ours says; a test
loads every kind of rule we render into both backends and requires zero drift.

Compared: every chain of the applied ruleset, rule by rule and in order (missing, extra or stale
rules; missing chains); per-service chains (KUBE-SVC-, KUBE-SEP-, ...) in the kernel that the
ruleset does not have (extra chains: nobody will ever jump there on purpose, but someone may);
and each jump from a built-in chain into ours. Other rules in the built-in chains are someone
else's and not ours to judge.

A clean audit is also a proof that the kernel's text does what the applied ruleset says: the
datapath keeps it (datapath/iptables/proof.py), so that a restarted agent's full sync restores
no table the kernel still holds that way.

Repair rewrites only the drifted chains (one `iptables-restore --noflush` of them), deletes the
extra per-service chains, and inserts missing jumps again.
"""

from __future__ import annotations

import difflib
import ipaddress
import math
import shlex
from collections.abc import Iterable

from ebpf_proxy.datapath.iptables import chains as ch
from ebpf_proxy.datapath.iptables.datapath import IptablesDatapath
from ebpf_proxy.datapath.iptables.ruleset import TABLE_ORDER, Ruleset, SaveNotGrouped, chain_runs, parse_save
from ebpf_proxy.explain.audit import EXTRA, MISSING, STALE, AuditReport, AuditUnavailable, Drift
from ebpf_proxy.explain.iptables_rules import MODULE_OPTIONS, RulesError, split_words

# (table, chain) -> (our lines, the hash of the kernel's lines) last proven equal: a chain whose
# text is unchanged on both sides is not canonicalised again (100,000 rules take ~2 s to
# canonicalise; in steady state an audit then costs the iptables-save and one comparison per
# chain). The kernel's side is kept as a hash, not its lines: those were a second copy of the
# whole iptables-save text held between audits (~80 MiB of the agent at 10,000 Services x 10
# endpoints); a changed chain hashing as before (once in 2^64) would go unseen until it changes again
Proven = dict[tuple[str, str], tuple[tuple[str, ...], int]]

_GENERIC = {"-s": "-s", "--source": "-s", "-d": "-d", "--destination": "-d", "-p": "-p", "--protocol": "-p",
            "-i": "-i", "--in-interface": "-i", "-o": "-o", "--out-interface": "-o"}
_ALL_BITS = 0xFFFFFFFF
# options iptables-save prints although nobody asked for them (the match's defaults)
_DEFAULTS = {("recent", "--mask", "255.255.255.255"), ("recent", "--mask", "ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff"),
             ("recent", "--rsource", "")}
_SYNONYMS = {"--destination-port": "--dport", "--source-port": "--sport", "--destination-ports": "--dports",
             "--source-ports": "--sports", "--state": "--ctstate"}

Canonical = tuple  # (generic matches, module instances, target, target options, goto)


def _mark(value: str) -> tuple[int, int]:
    """'0x4000/0x4000' or '0x004000' (mask all ones) as (value, mask)."""
    mark, _, mask = value.partition("/")
    return int(mark, 0), int(mask, 0) if mask else _ALL_BITS


def _address(value: str) -> str:
    try:
        return str(ipaddress.ip_network(value, strict=False))
    except ValueError:
        return value  # a hostname or something else we never write: compared as written


def _dnat_destination(value: str) -> str:
    """DNAT's `--to-destination` ADDR:PORT or [ADDR6]:PORT with the address canonical (ip6tables-save
    prints IPv6 compressed and lower-case); anything else (ranges, ...) as written."""
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit():
        return value
    bracketed = host.startswith("[") and host.endswith("]")
    try:
        addr = ipaddress.ip_address(host[1:-1] if bracketed else host)
    except ValueError:
        return value
    return f"[{addr}]:{port}" if addr.version == 6 else f"{addr}:{port}"


def _probability(value: str) -> str:
    """The statistic match's probability as the kernel holds it: libxt_statistic parses it into
    lround(p * 2^31), a u32, and prints that back over 2^31 with eleven decimals. kube-proxy's
    ten-decimal 1/n meets the kernel's print only in that integer: 0.1000000000 comes back
    0.10000000009, 0.3333333333 as 0.33333333349 (rounded to ten decimals they differ, and every
    service with 3 or more endpoints audited as drifted, its chain rewritten at each audit)."""
    try:
        return str(math.floor(float(value) * 0x80000000 + 0.5))  # lround, for p >= 0
    except ValueError:  # not a number: compared as written
        return value


def _option_value(module: str, opt: str, value: str) -> str:
    if opt == "--mark":
        return "%#x/%#x" % _mark(value)
    if opt == "--probability":
        return _probability(value)
    if opt == "--ctstate":
        return ",".join(sorted(value.split(",")))
    return value


def _target_options(target: str | None, tokens: list[str]) -> tuple:
    """The target's options in one spelling: MARK's --or-mark/--xor-mark/--and-mark/--set-mark all
    as the --set-xmark value/mask the kernel prints, numbers as numbers."""
    opts: dict[str, str] = {}
    i = 0
    while i < len(tokens):
        if i + 1 < len(tokens) and not tokens[i + 1].startswith("--"):
            opts[tokens[i]] = tokens[i + 1]
            i += 2
        else:
            opts[tokens[i]] = ""
            i += 1
    if target == "DNAT" and opts.get("--to-destination"):
        opts["--to-destination"] = _dnat_destination(opts["--to-destination"])
    if target == "MARK":
        for opt, value in list(opts.items()):
            bits = int(value.split("/")[0], 0) if value else 0
            if opt == "--or-mark":
                xmark = (bits, bits)
            elif opt == "--xor-mark":
                xmark = (bits, 0)
            elif opt == "--and-mark":
                xmark = (0, ~bits & _ALL_BITS)
            elif opt == "--set-mark":
                mark, mask = _mark(value)
                xmark = (mark, mask | mark)
            elif opt == "--set-xmark":
                xmark = _mark(value)
            else:
                continue
            del opts[opt]
            opts["--set-xmark"] = "%#x/%#x" % xmark
    return tuple(sorted(opts.items()))


def canonical(tokens: list[str]) -> Canonical:
    """A rule's tokens after "-A CHAIN", in a form equal for every spelling of the same rule."""
    generic: set[tuple[str, bool, str]] = set()
    modules: list[tuple[str, list[tuple[str, bool, str]]]] = []
    negate = False
    target: str | None = None
    goto = False
    target_opts: tuple = ()
    i = 0
    while i < len(tokens):
        tok = tokens[i]
        if tok == "!":
            negate = True
            i += 1
            continue
        if tok in ("-j", "--jump", "-g", "--goto"):
            target = tokens[i + 1] if i + 1 < len(tokens) else None
            goto = tok in ("-g", "--goto")
            target_opts = _target_options(target, tokens[i + 2:])
            break
        if tok in _GENERIC:
            opt = _GENERIC[tok]
            value = tokens[i + 1] if i + 1 < len(tokens) else ""
            value = _address(value) if opt in ("-s", "-d") else value.lower() if opt == "-p" else value
            generic.add((opt, negate, value))
            i += 2
        elif tok in ("-m", "--match"):
            modules.append((tokens[i + 1] if i + 1 < len(tokens) else "", []))
            i += 2
        else:
            opt = _SYNONYMS.get(tok, tok)
            owner = next((m for m in reversed(modules) if opt in MODULE_OPTIONS.get(m[0], {})),
                         modules[-1] if modules else None)
            if owner is None:
                owner = ("", [])
                modules.append(owner)
            takes = MODULE_OPTIONS.get(owner[0], {}).get(opt)
            if takes is None:  # unknown to us: a value unless the next token is an option
                takes = int(i + 1 < len(tokens) and not tokens[i + 1].startswith("-"))
            value = tokens[i + 1] if takes and i + 1 < len(tokens) else ""
            if (owner[0], opt, value) not in _DEFAULTS:
                owner[1].append((opt, negate, _option_value(owner[0], opt, value)))
            i += 1 + takes
        negate = False
    instances = sorted((name, tuple(sorted(opts))) for name, opts in modules)
    return (tuple(sorted(generic)), tuple(instances), target, target_opts, goto)


def _rule_tokens(line: str, where: str) -> list[str]:
    tokens = split_words(line, where)
    return tokens[2:]  # past "-A CHAIN"


def _chain_drift(table: str, chain: str, ours: tuple[str, ...], kernel: list[str]) -> list[Drift]:
    """Rule by rule, in order: which of our rules are missing, stale, or joined by others."""
    a = [canonical(_rule_tokens(line, f"ruleset {table} {chain}")) for line in ours]
    b = [canonical(_rule_tokens(line, f"iptables-save {table} {chain}")) for line in kernel]
    if a == b:
        return []
    out: list[Drift] = []
    matcher = difflib.SequenceMatcher(a=a, b=b, autojunk=False)
    for op, a0, a1, b0, b1 in matcher.get_opcodes():
        if op == "equal":
            continue
        paired = min(a1 - a0, b1 - b0) if op == "replace" else 0
        for k in range(paired):
            out.append(Drift(STALE, "iptables rule", f"{table} {chain} rule {b0 + k + 1}",
                             f"is `{kernel[b0 + k]}`, should be `{ours[a0 + k]}`"))
        for k in range(a0 + paired, a1):
            out.append(Drift(MISSING, "iptables rule", f"{table} {chain} rule {k + 1}", f"`{ours[k]}`"))
        for k in range(b0 + paired, b1):
            out.append(Drift(EXTRA, "iptables rule", f"{table} {chain} rule {k + 1}", f"`{kernel[k]}`"))
    return out


def _missing_jumps(table: str, held: dict[str, list[str]]) -> list[Drift]:
    """Our jumps from the built-in chains of `table` that the kernel does not hold. Several jumps
    leave the same built-in chain (filter INPUT has four), so each chain is canonicalised once
    here, not once per jump: on a node whose INPUT is long with others' rules that is most of
    this step's cost."""
    present: dict[str, set[Canonical]] = {}
    out: list[Drift] = []
    for jump in ch.JUMP_RULES:
        if jump.table != table:
            continue
        if jump.chain not in present:
            present[jump.chain] = {canonical(_rule_tokens(line, f"iptables-save {table} {jump.chain}"))
                                   for line in held.get(jump.chain, [])}
        if canonical(list(jump.rule_args)) not in present[jump.chain]:
            out.append(Drift(MISSING, "iptables jump", f"{table} {jump.chain} -> {jump.target}",
                             f"`-A {jump.chain} {shlex.join(jump.rule_args)}`"))
    return out


def _compare(table: str, chain: str, ours: tuple[str, ...], kernel: list[str], proven: Proven) -> list[Drift]:
    """One chain's drifts, skipped when both sides' text is what was last proven equal."""
    pair = (tuple(ours), hash(tuple(kernel)))
    if proven.get((table, chain)) == pair:
        return []
    try:
        found = _chain_drift(table, chain, ours, kernel)
    except RulesError as exc:
        raise AuditUnavailable(str(exc)) from None
    if found:
        proven.pop((table, chain), None)
    else:
        proven[(table, chain)] = pair
    return found


def _table_drift(table: str, applied: Ruleset, held: Iterable[tuple[str, list[str]]], proven: Proven,
                 ) -> tuple[list[Drift], set[str], set[str]]:
    """`table`'s drifts (our chains in name order, then the extra chains, then the missing jumps)
    and the chains that repair them, the kernel's chains taken one at a time from `held`: only
    the chains our jumps go in are kept past their comparison."""
    ours = applied.chains(table)
    found: dict[str, list[Drift]] = {}
    extra: dict[str, int] = {}
    builtin: dict[str, list[str]] = {}
    missing = set(ours)  # ours' own names: the kernel's are not kept past their chain
    for chain, rules in held:
        if chain in ch.JUMP_CHAINS[table]:
            builtin[chain] = rules
        if chain in ours:
            missing.discard(chain)
            drifts = _compare(table, chain, ours[chain], rules, proven)
            if drifts:
                found[chain] = drifts
        elif ch.is_service_chain(chain):
            extra[chain] = len(rules)
    out: list[Drift] = []
    for chain in sorted(found.keys() | missing):
        if chain in found:
            out += found[chain]
        else:
            out.append(Drift(MISSING, "iptables chain", f"{table} {chain}", f"with {len(ours[chain])} rules"))
    out += [Drift(EXTRA, "iptables chain", f"{table} {chain}", f"with {n} rules") for chain, n in sorted(extra.items())]
    out += _missing_jumps(table, builtin)
    return out, found.keys() | missing, set(extra)


def drift(applied: Ruleset, saved: dict[str, str], proven: Proven | None = None,
          ) -> tuple[list[Drift], dict[str, set[str]], dict[str, set[str]]]:
    """Compare `applied` with iptables-save output per table. Returns the drifts, the chains to
    rewrite and the chains to delete (per table) that repair them. `proven` (kept by the caller
    between audits) remembers the chains found equal, so unchanged text is not compared again.

    The kernel's text is walked one chain at a time (chain_runs), never held as a list of its
    lines: those were the audit's peak, ~+40 MiB of the agent at 10,000 Services x 2 endpoints."""
    out: list[Drift] = []
    proven = {} if proven is None else proven
    rewrite: dict[str, set[str]] = {}
    delete: dict[str, set[str]] = {}
    for table in TABLE_ORDER:
        text = saved.get(table, "")
        try:
            found, rewrite[table], delete[table] = _table_drift(table, applied, chain_runs(text), proven)
        except SaveNotGrouped:  # a chain in two places: read the table whole (proven is rewritten)
            held = parse_save(text).get(table, {})
            found, rewrite[table], delete[table] = _table_drift(table, applied, held.items(), proven)
        out += found
    for key in [k for k in proven if k[1] not in applied.chains(k[0])]:
        del proven[key]  # chains deleted since: forget them
    return out, rewrite, delete


def audit(datapath: IptablesDatapath, repair: bool = False, memo: dict | None = None) -> AuditReport:
    """`memo`: a dict the caller keeps between audits of the same datapath (see Proven)."""
    applied = datapath.believed()
    if applied is None:
        raise AuditUnavailable("iptables datapath: no sync has completed yet, nothing to compare")
    saved = {table: datapath.save(table) for table in TABLE_ORDER}
    drifts, rewrite, delete = drift(applied, saved, memo.setdefault("proven", {}) if memo is not None else None)
    if not drifts:  # a fact about these two texts, kept for a restart's full sync (datapath/iptables/proof.py)
        datapath.record_proof(applied, saved)
    report = AuditReport(mode="iptables", drifts=drifts, checked={
        "chains": sum(len(applied.chains(t)) for t in TABLE_ORDER),
        "rules": sum(applied.rule_count(t) for t in TABLE_ORDER),
        "jumps": len(ch.JUMP_RULES),
    })
    if repair and drifts:
        report.writes = datapath.rewrite(rewrite, delete)
        report.repaired = True
    return report
