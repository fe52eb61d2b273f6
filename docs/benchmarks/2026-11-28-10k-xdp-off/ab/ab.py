"""A/B of --bpf-xdp-mode off (the default since 1bdda45) against generic, through the bench's ClusterIP.

On a lab built from the bench topology (`ebpf-proxy lab up --topology ebpf_proxy/bench/topology.yaml
--mode ebpf --name px`, client-1 given `net.ipv4.ip_local_port_range=1024 65535` and
`net.ipv4.tcp_tw_reuse=1`), with the bench's measured Services: each round restarts both nodes'
agents in one mode, then the bench's load generator (bench/loadgen.c) opens new connections to
the ClusterIP from client-1 for 5 s (16 in flight, 2 threads); the modes alternate in order
round by round. Writes every run's figures to ab.json; kernel µs per connection is
cpu_s.kernel × 10^6 / completed. Usage: python ab.py ROUNDS (from the project root, as root).
"""
import json
import sys
import time

from ebpf_proxy.lab.cluster import Lab
from ebpf_proxy.bench.rest import Rest
from ebpf_proxy.bench.services import BenchServices
from ebpf_proxy.bench import loadgen, ports
lab = Lab.load("px")
rest = Rest(lab.data["apiserver"]["url"])
svcs = BenchServices(rest, lab.topology, 2)
svcs.install_measured(); svcs.point_at_mode("ebpf")
time.sleep(2)
vip = next(s["spec"]["clusterIP"] for s in rest.list("Service", "default") if s["metadata"]["name"] == ports.SVC_CLUSTERIP)
port = ports.SERVICE_PORT
print("vip", vip, port, flush=True)
LG = str(loadgen.build())
def agents(mode):
    names = [n.name for n in lab.topology.nodes]
    lab.stop_agents(names)
    for n in names: lab.start_agent(n, "ebpf", wait=False, extra_args=["--bpf-xdp-mode", mode])
    for n in names: lab.wait_agent_ready(n)
    time.sleep(1)
def run(targets):
    args = [LG, "--proto", "tcp", "--duration", "5", "--warmup", "0.5", "--concurrency", "16", "--threads", "2"]
    for t in targets: args += ["--target", t]
    out = lab.exec("client-1", args, capture_output=True, text=True, check=True).stdout
    return json.loads(out)
res = {"off": [], "generic": []}
for rnd in range(int(sys.argv[1])):
    for mode in ("generic", "off") if rnd % 2 else ("off", "generic"):
        agents(mode)
        r = run([f"{vip}:{port}"])
        res[mode].append(r)
        print(rnd, mode, r["completed"], r["rate"], r["cpu_s"]["kernel"] * 1e6 / r["completed"], flush=True)
json.dump(res, open("ab.json", "w"))
