"""kill -9 of an agent in the middle of a full sync of many Services, then restart (issue 13, part 3).

On the lab of topology_killsync.yaml, with fresh connections going without pause to a stable
Service through worker1's datapath (its ClusterIP from a pod on worker1, its NodePort from
outside through worker1): EPX_KILLSYNC_SERVICES Services (default 10,000; bench fillers: two
phantom endpoints each) are created and programmed; worker1's agent is stopped, every fifth of
them gets both its endpoints replaced (a change the ebpf datapath writes with a slot-bank swap),
and the agent is started again, so its first sync is a full sync over all of them, a fifth of
them changed. When /metrics says that sync is half written (`lab agent worker1 kill --during
full-sync --at 0.5`), it gets SIGKILL. Then:

- right after the kill, nothing is half-programmed: in ebpf mode every frontend's chain
  (record -> slots of its bank -> backends) is complete, and every changed Service's ClusterIP
  leads to exactly its old two endpoints or its new two, never one of each; in iptables mode the
  same holds of each changed Service's DNAT targets (all old or all new: iptables-restore is
  atomic per table), and every jump of KUBE-SERVICES leads to a chain that exists;
- a new agent is started over what the dead one left; it converges: its kernel holds exactly
  what worker2's (never killed) holds, and its drift audit (`lab audit`) finds nothing;
- no connection to the stable Service failed during any of it, and its entries were never
  rewritten (ebpf: its epx_svc records, slots and backends are byte for byte those of before);
- printed (-s): the progress at the kill, the restart's time to healthy and to converged, the
  map writes or chains its first sync made, failed connections.
"""

from __future__ import annotations

import os
import re
import time

import pytest

from ebpf_proxy.bench.rest import Rest
from ebpf_proxy.bench import ports
from ebpf_proxy.bench.services import CHURN_RANGE, filler_name, filler_slice, range_address, service_object, slice_object
from ebpf_proxy.datapath.ebpf import adopt
from ebpf_proxy.datapath.ebpf.maps import Maps, entry_counts, frontend_backends
from ebpf_proxy.lab import agent_fault
from ebpf_proxy.lab import audit as lab_audit
from ebpf_proxy.lab.prober import Prober
from tests.e2e.conftest import E2E_MODES, _lab
from tests.e2e.scenario_runner import HERE

pytestmark = [pytest.mark.root, pytest.mark.e2e]

SERVICES = int(os.environ.get("EPX_KILLSYNC_SERVICES", "10000"))
CHANGED_EVERY = 5  # every fifth Service has its endpoints replaced while the agent is down
VICTIM, OTHER = "worker1", "worker2"
WEB_NODE_PORT = 31600
READY_TIMEOUT = 240.0  # a first sync of 10,000 Services on a loaded 2-core machine


def web_service() -> dict:
    return {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "web", "namespace": "default"},
            "spec": {"type": "NodePort", "selector": {"app": "web"},
                     "ports": [{"name": "http", "port": 80, "targetPort": 80, "nodePort": WEB_NODE_PORT}]}}


@pytest.fixture(scope="module", params=E2E_MODES)
def lab(request):
    for lab in _lab(f"ks{request.param[:3]}{os.getpid() % 10000}", str(HERE / "topology_killsync.yaml"),
                    request.param):
        api = lab.api()
        try:
            api.apply(web_service())
        finally:
            api.close()
        lab.wait_converged()
        yield lab


def create_services(lab, count: int) -> float:
    """`count` bench fillers (ClusterIP, two phantom endpoints each), as fast as the API server
    takes them. Returns the seconds it took."""
    rest = Rest(lab.data["apiserver"]["url"])
    nodes = [n.name for n in lab.topology.nodes]
    started = time.monotonic()

    def create(index: int) -> None:  # what BenchServices does for a filler, without the bench's pods
        rest.create(service_object(filler_name(index), "filler"))
        rest.create(filler_slice(index, 2, nodes))

    rest.map(create, range(count), threads=4)
    return time.monotonic() - started


def endpoints_of(index: int, changed: bool, nodes: list[str]) -> list[tuple[str, str]]:
    """Filler `index`'s two endpoints (ip, node): the bench's phantom addresses, or after the
    change two never used before (from the bench's churn range)."""
    if not changed:
        return [(e["addresses"][0], e["nodeName"]) for e in filler_slice(index, 2, nodes)["endpoints"]]
    return [(range_address(CHURN_RANGE, 2 * index + j), nodes[(index + j) % len(nodes)]) for j in range(2)]


def change_services(lab, indexes: range) -> float:
    """Replace both endpoints of the fillers `indexes`. Returns the seconds it took."""
    rest = Rest(lab.data["apiserver"]["url"])
    nodes = [n.name for n in lab.topology.nodes]
    started = time.monotonic()
    rest.map(lambda i: rest.replace(slice_object(filler_name(i), "filler", endpoints_of(i, True, nodes),
                                                 ports.FILLER_PORT)), indexes, threads=4)
    return time.monotonic() - started


def mixed_services(lab, node: str, indexes: range) -> tuple[list[str], int]:
    """The changed fillers whose ClusterIP leads, in `node`'s maps, to neither exactly the old
    endpoints nor exactly the new ones; and how many of them already lead to the new ones."""
    rest = Rest(lab.data["apiserver"]["url"])
    nodes = [n.name for n in lab.topology.nodes]
    cluster_ips = {s["metadata"]["name"]: s["spec"]["clusterIP"] for s in rest.list("Service")}
    bad, new = [], 0
    for i in indexes:
        held = frontend_backends(lab.dir / "bpffs" / node, cluster_ips[filler_name(i)], ports.SERVICE_PORT)
        old_set, new_set = ({(ip, ports.FILLER_PORT) for ip, _ in endpoints_of(i, c, nodes)} for c in (False, True))
        if held == new_set:
            new += 1
        elif held != old_set:
            bad.append(f"{filler_name(i)}: {held}")
    return bad, new


def mixed_in_rules(save: str, indexes: range, nodes: list[str]) -> tuple[list[str], int]:
    """mixed_services() for an iptables-save of the nat table: the DNAT targets of each changed
    filler's endpoint chains are its old two or its new two."""
    targets = set(re.findall(r"--to-destination (\d+\.\d+\.\d+\.\d+):" + str(ports.FILLER_PORT), save))
    bad, new = [], 0
    for i in indexes:
        old_ips, new_ips = ({ip for ip, _ in endpoints_of(i, c, nodes)} for c in (False, True))
        if new_ips <= targets and not old_ips & targets:
            new += 1
        elif not (old_ips <= targets and not new_ips & targets):
            bad.append(f"{filler_name(i)}: old {sorted(old_ips & targets)}, new {sorted(new_ips & targets)}")
    return bad, new


def pin_dir(lab, node: str):
    return lab.dir / "bpffs" / node / "ebpf-proxy"


def web_entries(lab, node: str, cluster_ip: str) -> dict:
    """The stable Service's entries in `node`'s maps, raw: its frontends' records, its slots, its backends."""
    maps = Maps.open_pinned(pin_dir(lab, node))
    try:
        snap = adopt.read(maps)
        svc_ids = {rec.id for fe, rec in snap.records.items() if fe.addr == cluster_ip or (fe.addr is None and fe.port == WEB_NODE_PORT)}
        slots = {k: v for k, v in snap.slots.items() if k[0] in svc_ids}
        return {"records": {fe: rec for fe, rec in snap.records.items() if rec.id in svc_ids}, "slots": slots,
                "backends": {bid: snap.backends.get(bid) for bid in slots.values()}}
    finally:
        maps.close()


def dangling_jumps(save: str) -> list[str]:
    """KUBE-SERVICES / KUBE-NODEPORTS jumps (and KUBE-SVC-* rules) to chains the table does not define."""
    defined = set(re.findall(r"^:(\S+)", save, re.M))
    targets = re.findall(r"^-A (KUBE-(?:SERVICES|NODEPORTS|SVC-\S+|EXT-\S+)) .*-j (KUBE-\S+)", save, re.M)
    return [f"{chain} -> {target}" for chain, target in targets if target not in defined]


def kernel_size(lab, node: str) -> dict[str, int]:
    if lab.mode == "ebpf":
        counts = entry_counts(lab.dir / "bpffs" / node)
        return {k: counts[k] for k in ("epx_svc", "epx_slot", "epx_backend", "epx_src_range")}
    save = lab.iptables_save(node, "nat")
    return {"KUBE-SVC chains": len(re.findall(r"^:KUBE-SVC-", save, re.M)),
            "KUBE-SEP chains": len(re.findall(r"^:KUBE-SEP-", save, re.M)),
            "nat rules": len(re.findall(r"^-A ", save, re.M))}


def first_sync_line(log: str) -> str:
    for line in log.splitlines():
        if " synced " in line or line.rstrip().endswith(" synced"):
            return line
    return ""


def test_kill_during_a_full_sync_leaves_nothing_half_programmed_and_the_restart_converges(lab):
    api = lab.api()
    try:
        cluster_ip = api.get("Service", "web")["spec"]["clusterIP"]
    finally:
        api.close()
    victim_ip = lab.topology.node(VICTIM).ip
    web_before = web_entries(lab, VICTIM, cluster_ip) if lab.mode == "ebpf" else None
    targets = [("client-1", f"{cluster_ip}:80"), ("outside", f"{victim_ip}:{WEB_NODE_PORT}")]

    with Prober(lab, targets) as prober:
        # Both agents follow the creation as it happens (as worker2 always did), so the victim's
        # kernel holds every Service's old endpoints without a full sync of its own for that: the
        # full sync that matters is the one of the start below, the one the kill interrupts.
        took_create = create_services(lab, SERVICES)
        created = time.monotonic()
        lab.wait_converged(timeout=READY_TIMEOUT)  # both agents have programmed them all: the "old" state
        took_programmed = time.monotonic() - created
        lab.stop_agent(VICTIM)  # SIGTERM: the datapath stays; the next start is a full sync of everything
        changed = range(0, SERVICES, CHANGED_EVERY)
        took_change = change_services(lab, changed)
        change_written = time.monotonic()
        lab.wait_converged(timeout=READY_TIMEOUT)  # worker2 (the reference) has them all
        took_reference = time.monotonic() - change_written
        lab.start_agent(VICTIM, wait=False)
        killed = agent_fault.kill(lab, VICTIM, during="full-sync", at=0.5, timeout=READY_TIMEOUT)

        # what the kill left
        if lab.mode == "ebpf":
            maps = Maps.open_pinned(pin_dir(lab, VICTIM))
            try:
                broken = adopt.broken_chains(maps)
            finally:
                maps.close()
            mixed, changed_new = mixed_services(lab, VICTIM, changed)
            broken += mixed
        else:
            save = lab.iptables_save(VICTIM, "nat")
            mixed, changed_new = mixed_in_rules(save, changed, [n.name for n in lab.topology.nodes])
            broken = dangling_jumps(save) + mixed
        left = kernel_size(lab, VICTIM)
        assert not broken, broken[:10]

        log_from = len(lab.logs(VICTIM))
        restarted = time.monotonic()
        lab.start_agent(VICTIM, wait=False)
        lab.wait_agent_ready(VICTIM, timeout=READY_TIMEOUT)
        healthy = time.monotonic() - restarted
        lab.wait_converged(timeout=READY_TIMEOUT)
        converged = time.monotonic() - restarted
        time.sleep(1.0)  # a last round of probes after convergence
    restart_sync = first_sync_line(lab.logs(VICTIM)[log_from:])
    written = re.search(r"'(map_writes|chains_written)': (\d+)", restart_sync)

    victim, reference = kernel_size(lab, VICTIM), kernel_size(lab, OTHER)
    audit = lab_audit.run(lab, [VICTIM])[VICTIM]
    changes = f"{len(changed)} changed in {took_change:.1f}s ({changed_new} already new, the rest old, 0 mixed, at the kill)"
    print(f"\n[{lab.mode}] {SERVICES} Services created in {took_create:.1f}s, both agents converged on them "
          f"{took_programmed:.1f}s later, {OTHER} converged on the changes {took_reference:.1f}s after them, "
          f"{changes}; {VICTIM}'s agent killed "
          f"{killed.progress.fraction:.0%} into its full sync ({killed.waited:.1f}s after start), leaving {left}; "
          f"0 broken chains; restarted: healthy after {healthy:.1f}s, converged after {converged:.1f}s; "
          f"kernel {victim} (reference {OTHER}: {reference}); stable Service: {prober.ok} connections ok, "
          f"{prober.failed_count} failed; the restart's first sync: {written and written.group(1)} "
          f"{written and written.group(2)} (the whole kernel state: {sum(victim.values())})")
    assert prober.failed_count == 0, prober.failed[:10]
    assert prober.ok > 0 and all(prober.ok_by_target[t] > 0 for _, t in targets)
    assert victim == reference, "the restarted agent's kernel differs from the never-killed one's"
    assert audit["exit"] == 0, audit
    if lab.mode == "ebpf":
        assert web_entries(lab, VICTIM, cluster_ip) == web_before, "the stable Service's entries were rewritten"
        assert 0 < changed_new < len(changed), "the kill did not land among the changed Services"
    else:
        assert changed_new in (0, len(changed)), "iptables-restore is atomic: all the changes, or none"
