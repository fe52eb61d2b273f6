"""kill -9 of an agent in the middle of a full sync of many Services, then restart (issue 13, part 3).

On the lab of topology_killsync.yaml, with fresh connections going without pause to a stable
Service through worker1's datapath (its ClusterIP from a pod on worker1, its NodePort from
outside through worker1): worker1's agent is stopped, EPX_KILLSYNC_SERVICES Services (default
10,000; bench fillers: two phantom endpoints each) are created at once, and the agent is started
against them, so its first sync is a full sync of all of them. When /metrics says that sync is
half written (`lab agent worker1 kill --during full-sync --at 0.5`), it gets SIGKILL. Then:

- right after the kill, nothing is half-programmed: in ebpf mode every frontend's chain
  (record -> slots of its bank -> backends) is complete; in iptables mode every jump of
  KUBE-SERVICES leads to a chain that exists (iptables-restore is atomic per table);
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
from ebpf_proxy.bench.services import filler_name, filler_slice, service_object
from ebpf_proxy.datapath.ebpf import adopt
from ebpf_proxy.datapath.ebpf.maps import Maps, entry_counts
from ebpf_proxy.lab import agent_fault
from ebpf_proxy.lab import audit as lab_audit
from ebpf_proxy.lab.prober import Prober
from tests.e2e.conftest import E2E_MODES, _lab
from tests.e2e.scenario_runner import HERE

pytestmark = [pytest.mark.root, pytest.mark.e2e]

SERVICES = int(os.environ.get("EPX_KILLSYNC_SERVICES", "10000"))
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
        lab.stop_agent(VICTIM)  # SIGTERM: the datapath stays; the next start is a full sync of everything
        took_create = create_services(lab, SERVICES)
        lab.wait_converged(timeout=READY_TIMEOUT)  # worker2 (the reference) has them all
        lab.start_agent(VICTIM, wait=False)
        killed = agent_fault.kill(lab, VICTIM, during="full-sync", at=0.5, timeout=READY_TIMEOUT)

        # what the kill left
        if lab.mode == "ebpf":
            maps = Maps.open_pinned(pin_dir(lab, VICTIM))
            try:
                broken = adopt.broken_chains(maps)
            finally:
                maps.close()
        else:
            broken = dangling_jumps(lab.iptables_save(VICTIM, "nat"))
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
    print(f"\n[{lab.mode}] {SERVICES} Services created in {took_create:.1f}s; {VICTIM}'s agent killed "
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
        assert 0 < left["epx_svc"] < victim["epx_svc"], "the kill did not land in the middle of the sync"
