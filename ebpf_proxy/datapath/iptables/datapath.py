"""The iptables datapath: kube-proxy's iptables mode, as the fallback and the reference for eBPF.

A sync renders the desired ruleset (render.py), works out which chains must change
(ruleset.py) and applies them in one `iptables-restore --noflush` (apply.py), then clears stale
UDP conntrack entries (conntrack.py).

Partial syncs, as kube-proxy's: the datapath remembers the ruleset it last applied and the
per-service fragments it was built from. For a partial ChangeSet it re-renders only the listed
service ports, reassembles, and sends only the chains whose text differs from what the kernel
already has, plus `-X` for chains that disappeared. Any failure forgets that memory, so the
next sync is a full one whatever the ChangeSet says: after a failed restore nobody knows what
the kernel holds. A full sync also (re)ensures the jumps from the built-in chains and collects
per-service chains left by earlier runs, from iptables-save. A table the drift audit proved
the kernel holds, as this very ruleset, is not restored on a full sync at all (proof.py): an
agent restarted over an unchanged cluster writes nothing.

One datapath serves one IP family, its NodeConfig's (`node.family`), as kube-proxy runs one
proxier per family: IPv4 drives iptables, IPv6 ip6tables (each backend's own variants), and
sync, cleanup, installed and the conntrack cleanup all stay within that family.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import NamedTuple

from ebpf_proxy.datapath.base import Datapath, SyncResult
from ebpf_proxy.datapath.iptables import chains as ch
from ebpf_proxy.datapath.iptables.apply import IptablesCommands, Runner, Sysctls, run_command
from ebpf_proxy.datapath.iptables.backend import Detected, detect_reading, family_commands
from ebpf_proxy.datapath.iptables.backend import commands as backend_commands
from ebpf_proxy.datapath.iptables.conntrack import ConntrackCleaner, stale_filters
from ebpf_proxy.datapath.iptables.proof import ProofFile, kernel_digest, ruleset_digest
from ebpf_proxy.datapath.iptables.render import (
    RenderContext,
    ServiceRules,
    assemble,
    is_large_cluster,
    render_fragments,
)
from ebpf_proxy.datapath.iptables.ruleset import (
    TABLE_ORDER,
    RestorePlan,
    Ruleset,
    full_plan,
    parse_save,
    partial_plan,
    saved_chains,
    table_sections,
)
from ebpf_proxy.model import ChangeSet, NodeConfig, ProxyState, ServicePortName

log = logging.getLogger(__name__)

ROUTE_LOCALNET = "net.ipv4.conf.all.route_localnet"
TCP_BE_LIBERAL = "net.netfilter.nf_conntrack_tcp_be_liberal"
# a save read ahead (prefetch) older than this when the first full sync starts is read again
SAVE_AHEAD_MAX_AGE_SECONDS = 10.0
_MAX_DUPLICATE_JUMPS = 100  # bound on deleting the same jump rule repeatedly in cleanup()


class Held(NamedTuple):
    """What a full sync reads of the kernel: table -> chain -> rules (of the chains our jumps go
    in; [] for the others), and table -> kernel_digest of its save (proof.py)."""

    chains: dict[str, dict[str, list[str]]]
    digests: dict[str, str]


def _status_and_output(runner: Runner, cmd: Sequence[str]) -> tuple[int, str]:
    try:
        result = runner(cmd, None)
    except OSError as exc:  # not installed, not executable
        return 1, str(exc)
    return result.returncode, result.stdout or ""


class IptablesDatapath(Datapath):
    """kube-proxy's iptables mode behind the Datapath interface.

    `netns` runs every command (and the conntrack socket) in that named network namespace,
    through `nsenter --net` (no mount-namespace games, unlike `ip netns exec`); `command_prefix` overrides that prefix for the commands. The
    command tuples choose the iptables flavour (e.g. `("iptables-legacy-restore",)`); without them,
    `backend` (auto, legacy, nft, default) does, auto as kube-proxy's iptables-wrapper (backend.py),
    among the commands of `node.family` (ip6tables-legacy-restore, ... for IPv6).
    `proof_dir`: where the drift audit's proofs are kept across restarts (proof.py), one file
    per node and family; None keeps none, and every full sync restores every table.
    `runner` and `conntrack` are injectable for tests.
    """

    mode = "iptables"

    def __init__(
        self,
        node: NodeConfig,
        *,
        iptables_restore: Sequence[str] | None = None,
        iptables_save: Sequence[str] | None = None,
        iptables: Sequence[str] | None = None,
        backend: str | None = None,
        netns: str | None = None,
        command_prefix: Sequence[str] | None = None,
        conntrack: ConntrackCleaner | None = None,
        runner: Runner | None = None,
        proof_dir: str | None = None,
    ) -> None:
        super().__init__(node)
        RenderContext.for_node(node)  # fail at construction on a config the renderer cannot express
        if command_prefix is None:
            command_prefix = ("nsenter", f"--net=/run/netns/{netns}") if netns else ()
        self._prefix = tuple(command_prefix)
        self._runner = runner
        # the sysctls need no iptables backend: read without waiting for the detection (_cmd), so a
        # restart's first full sync renders while the detection's thread still reads its saves
        self._sysctls = Sysctls(prefix=self._prefix, runner=runner)
        self._given = {"iptables": iptables, "iptables_save": iptables_save, "iptables_restore": iptables_restore}
        self._commands: IptablesCommands | None = None
        self._commands_set = threading.Event()
        self._save_ahead: _SaveAhead | None = None
        if all(self._given.values()):
            self._set_commands({})
        else:
            # an injected runner (tests) gets the system's plain commands unless told otherwise
            chosen = backend or ("default" if runner is not None else "auto")
            if chosen == "auto":
                family_commands(node.family)  # a family with no commands fails here, not in the thread
                # decided in a thread, from saves of each backend (~0.3 s at 10,000 Services,
                # while the agent lists); what needs the commands waits for it (_cmd), and
                # the first full sync reads the chains from the chosen backend's save
                self._save_ahead = _SaveAhead(self._detect_and_read, name="iptables-backend")
            else:
                self._set_commands(backend_commands(chosen, self._run_for_output, self._prefix, family=node.family))
        self._conntrack = conntrack if conntrack is not None else ConntrackCleaner(netns, family=node.family)
        self._applied: Ruleset | None = None  # what the kernel holds after our last successful restore
        self._fragments: dict[ServicePortName, ServiceRules] = {}
        self._ctx: RenderContext | None = None
        self._state: ProxyState | None = None
        self._drop_invalid = True
        self._proof = ProofFile(os.path.join(proof_dir, f"proven-{node.node_name}-ipv{node.family}.json")
                                if proof_dir else None)
        self._proved: dict[str, tuple[str, str]] | None = None  # what the file holds, once read or written
        self._digested: tuple[Ruleset, dict[str, str]] | None = None  # a ruleset and its digests, per table

    def _run_for_output(self, cmd: Sequence[str]) -> tuple[int, str]:
        return _status_and_output(self._runner or run_command, cmd)

    def _set_commands(self, found: Mapping[str, tuple[str, ...]]) -> None:
        """Use the backend's command tuples `found`, where the constructor was not given its own."""
        given = {key: value or found[key] for key, value in self._given.items()}
        self._commands = IptablesCommands(
            iptables=given["iptables"],
            iptables_save=given["iptables_save"],
            iptables_restore=given["iptables_restore"],
            prefix=self._prefix,
            runner=self._runner,
        )
        self._commands_set.set()

    @property
    def _cmd(self) -> IptablesCommands:
        """The commands of the backend in use; with backend auto, once the detection has chosen."""
        self._commands_set.wait()
        assert self._commands is not None
        return self._commands

    def _detect_and_read(self) -> Held:
        """Choose the backend as kube-proxy's iptables-wrapper does (backend.py), then read the
        existing chains and digests (_read_held) from the save of every table the choice was made from."""
        commands = family_commands(self.node.family)
        detected = Detected("default")
        try:
            detected = detect_reading(self._run_for_output, self._prefix, self.node.family)
        except Exception:  # not seen: each command's failure already counts as "no rules there"
            log.warning("iptables datapath: the backend detection failed; the system's default "
                        "iptables commands are used", exc_info=True)
        finally:  # whatever happens, the commands are set: a sync must never wait for ever
            self._set_commands(commands[detected.backend])
        if detected.save is None:
            return self._read_held()
        return self._held(table_sections(detected.save))

    def prefetch(self) -> None:
        """Read the first full sync's iptables-save now, in a thread, while the agent still lists:
        the save and its reading are ~0.2 s of a restart's sync at 10,000 Services, otherwise
        between the render and the restore. Taken if at most SAVE_AHEAD_MAX_AGE_SECONDS old
        when that sync starts (else read again); a chain or jump someone changes in between is
        put right by the next full sync, and found by the drift audit before that. With backend
        auto, the detection's thread has done this already (_detect_and_read)."""
        if self._applied is None and self._save_ahead is None:
            self._save_ahead = _SaveAhead(self._read_held)

    # -- sync -----------------------------------------------------------------------------

    def sync(self, state: ProxyState, changes: ChangeSet) -> SyncResult:
        full = changes.full or self._applied is None
        proven: frozenset[str] = frozenset()
        try:
            if full:
                self._prepare_node()
            ctx = RenderContext.for_node(
                self.node, drop_invalid=self._drop_invalid, large_cluster=is_large_cluster(state)
            )
            fragments = self._fragments_for(ctx, state, changes, full)
            ruleset = assemble(ctx, fragments)
            if full:
                ahead, self._save_ahead = self._save_ahead, None
                held = (ahead and ahead.take(SAVE_AHEAD_MAX_AGE_SECONDS)) or self._read_held()
                self._ensure_jumps(held.chains)
                proven = self._proven_tables(ruleset, held.digests)
                plan = full_plan(ruleset, {t: set(c) for t, c in held.chains.items()}, proven=proven)
            else:
                assert self._applied is not None
                plan = partial_plan(self._applied, ruleset)
            if not plan.empty:
                text = plan.text(ruleset)
                self.report_progress(0.5)  # rendered; one iptables-restore, atomic per table, to go
                self._cmd.restore(text)
        except Exception:
            self._forget()
            raise
        self._applied, self._fragments, self._ctx = ruleset, fragments, ctx
        previous, self._state = self._state, state

        counts = {
            "full_sync": int(full),
            "tables_proven": len(proven),
            "chains_written": plan.count("write"),
            "chains_deleted": plan.count("delete"),
            **self.stats(),
            "conntrack_deleted": 0,
        }
        filters = stale_filters(changes, state, previous, family=self.node.family)
        if filters:
            try:
                counts["conntrack_deleted"] = self._conntrack.delete(filters)
            except Exception:  # like kube-proxy: logged, the rules are in place regardless
                log.exception("iptables datapath: clearing %d stale UDP conntrack selectors failed", len(filters))
                counts["conntrack_errors"] = 1
        log.debug("iptables sync: %s", counts)
        return SyncResult(counts=counts)

    def _fragments_for(
        self, ctx: RenderContext, state: ProxyState, changes: ChangeSet, full: bool
    ) -> dict[ServicePortName, ServiceRules]:
        """Re-render everything on a full sync or when node-wide facts changed; else only what changed.

        Service ports that appear in `state` without a fragment are rendered too, and fragments
        of ports gone from `state` dropped, so an incomplete ChangeSet cannot leave a service out.
        """
        if full or ctx != self._ctx:
            return render_fragments(ctx, state)
        fragments = {n: f for n, f in self._fragments.items() if n in state.services and n not in changes.services}
        todo = set(changes.services) | (state.services.keys() - self._fragments.keys())
        fragments.update(render_fragments(ctx, state, todo))
        return fragments

    def _prepare_node(self) -> None:
        """Node settings kube-proxy makes at start: route_localnet for localhost NodePorts (IPv4
        only: an IPv4 sysctl, and IPv6 has no localhost NodePorts), and whether
        nf_conntrack_tcp_be_liberal spares us the INVALID-drop rule."""
        liberal = self._sysctls.get(TCP_BE_LIBERAL)
        self._drop_invalid = liberal in (None, "0")
        if (self.node.family == 4 and RenderContext.for_node(self.node).localhost_nodeports
                and self._sysctls.get(ROUTE_LOCALNET) != "1"):
            self._sysctls.set(ROUTE_LOCALNET, "1")

    def _read_held(self) -> Held:
        """Held, from an iptables-save of each table."""
        return self._held({table: self._cmd.save(table) for table in TABLE_ORDER})

    def _held(self, saved: Mapping[str, str]) -> Held:
        """Held, from the iptables-save text of each table (table -> text; a table missing has not
        been made in this namespace yet, so it holds no chain of ours)."""
        return Held({table: saved_chains(saved.get(table, ""), ch.JUMP_CHAINS[table]) for table in TABLE_ORDER},
                    {table: kernel_digest(saved.get(table, "")) for table in self._proved_tables()})

    # -- proofs (proof.py) ---------------------------------------------------------------------

    def _digests(self, ruleset: Ruleset) -> dict[str, str]:
        """ruleset_digest of each table of `ruleset`, computed once per ruleset."""
        if self._digested is None or self._digested[0] is not ruleset:
            self._digested = (ruleset, {table: ruleset_digest(ruleset, table) for table in TABLE_ORDER})
        return self._digested[1]

    def _proved_tables(self) -> tuple[str, ...]:
        """The tables a proof is kept for (read from the file once): the only ones whose save is
        digested (~8 ms per MB of it: ~3 s at 100,000 Services x 10 endpoints, for nothing on a
        node no audit has proved yet)."""
        if self._proof.path is None:
            return ()
        if self._proved is None:
            self._proved = self._proof.load()
        return tuple(t for t in TABLE_ORDER if t in self._proved)

    def _proven_tables(self, ruleset: Ruleset, kernel: Mapping[str, str]) -> frozenset[str]:
        """The tables the kernel is proved to hold as `ruleset` (proof.py): not to be restored."""
        proved = self._proved_tables()
        if not proved:
            return frozenset()
        assert self._proved is not None
        ours = self._digests(ruleset)
        return frozenset(t for t in proved if t in kernel and self._proved.get(t) == (ours[t], kernel[t]))

    def record_proof(self, ruleset: Ruleset, saved: Mapping[str, str]) -> bool:
        """The drift audit found the kernel's `saved` text (table -> iptables-save of it) doing what
        `ruleset` says, every table: keep that fact for a restart's full sync. True when kept
        (or already kept)."""
        if self._proof.path is None:
            return False
        ours = self._digests(ruleset)
        proved = {table: (ours[table], kernel_digest(saved.get(table, ""))) for table in TABLE_ORDER}
        if proved == self._proved:
            return True
        if not self._proof.store(proved):
            return False
        self._proved = proved
        return True

    def _existing(self, every_rule: bool = False) -> dict[str, dict[str, list[str]]]:
        """table -> every chain iptables-save shows now -> its rules: with `every_rule`, of every
        chain; else of the built-in chains our jumps go in only ([] for the others: a full sync
        needs their names, not their ~100,000 lines at 10,000 Services)."""
        out: dict[str, dict[str, list[str]]] = {}
        for table in TABLE_ORDER:
            text = self._cmd.save(table)
            out[table] = parse_save(text).get(table, {}) if every_rule else saved_chains(text, ch.JUMP_CHAINS[table])
        return out

    def _ensure_jumps(self, existing: dict[str, dict[str, list[str]]]) -> None:
        """Create our top-level chains if missing, then insert each missing jump at the top of its
        built-in chain (kube-proxy's EnsureChain/EnsureRule(Prepend)); built-in chains are never flushed.

        A jump the save just read holds, spelled as iptables-save prints it, is there; only the
        others are asked about with `iptables -C` (each of those reads the whole table from the
        kernel: ~0.12 s for the nat table at 10,000 Services, three of them in a restart's sync)."""
        for table, names in ch.TOP_LEVEL_CHAINS.items():
            for chain in names:
                if chain not in existing.get(table, {}):
                    self._cmd.new_chain(table, chain)
                    existing.setdefault(table, {})[chain] = []
        for jump in ch.JUMP_RULES:
            if jump.saved_line in existing.get(jump.table, {}).get(jump.chain, ()):
                continue
            if not self._cmd.rule_exists(jump.table, jump.chain, jump.rule_args):
                self._cmd.insert_rule(jump.table, jump.chain, jump.rule_args)

    # -- drift audit (explain/audit_iptables.py) ----------------------------------------------

    def believed(self) -> Ruleset | None:
        """The ruleset the kernel should hold since the last successful sync (None: none yet)."""
        return self._applied

    def save(self, table: str) -> str:
        """iptables-save of `table`, as the kernel holds it now."""
        return self._cmd.save(table)

    def rewrite(self, write: Mapping[str, Iterable[str]], delete: Mapping[str, Iterable[str]]) -> int:
        """Repair drift: restore chains of the applied ruleset (`write`, per table), delete stray
        per-service chains (`delete`), and insert missing jumps from the built-in chains.
        Returns the chains written and deleted plus the jumps inserted."""
        if self._applied is None:
            return 0
        plan = RestorePlan(write={t: tuple(sorted(c for c in write.get(t, ()) if c in self._applied.chains(t)))
                                  for t in TABLE_ORDER},
                           delete={t: tuple(sorted(c for c in delete.get(t, ()) if ch.is_service_chain(c)))
                                   for t in TABLE_ORDER})
        try:
            if not plan.empty:
                self._cmd.restore(plan.text(self._applied))
            jumps = 0
            for jump in ch.JUMP_RULES:
                if not self._cmd.rule_exists(jump.table, jump.chain, jump.rule_args):
                    self._cmd.insert_rule(jump.table, jump.chain, jump.rule_args)
                    jumps += 1
        except Exception:
            self._forget()  # the next sync is a full one
            raise
        return plan.count("write") + plan.count("delete") + jumps

    def _forget(self) -> None:
        self._applied = None
        self._fragments = {}
        self._ctx = None

    # -- cleanup, stats, close ---------------------------------------------------------------

    def cleanup(self) -> None:
        """Remove every jump and KUBE-* chain this mode installs, in nat and filter (idempotent),
        of this datapath's IP family (its iptables or ip6tables commands) only.

        Like `kube-proxy --cleanup`, plus KUBE-MARK-MASQ and KUBE-FIREWALL: the lab has no kubelet
        sharing them. A chain still referenced by a rule we do not own is left alone (flushing or
        deleting it would break, or fail on, that other rule).
        """
        for jump in ch.JUMP_RULES:
            for _ in range(_MAX_DUPLICATE_JUMPS):
                if not self._cmd.rule_exists(jump.table, jump.chain, jump.rule_args):
                    break
                self._cmd.delete_rule(jump.table, jump.chain, jump.rule_args)
        existing = self._existing(every_rule=True)  # who else jumps into our chains
        delete: dict[str, tuple[str, ...]] = {}
        for table in TABLE_ORDER:
            chains = existing.get(table, {})
            ours = {c for c in chains if _ours(table, c)}
            referenced_by_others = {
                target
                for chain, rules in chains.items()
                if chain not in ours
                for rule in rules
                for target in _jump_targets(rule)
            }
            delete[table] = tuple(sorted(ours - referenced_by_others))
            for chain in sorted(ours & referenced_by_others):
                log.warning("cleanup: %s chain %s is still used by another rule; left in place", table, chain)
        plan = RestorePlan(delete=delete)
        if not plan.empty:
            self._cmd.restore(plan.text(Ruleset(tables={})))
        self._forget()
        self._state = None

    def installed(self) -> bool:
        """Whether a chain this mode installs is there (ours, or kube-proxy's: the same names), in
        this datapath's IP family."""
        existing = self._existing()
        return any(_ours(table, c) for table in TABLE_ORDER for c in existing.get(table, {}))

    def stats(self) -> dict[str, int]:
        """Rules in the last applied ruleset (what kube-proxy's sync_proxy_rules_iptables_total counts)."""
        applied = self._applied
        return {
            "iptables_rules_nat": applied.rule_count(ch.NAT) if applied else 0,
            "iptables_rules_filter": applied.rule_count(ch.FILTER) if applied else 0,
        }

    def close(self) -> None:
        """Nothing to release: the rules stay, so Services keep working while the agent restarts."""


class _SaveAhead:
    """A read of the kernel (IptablesDatapath._read_held) run in a thread of its own."""

    def __init__(self, read: Callable[[], Held], name: str = "iptables-save-ahead") -> None:
        self._done = threading.Event()
        self._result: Held | None = None
        self._finished = 0.0
        threading.Thread(target=self._run, args=(read,), name=name, daemon=True).start()

    def _run(self, read: Callable[[], Held]) -> None:
        try:
            self._result = read()
        except Exception:  # the sync reads again, and reports what fails then
            log.debug("iptables datapath: reading the chains ahead failed", exc_info=True)
        finally:
            self._finished = time.monotonic()
            self._done.set()

    def take(self, max_age: float) -> Held | None:
        """The chains read (waiting for the read to end), or None if it failed or is older than `max_age` s."""
        self._done.wait()
        if self._result is None or time.monotonic() - self._finished > max_age:
            return None
        return self._result


def _ours(table: str, chain: str) -> bool:
    """Whether `chain` of `table` is one this mode installs (or kube-proxy: the same names)."""
    return chain in ch.TOP_LEVEL_CHAINS[table] or ch.is_service_chain(chain)


def _jump_targets(rule: str) -> list[str]:
    tokens = rule.split()
    return [tokens[i + 1] for i, tok in enumerate(tokens[:-1]) if tok in ("-j", "-g", "--jump", "--goto")]
