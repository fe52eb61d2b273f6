"""A clean drift audit's proof, kept across restarts, against the real kernel (root, both backends,
IPv4 and IPv6): a restarted agent's full sync restores no table the kernel still holds as the
audit proved it, and restores every table that anything has changed since (datapath/iptables/proof.py).
"""

from __future__ import annotations

import dataclasses
import json
import os

import pytest

from ebpf_proxy.datapath.iptables import IptablesDatapath
from ebpf_proxy.datapath.iptables.apply import run_command
from ebpf_proxy.explain.audit import audit
from ebpf_proxy.model import ChangeSet, ProxyState
from tests.lab.test_ip6tables_apply import FLAVOURS6, NODE6, rich_state6
from tests.lab.test_iptables_apply import (  # noqa: F401 - netns is a fixture
    FLAVOURS,
    NODE,
    WEB,
    ep,
    in_ns,
    kube_only,
    netns,
    rich_state,
)

pytestmark = [pytest.mark.root]

CASES = [(4, f) for f in sorted(FLAVOURS)] + [(6, f) for f in sorted(FLAVOURS6)]
IDS = [f"ipv{family}-{flavour}" for family, flavour in CASES]


def _commands(family: int, flavour: str) -> dict:
    return (FLAVOURS if family == 4 else FLAVOURS6)[flavour]


class Node:
    """One namespace, its commands and a proof directory: agents started (datapaths made) over it."""

    def __init__(self, ns: str, family: int, flavour: str, proof_dir: str) -> None:
        self.ns, self.family, self.flavour, self.proof_dir = ns, family, flavour, proof_dir
        self.config = NODE if family == 4 else NODE6
        self.calls: list[tuple[str, ...]] = []

    def _recording(self, cmd, stdin=None):
        self.calls.append(tuple(cmd))
        return run_command(cmd, stdin)

    def agent(self) -> IptablesDatapath:
        """A datapath as a (re)started agent has it: nothing in memory, the proof directory given."""
        self.calls.clear()
        return IptablesDatapath(self.config, netns=self.ns, runner=self._recording, proof_dir=self.proof_dir,
                                **_commands(self.family, self.flavour))

    def restores(self) -> int:
        return sum(1 for cmd in self.calls if any(word.endswith("-restore") for word in cmd))

    def save(self) -> dict:
        from ebpf_proxy.datapath.iptables.ruleset import parse_save

        command = _commands(self.family, self.flavour)["iptables_save"][0]
        return kube_only({t: parse_save(in_ns(self.ns, command, "-t", t)).get(t, {}) for t in ("nat", "filter")})

    def ipt(self, *args: str) -> str:
        return in_ns(self.ns, _commands(self.family, self.flavour)["iptables"][0], *args)


def _state(family: int) -> ProxyState:
    return rich_state() if family == 4 else rich_state6()


@pytest.fixture(params=CASES, ids=IDS)
def node(request, netns, tmp_path):
    family, flavour = request.param
    return Node(netns("prf"), family, flavour, str(tmp_path / "proofs"))


def _proved(node: Node) -> IptablesDatapath:
    """An agent that synced and audited clean: the proof is on disk."""
    first = node.agent()
    first.sync(_state(node.family), ChangeSet())
    report = audit(first)
    assert report.clean, "\n".join(report.lines())
    path = os.path.join(node.proof_dir, f"proven-{node.config.node_name}-ipv{node.family}.json")
    assert set(json.load(open(path))["tables"]) == {"filter", "nat"}
    return first


def test_a_restart_over_the_proved_kernel_restores_nothing(node):
    _proved(node)
    before = node.save()
    restarted = node.agent()
    restarted.prefetch()
    result = restarted.sync(_state(node.family), ChangeSet())
    assert result.counts["tables_proven"] == 2 and result.counts["chains_written"] == 0
    assert node.restores() == 0, node.calls
    assert node.save() == before
    assert audit(restarted).clean  # the restarted agent believes what the kernel holds
    # and its own partial syncs go on from there
    moved = _state(node.family)
    addr = "10.244.9.9" if node.family == 4 else "fd00:10:244:9::9"
    moved = dataclasses.replace(moved, endpoints={**moved.endpoints, WEB: (*moved.endpoints[WEB], ep(addr, 8080))})
    assert restarted.sync(moved, ChangeSet(full=False, services=frozenset({WEB}))).counts["chains_written"] > 0
    assert audit(restarted).clean


def test_without_a_proof_every_table_is_restored_and_no_save_digested(node, monkeypatch):
    from ebpf_proxy.datapath.iptables import datapath as iptables_datapath

    digested: list[int] = []
    real = iptables_datapath.kernel_digest
    monkeypatch.setattr(iptables_datapath, "kernel_digest", lambda text: digested.append(len(text)) or real(text))
    first = node.agent()
    first.sync(_state(node.family), ChangeSet())  # no audit: nothing proved
    restarted = node.agent()
    restarted.prefetch()
    result = restarted.sync(_state(node.family), ChangeSet())
    assert result.counts["tables_proven"] == 0 and node.restores() == 1
    assert digested == [], "a save digested with no proof to compare it with"


def test_a_rule_edited_since_the_proof_is_written_back(node):
    first = _proved(node)
    before = node.save()
    svc_chain = next(c for c in first.believed().chains("nat") if c.startswith("KUBE-SVC-"))
    node.ipt("-t", "nat", "-D", svc_chain, "1")  # someone edits our chain; nothing audits it before the restart
    restarted = node.agent()
    result = restarted.sync(_state(node.family), ChangeSet())
    assert result.counts["tables_proven"] == 1  # filter: untouched, still proved
    assert node.restores() == 1
    assert node.save() == before
    assert audit(restarted).clean


def test_a_chain_left_since_the_proof_is_deleted(node):
    _proved(node)
    before = node.save()
    node.ipt("-t", "nat", "-N", "KUBE-SEP-STRAYSTRAYSTRAY1")
    restarted = node.agent()
    result = restarted.sync(_state(node.family), ChangeSet())
    assert result.counts["tables_proven"] == 1 and result.counts["chains_deleted"] == 1
    assert node.save() == before


def test_a_service_changed_while_the_agent_was_down_is_written(node):
    _proved(node)
    changed = _state(node.family)
    changed = dataclasses.replace(changed, endpoints={k: v for k, v in changed.endpoints.items() if k != WEB})
    restarted = node.agent()
    result = restarted.sync(changed, ChangeSet())
    assert result.counts["tables_proven"] == 0  # both tables hold WEB's rules
    assert node.restores() == 1
    assert audit(restarted).clean


def test_a_drifted_audit_proves_nothing(node):
    first = _proved(node)
    path = os.path.join(node.proof_dir, f"proven-{node.config.node_name}-ipv{node.family}.json")
    kept = open(path).read()
    node.ipt("-t", "filter", "-A", "KUBE-FIREWALL", "-j", "ACCEPT")
    assert not audit(first, repair=False).clean
    assert open(path).read() == kept  # the old proof: about the old text, which no longer matches
    restarted = node.agent()
    assert restarted.sync(_state(node.family), ChangeSet()).counts["tables_proven"] == 1  # nat only
    assert audit(restarted).clean


def test_an_auto_detected_backend_digests_the_save_it_detected_from(node):
    """With --iptables-backend auto the first full sync reads the kernel from the detection's save
    of every table (one text, cut per table), not from a save of each table: the same digests."""
    _proved(node)
    node.calls.clear()
    restarted = IptablesDatapath(node.config, netns=node.ns, runner=node._recording, proof_dir=node.proof_dir,
                                 backend="auto")
    result = restarted.sync(_state(node.family), ChangeSet())
    assert result.counts["tables_proven"] == 2 and node.restores() == 0, node.calls
    assert not any(cmd[-2:] in (("-t", "nat"), ("-t", "filter")) for cmd in node.calls), "read from the detection"
    assert audit(restarted).clean
