"""A/B of the TC programs attached through cls_bpf against the same programs through tcx.

Made before the agent attached through tcx itself: run it at commit 1bdda45 (whose agents and
loader use cls_bpf), on a lab built from the bench topology (`ebpf-proxy lab up --topology ebpf_proxy/bench/topology.yaml
--mode ebpf --name px`, client-1 given `net.ipv4.ip_local_port_range=1024 65535` and
`net.ipv4.tcp_tw_reuse=1`), with the bench's measured Services. Each run starts both nodes'
agents (they attach through cls_bpf) and stops them (the datapath stays, and no link watcher
re-attaches behind the script: both variants run without agents); for the tcx variant the script
then attaches the very same pinned programs through tcx (BPF_PROG_ATTACH, BPF_TCX_INGRESS and
_EGRESS) and removes the filters, and detaches them after the run. The bench's load generator
(bench/loadgen.c) opens new connections to the ClusterIP from client-1 for 5 s (16 in flight, 2
threads); the variants alternate in order round by round. Writes every run to tcx.json; kernel
µs per connection is cpu_s.kernel × 10^6 / completed. Usage: python tcx.py ROUNDS (from the
project root, as root).
"""
import json
import os
import sys
import time

from pyroute2 import IPRoute
from ebpf_proxy.datapath.ebpf import libbpf, loader
from ebpf_proxy.lab import naming
from ebpf_proxy.lab._setns import run_in_netns
from ebpf_proxy.lab.cluster import Lab
from ebpf_proxy.bench.rest import Rest
from ebpf_proxy.bench.services import BenchServices
from ebpf_proxy.bench import loadgen, ports
TCX_IN, TCX_EG = 46, 47
lab = Lab.load("px")
rest = Rest(lab.data["apiserver"]["url"])
svcs = BenchServices(rest, lab.topology, 2)
svcs.install_measured(); svcs.point_at_mode("ebpf")
time.sleep(2)
vip = next(s["spec"]["clusterIP"] for s in rest.list("Service", "default") if s["metadata"]["name"] == ports.SVC_CLUSTERIP)
LG = str(loadgen.build())
nodes = [n.name for n in lab.topology.nodes]

def progs(node):
    d = sorted((lab.dir / "bpffs" / node / "ebpf-proxy" / "progs").glob("*"), key=lambda p: p.stat().st_mtime)[-1]
    return {n: libbpf.obj_get(str(d / n)) for n in ("tc_ingress", "tc_egress", "tc_lo")}

def to_tcx(fds):
    done = []
    with IPRoute() as ipr:
        for link in ipr.get_links():
            i, name = link["index"], link.get_attr("IFLA_IFNAME")
            ing = loader._our_filters(ipr, i, loader._TC_INGRESS_PARENT)
            eg = loader._our_filters(ipr, i, loader._TC_EGRESS_PARENT)
            if not ing and not eg:
                continue
            if ing:
                libbpf.prog_attach(fds["tc_lo" if name == "lo" else "tc_ingress"], i, TCX_IN)
            if eg:
                libbpf.prog_attach(fds["tc_egress"], i, TCX_EG)
            loader.detach_tc(ipr, i)
            done.append((i, name, bool(ing), bool(eg)))
    return done

def from_tcx(fds, done):
    for i, name, ing, eg in done:
        if ing: libbpf.prog_detach(fds["tc_lo" if name == "lo" else "tc_ingress"], i, TCX_IN)
        if eg: libbpf.prog_detach(fds["tc_egress"], i, TCX_EG)

def run():
    args = [LG, "--proto", "tcp", "--duration", "5", "--warmup", "0.5", "--concurrency", "16", "--threads", "2",
            "--target", f"{vip}:{ports.SERVICE_PORT}"]
    return json.loads(lab.exec("client-1", args, capture_output=True, text=True, check=True).stdout)

def agents_on():
    for n in nodes: lab.start_agent(n, "ebpf", wait=False)
    for n in nodes: lab.wait_agent_ready(n)
    time.sleep(1)

res = {"cls_bpf": [], "tcx": []}
for rnd in range(int(sys.argv[1])):
    for mode in (("tcx", "cls_bpf") if rnd % 2 else ("cls_bpf", "tcx")):
        agents_on()  # attaches through cls_bpf
        lab.stop_agents(nodes)  # the datapath stays, and no link watcher re-attaches behind us: both modes without agents
        if mode == "cls_bpf":
            r = run()
        else:
            fds = {n: progs(n) for n in nodes}
            done = {n: run_in_netns(naming.node_netns(lab.name, n), to_tcx, fds[n]) for n in nodes}
            if rnd == 0: print(done, flush=True)
            r = run()
            for n in nodes:
                run_in_netns(naming.node_netns(lab.name, n), from_tcx, fds[n], done[n])
                for fd in fds[n].values(): os.close(fd)
        res[mode].append(r)
        print(rnd, mode, r["completed"], round(r["cpu_s"]["kernel"] * 1e6 / max(1, r["completed"]), 1), flush=True)
json.dump(res, open("tcx.json", "w"))
