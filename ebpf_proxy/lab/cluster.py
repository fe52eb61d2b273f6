"""The lab: a real mini-cluster of network namespaces, its API server, echo pods and per-node agents.

`Lab` ties the pieces together (netns plumbing, the embedded API server process, echo servers,
agents) and records everything in the lab's state directory, so that every `ebpf-proxy lab …`
command, from any shell, acts on the same lab. Teardown never depends on that record being
intact: `destroy` finds the lab's namespaces, cgroups and processes by their prefix.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from ebpf_proxy import procs
from ebpf_proxy.lab import cbuild, echod, naming, netns, nsexec, state
from ebpf_proxy.lab import topology as topo
from ebpf_proxy.lab.nshttp import http_get

if TYPE_CHECKING:  # kubeapi brings the kubernetes client: imported where used, so that the CLI
    # (every `ebpf-proxy` command, the agent's `run` included) starts without it
    from ebpf_proxy.lab.kubeapi import KubeApi

log = logging.getLogger(__name__)

API_PORT = 6443
MODES = ("none", "iptables", "ebpf", "auto")
AGENT_HEALTHZ_PORT = 10256
AGENT_METRICS_PORT = 10249
# How long an agent may take to become ready (/healthz 200 after its first sync). A first eBPF start
# compiles its programs, every node at once: ~15 s on two idle cores, but over 30 s (the old
# limit) on a loaded CI machine, where a whole mode's e2e tests then failed. Ready agents answer at
# once, so the bound costs nothing when things work.
AGENT_READY_TIMEOUT = 120.0
ZONE_LABEL = "topology.kubernetes.io/zone"


class LabError(RuntimeError):
    pass


def _python_cli() -> list[str]:
    return [sys.executable, "-m", "ebpf_proxy"]


def _wait_file(path: Path, deadline: float, what: str, proc: subprocess.Popen | None = None) -> None:
    while not path.exists():
        if proc is not None and proc.poll() is not None:
            raise LabError(f"{what} exited with status {proc.returncode} before it was ready")
        if time.monotonic() > deadline:
            raise LabError(f"{what} not ready after waiting (no {path})")
        time.sleep(0.02)


def _stop_pid(pid: int | None, timeout: float = 5.0) -> None:
    _stop_pids([pid], timeout)


def _stop_pids(pids: Sequence[int | None], timeout: float = 5.0) -> None:
    """SIGTERM to all of `pids` at once, then wait for all of them, SIGKILL to any still alive
    after `timeout`: stopping every node's agent costs the slowest one's shutdown, not the sum
    of them (which each restart of the lab's agents paid, node after node)."""
    live = [pid for pid in pids if procs.alive(pid)]
    for pid in live:
        with contextlib.suppress(ProcessLookupError):  # exited meanwhile
            os.kill(pid, signal.SIGTERM)
            os.kill(pid, signal.SIGCONT)  # a frozen process handles SIGTERM only once continued
    deadline = time.monotonic() + timeout
    while live and time.monotonic() < deadline:
        for pid in live:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, os.WNOHANG)
        live = [pid for pid in live if procs.alive(pid)]
        if live:
            time.sleep(0.02)
    for pid in live:
        if procs.alive(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


class Lab:
    """One lab, loaded from (and saved to) its state directory."""

    def __init__(self, name: str, data: dict[str, Any]) -> None:
        self.name = name
        self.data = data
        self.topology = topo.topology_from_dict(data["topology"])
        self.dir = state.lab_dir(name)

    # ---- lifecycle -------------------------------------------------------------------------
    @classmethod
    def up(cls, name: str = state.DEFAULT_LAB, topology_path: str | None = None, mode: str = "none") -> "Lab":
        naming.validate_lab_name(name)
        if mode not in MODES:
            raise LabError(f"--mode: {mode!r} is not one of {', '.join(MODES)}")
        if state.exists(name):
            raise LabError(f"lab {name!r} is already up (`ebpf-proxy lab down --name {name}` first)")
        topology = topo.load_topology(topology_path)
        d = state.lab_dir(name)
        d.mkdir(parents=True, exist_ok=True)
        lab = cls(name, {"topology": topo.topology_to_dict(topology), "mode": "none", "pods": {}, "agents": {}})
        state.save(name, lab.data)  # from here on, `lab down` can find and remove it
        try:
            netns.build(name, topology)
            lab._start_apiserver()
            lab._register_nodes()
            for pod in topology.pods:
                lab._start_pod(pod)
            state.save(name, lab.data)
            if mode != "none":
                lab.set_mode(mode)
        except BaseException:
            lab.down()
            raise
        return lab

    @classmethod
    def load(cls, name: str = state.DEFAULT_LAB) -> "Lab":
        return cls(name, state.load(name))

    def save(self) -> None:
        self.data["topology"] = topo.topology_to_dict(self.topology)
        state.save(self.name, self.data)

    def down(self) -> None:
        destroy(self.name)

    # ---- API server --------------------------------------------------------------------------
    def _start_apiserver(self, local_port: int = 0) -> None:
        """Start the API server process; `local_port` 0 picks the host-side port (a restart
        asks for the one it had, so the host kubeconfig stays valid). Its objects live in
        `apiserver-state.json`, so a restart (`lab apiserver restart`) keeps them."""
        ready = self.dir / "apiserver.ready"
        ready.unlink(missing_ok=True)
        underlay = naming.underlay_netns(self.name)
        local = f"127.0.0.1:{local_port}"
        argv = [
            sys.executable, "-m", "ebpf_proxy.lab.apiserver_main",
            "--listen", local,
            "--listen-netns", f"{underlay}={host_port(self.topology.api_server_ip, API_PORT)}",
            "--service-cidr", ",".join(self.topology.service_cidrs),  # a pair: dual-stack Services
            "--service-node-port-range", self.topology.service_node_port_range,
            "--state-file", str(self.apiserver_state_file),
            "--ready-file", str(ready),
        ]
        proc = nsexec.spawn(None, argv, cgroup=naming.apiserver_cgroup(self.name),
                            log_path=str(self.dir / "apiserver.log"))
        _wait_file(ready, time.monotonic() + 15, "the embedded API server", proc)
        ports = json.loads(ready.read_text())["ports"]
        local_port = ports[local]
        self.data["apiserver"] = {
            "pid": proc.pid,
            "url": f"http://127.0.0.1:{local_port}",
            "node_url": f"http://{host_port(self.topology.api_server_ip, API_PORT)}",
        }
        self._write_kubeconfig(self.dir / "kubeconfig", self.data["apiserver"]["url"])
        self._write_kubeconfig(self.dir / "kubeconfig-node", self.data["apiserver"]["node_url"])

    @property
    def apiserver_state_file(self) -> Path:
        """The API server's objects on disk (apiserver/persist.py): edit it while the server is
        stopped to restart it with another object set, as a restore from backup would."""
        return self.dir / "apiserver-state.json"

    @staticmethod
    def _write_kubeconfig(path: Path, server: str) -> None:
        cfg = {
            "apiVersion": "v1", "kind": "Config", "current-context": "lab",
            "clusters": [{"name": "lab", "cluster": {"server": server}}],
            "users": [{"name": "lab", "user": {}}],
            "contexts": [{"name": "lab", "context": {"cluster": "lab", "user": "lab"}}],
        }
        path.write_text(json.dumps(cfg, indent=2))

    @property
    def kubeconfig(self) -> Path:
        return self.dir / "kubeconfig"

    def api(self) -> KubeApi:
        from ebpf_proxy.lab.kubeapi import KubeApi

        return KubeApi(self.data["apiserver"]["url"])

    def _register_nodes(self) -> None:
        api = self.api()
        try:
            for node in self.topology.nodes:
                # one InternalIP per family, primary first, as kubelet's --node-ip pair gives
                addresses = [{"type": "InternalIP", "address": ip} for ip in node.ips]
                addresses += [{"type": "InternalIP", "address": ip} for ip in node.extra_ips]
                addresses.append({"type": "Hostname", "address": node.name})
                labels = {"kubernetes.io/hostname": node.name}
                if node.zone:
                    labels[ZONE_LABEL] = node.zone
                api.apply({
                    "apiVersion": "v1", "kind": "Node",
                    "metadata": {"name": node.name, "labels": labels},
                    "spec": {"podCIDR": node.pod_cidr, "podCIDRs": list(node.pod_cidrs)},
                    # allocatable CPU: what the EndpointSlice controller weighs zones by for
                    # topology-mode Auto; every lab node counts the same
                    "status": {"addresses": addresses, "conditions": [{"type": "Ready", "status": "True"}],
                               "allocatable": {"cpu": "1"}},
                })
        finally:
            api.close()

    # ---- pods ----------------------------------------------------------------------------------
    def _pod_object(self, pod: topo.PodSpec) -> dict:
        ports = []
        for entry in pod.listen:
            port, proto = entry.split("/")
            ports.append({"containerPort": int(port), "protocol": proto.upper()})
        return {
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": pod.name, "namespace": pod.namespace, "labels": dict(pod.labels)},
            "spec": {"nodeName": pod.node, "containers": [{"name": "echo", "image": "ebpf-proxy/echo", "ports": ports}]},
            "status": {
                "phase": "Running", "podIP": pod.ip, "podIPs": [{"ip": ip} for ip in pod.ips],
                "conditions": [{"type": "Ready", "status": "True"}],
            },
        }

    def _start_pod(self, pod: topo.PodSpec) -> None:
        self.data["pods"][pod.name] = self._start_echo(pod)
        api = self.api()
        try:
            api.apply(self._pod_object(pod))
        finally:
            api.close()

    def _start_echo(self, pod: topo.PodSpec) -> dict[str, Any]:
        """The pod's echo server, as the lab records it: {"pid", "threads"} (its CPU limit, for
        the bench); no pid for `listen: []` (a client pod that serves nothing)."""
        if not pod.listen:
            return {"pid": None}
        ready = self.dir / f"echo-{pod.name}.ready"
        ready.unlink(missing_ok=True)
        try:
            argv = echod.server_argv(pod.server, pod.name, pod.listen, ready, ipv6=any(":" in ip for ip in pod.ips))
        except (cbuild.BuildError, ValueError) as exc:
            raise LabError(f"pod {pod.name}: server {pod.server}: {exc}") from None
        proc = nsexec.spawn(naming.pod_netns(self.name, pod.name), argv,
                            log_path=str(self.dir / f"echo-{pod.name}.log"))
        _wait_file(ready, time.monotonic() + 10, f"echo server of pod {pod.name}", proc)
        return {"pid": proc.pid, "threads": json.loads(ready.read_text()).get("threads", 1)}

    def add_pod(self, pod: topo.PodSpec) -> topo.PodSpec:
        """A new pod, its netns and echo server, and its Pod object (so endpoint slices follow)."""
        self.topology = topo.with_pod(self.topology, pod)
        pod = self.topology.pod(pod.name)
        netns.add_pod(self.name, self.topology, pod)
        self._start_pod(pod)
        self.save()
        return pod

    def remove_pod(self, name: str) -> None:
        pod = self.topology.pod(name)
        api = self.api()
        try:
            api.delete("Pod", name, pod.namespace)
        finally:
            api.close()
        _stop_pid(self.data["pods"].pop(name, {}).get("pid"))
        netns.remove_pod(self.name, self.topology, pod)
        self.topology = topo.without_pod(self.topology, name)
        self.save()

    def scale(self, app: str, replicas: int) -> list[str]:
        """Make `replicas` pods labelled app=APP exist, like a Deployment; returns the pods now running.

        New pods copy the labels and ports of an existing replica and go to the node that has the
        fewest of them; scaling down removes the newest first.
        """
        if replicas < 0:
            raise LabError(f"--replicas: must be >= 0, got {replicas}")
        current = [p for p in self.topology.pods if p.labels.get("app") == app]
        if not current:
            raise LabError(f"scale: no pod has label app={app} (known apps: "
                           f"{sorted({p.labels.get('app') for p in self.topology.pods if p.labels.get('app')})})")
        template = current[0]
        while len(current) > replicas:
            victim = current.pop()
            self.remove_pod(victim.name)
        index = 1
        while len(current) < replicas:
            while any(p.name == f"{app}-{index}" for p in self.topology.pods):
                index += 1
            load = {n.name: sum(1 for p in current if p.node == n.name) for n in self.topology.nodes}
            node = min(self.topology.nodes, key=lambda n: (load[n.name], n.name)).name
            new = replace(template, name=f"{app}-{index}", node=node, ip=None)
            current.append(self.add_pod(new))
        return [p.name for p in current]

    # ---- manifests -------------------------------------------------------------------------------
    def apply_manifests(self, text: str, source: str) -> list[str]:
        from ebpf_proxy.lab.kubeapi import load_manifests

        docs = load_manifests(text, source)
        done = []
        api = self.api()
        try:
            for doc in docs:
                if doc["kind"] == "Pod":
                    done.append(self._apply_pod(doc))
                    continue
                api.apply(doc)
                done.append(f"{doc['kind'].lower()}/{doc['metadata']['name']}")
        finally:
            api.close()
        return done

    def _apply_pod(self, doc: dict) -> str:
        meta, spec = doc.get("metadata") or {}, doc.get("spec") or {}
        listen = []
        for container in spec.get("containers") or []:
            for port in container.get("ports") or []:
                listen.append(f"{port['containerPort']}/{port.get('protocol', 'TCP').lower()}")
        name = meta["name"]
        if any(p.name == name for p in self.topology.pods):
            return f"pod/{name} (unchanged)"
        node = spec.get("nodeName") or self.topology.nodes[0].name
        status = doc.get("status") or {}
        given = [e.get("ip") for e in status.get("podIPs") or [] if isinstance(e, dict) and e.get("ip")]
        pod = topo.PodSpec(name=name, node=node, ip=status.get("podIP"), ips=tuple(given),
                           labels=dict(meta.get("labels") or {}), listen=tuple(listen or ["80/tcp"]),
                           namespace=meta.get("namespace", "default"))
        self.add_pod(pod)
        return f"pod/{name}"

    def delete_manifests(self, text: str, source: str) -> list[str]:
        from ebpf_proxy.lab.kubeapi import load_manifests, namespaces_last

        docs = namespaces_last(load_manifests(text, source))
        done = []
        api = self.api()
        try:
            for doc in docs:
                meta = doc["metadata"]
                if doc["kind"] == "Pod" and any(p.name == meta["name"] for p in self.topology.pods):
                    self.remove_pod(meta["name"])
                    done.append(f"pod/{meta['name']}")
                elif api.delete(doc["kind"], meta["name"], meta.get("namespace", "default")):
                    done.append(f"{doc['kind'].lower()}/{meta['name']}")
        finally:
            api.close()
        return done

    # ---- where: nodes, pods, clients ---------------------------------------------------------------
    def netns_of(self, where: str) -> str:
        if any(n.name == where for n in self.topology.nodes):
            return naming.node_netns(self.name, where)
        if any(p.name == where for p in self.topology.pods):
            return naming.pod_netns(self.name, where)
        if any(c.name == where for c in self.topology.clients):
            return naming.client_netns(self.name, where)
        names = [n.name for n in self.topology.nodes] + [p.name for p in self.topology.pods] + \
                [c.name for c in self.topology.clients]
        raise LabError(f"{where!r} is not a node, pod or client of lab {self.name!r} (known: {', '.join(names)})")

    def cgroup_of(self, where: str) -> str | None:
        if any(n.name == where for n in self.topology.nodes):
            return naming.node_cgroup(self.name, where)
        return None

    def exec(self, where: str, argv: list[str], **kwargs: Any) -> subprocess.CompletedProcess:
        return nsexec.run(self.netns_of(where), argv, cgroup=self.cgroup_of(where), **kwargs)

    def flush_connections(self) -> bool:
        """Forget every node's tracked connections, as `conntrack -F` does for kube-proxy, so
        what comes next is judged as new connections only: the kernel's conntrack table and,
        where an ebpf agent runs, its connection tables (epx_ct4, epx_ct6), which `conntrack -F`
        does not see. Without the second, a probe that reuses the source port of an earlier,
        unanswered attempt follows that attempt's translation for tcp_syn_timeout (120 s), as a
        conntrack entry would. Returns False when conntrack is not installed (the kernel's
        tables were left as they were)."""
        kernel = shutil.which("conntrack") is not None
        for node in self.topology.nodes:
            if kernel:  # exit 1 with "0 flow entries" when the table is empty or not loaded there
                self.exec(node.name, ["conntrack", "-F"], check=False, capture_output=True, timeout=30)
            if self.data["agents"].get(node.name, {}).get("mode") == "ebpf":
                from ebpf_proxy.datapath.ebpf import pins  # the map code, for ebpf labs only

                maps = pins.open_maps(self.dir / "bpffs" / node.name)
                try:
                    for table in ("epx_ct4", "epx_ct6"):
                        maps.clear(table)
                finally:
                    maps.close()
        return kernel

    def iptables_save(self, where: str, table: str | None = None) -> str:
        """iptables-save of both backends inside WHERE (the agent picks legacy or nft: see
        datapath/iptables/backend.py), so a reader never misses rules kept in the other one."""
        out = []
        for save in ("iptables-legacy-save", "iptables-nft-save"):
            done = self.exec(where, [save] + (["-t", table] if table else []), check=False)
            if done.returncode == 0:
                out.append(done.stdout)
        return "".join(out)

    def probe(self, where: str, target: str, count: int = 1, source_ip: str | None = None,
              timeout: float = 1.0):
        from ebpf_proxy.lab.probe import probe

        return probe(self.netns_of(where), target, count=count, source_ip=source_ip, timeout=timeout,
                     label=where, cgroup=self.cgroup_of(where))

    # ---- agents ---------------------------------------------------------------------------------------
    @property
    def mode(self) -> str:
        return self.data.get("mode", "none")

    def _agent_argv(self, node: topo.NodeSpec, mode: str, extra_args: Sequence[str] = ()) -> list[str]:
        argv = _python_cli() + [
            "run", "--mode", mode,
            "--hostname-override", node.name,
            "--kubeconfig", str(self.dir / "kubeconfig-node"),
            "--metrics-bind-address", host_port(node.ip, AGENT_METRICS_PORT),
            "--healthz-bind-address", f"0.0.0.0:{AGENT_HEALTHZ_PORT}",
            "--cgroup-path", naming.node_cgroup(self.name, node.name),
            "--bpffs", str(self.dir / "bpffs" / node.name),
            "--bpf-cache-dir", str(state.BPF_CACHE),
            "--iptables-proof-dir", str(self.dir / "iptables-proofs"),
        ]
        return argv + self.proxy_config_args() + list(self.topology.agent_args) + list(extra_args)

    def proxy_config_args(self) -> list[str]:
        """The agents' kube-proxy settings as command-line options (`run`, `verify` take them)."""
        if self.topology.kube_proxy_configuration:
            # The topology's clusterCIDR is the file's default, as a kubeadm ConfigMap has it; a
            # file that sets clusterCIDR itself (even "": kube-proxy's no-op local detector) wins.
            kpc = topo.topology_to_dict(self.topology)["kubeProxyConfiguration"]  # plain dicts
            kpc.setdefault("clusterCIDR", ",".join(self.topology.cluster_cidrs))
            cfg = self.dir / "kube-proxy-config.yaml"  # JSON is YAML
            cfg.write_text(json.dumps(kpc))
            return ["--config", str(cfg)]
        return ["--cluster-cidr", ",".join(self.topology.cluster_cidrs)]

    def set_proxy_config(self, config: Mapping[str, Any] | None, timeout: float = AGENT_READY_TIMEOUT) -> None:
        """Give every agent another KubeProxyConfiguration (None: none, flags only) and restart
        them with it, as rolling out a changed kube-proxy ConfigMap does. The datapath stays in
        place across the restart; each agent's first sync rewrites it for the new settings."""
        data = topo.topology_to_dict(self.topology)
        data.pop("kubeProxyConfiguration", None)
        if config is not None:
            data["kubeProxyConfiguration"] = dict(config)
        self.topology = topo.parse_topology(data)  # validates apiVersion and kind as `lab up` does
        self.save()
        running = [n for n in self.data["agents"] if procs.alive(self.data["agents"][n].get("pid"))]
        self.stop_agents(running)
        for name in running:
            self.start_agent(name, wait=False)
        for name in running:
            self.wait_agent_ready(name, timeout=timeout)

    def start_agent(self, node_name: str, mode: str | None = None, wait: bool = True,
                    extra_args: Sequence[str] = ()) -> int:
        """Start `node_name`'s agent (unless it runs); `extra_args`: more `ebpf-proxy run` options
        for this start only, after the topology's agentArgs (the bench sizes the maps so)."""
        node = self.topology.node(node_name)
        mode = mode or self.mode
        if mode == "none":
            raise LabError("the lab's mode is none: give a mode (`lab mode iptables`) before starting agents")
        entry = self.data["agents"].get(node_name, {})
        if procs.alive(entry.get("pid")):
            return entry["pid"]
        logs = self.dir / "logs"
        logs.mkdir(exist_ok=True)
        proc = nsexec.spawn(naming.node_netns(self.name, node_name), self._agent_argv(node, mode, extra_args),
                            cgroup=naming.node_cgroup(self.name, node_name),
                            log_path=str(logs / f"{node_name}.log"))
        self.data["agents"][node_name] = {"pid": proc.pid, "mode": mode}
        self.save()
        if wait:
            self.wait_agent_ready(node_name, proc)
        return proc.pid

    def wait_agent_ready(self, node_name: str, proc: subprocess.Popen | None = None,
                         timeout: float = AGENT_READY_TIMEOUT) -> None:
        """Ready = its /healthz answers 200, which the agent does only after a first successful sync."""
        netns_name = naming.node_netns(self.name, node_name)
        deadline = time.monotonic() + timeout
        url = f"http://127.0.0.1:{AGENT_HEALTHZ_PORT}/healthz"
        while time.monotonic() < deadline:
            pid = self.data["agents"].get(node_name, {}).get("pid")
            if not procs.alive(pid):
                raise LabError(f"agent on {node_name} exited; see `ebpf-proxy lab logs {node_name}`:\n"
                               + self.logs(node_name, tail=15))
            if http_get(netns_name, url, timeout=1.0)[0] == 200:
                return
            time.sleep(0.1)
        raise LabError(f"agent on {node_name} not healthy after {timeout:.0f}s; see `ebpf-proxy lab logs {node_name}`")

    def agent_synced_resource_version(self, node_name: str) -> int | None:
        """The API resourceVersion up to which this node's agent has programmed its datapath.

        The agent reports it on /healthz (`syncedResourceVersion`, our addition to kube-proxy's
        fields); the lab's API server numbers every change from one counter, so "agent ≥ server"
        means the agent has programmed everything the server held.
        """
        status, body = http_get(naming.node_netns(self.name, node_name),
                                f"http://127.0.0.1:{AGENT_HEALTHZ_PORT}/healthz", timeout=1.0)
        if status not in (200, 503):
            return None
        try:
            return int(json.loads(body).get("syncedResourceVersion") or 0)
        except (ValueError, TypeError, AttributeError):
            return None

    def wait_converged(self, timeout: float = 20.0) -> None:
        """Block until every running agent has programmed the API server's current state."""
        running = [n for n, a in self.data["agents"].items() if procs.alive(a.get("pid"))]
        if not running:
            return
        deadline = time.monotonic() + timeout
        api = self.api()
        try:
            while True:
                target = api.resource_version()
                pending = list(running)
                while pending:
                    if time.monotonic() > deadline:
                        raise LabError(f"agents on {', '.join(pending)} did not program resourceVersion "
                                       f"{target} within {timeout:.0f}s (see `ebpf-proxy lab logs NODE`)")
                    pending = [n for n in pending if (self.agent_synced_resource_version(n) or 0) < target]
                    if pending:
                        time.sleep(0.05)
                if api.resource_version() == target:  # nothing (e.g. the slice controller) wrote meanwhile
                    return
        finally:
            api.close()

    def stop_agent(self, node_name: str) -> None:
        self.stop_agents([node_name])

    def stop_agents(self, node_names: Sequence[str]) -> None:
        """Stop these nodes' agents, all at once (SIGTERM: each keeps its datapath in place)."""
        for name in node_names:
            self.topology.node(name)
        entries = [self.data["agents"].pop(name, {}) for name in node_names]
        _stop_pids([entry.get("pid") for entry in entries], timeout=10)
        self.save()

    def agent_action(self, node_name: str, action: str) -> None:
        if action == "stop":
            self.stop_agent(node_name)
        elif action == "start":
            self.start_agent(node_name)
        elif action == "restart":
            self.stop_agent(node_name)
            self.start_agent(node_name)
        else:
            raise LabError(f"agent action {action!r} is not one of start, stop, restart")

    def set_mode(self, mode: str, timeout: float = AGENT_READY_TIMEOUT) -> None:
        """Switch every node's agent in place, make before break: the old agents stop (their
        datapath keeps serving), the new ones program theirs beside it, move its connections over
        and remove it (agent/handover.py). `none` cleans every mode's state.

        `timeout` bounds each agent's first sync (10,000 services take far longer than 1)."""
        if mode not in MODES:
            raise LabError(f"mode: {mode!r} is not one of {', '.join(MODES)}")
        names = [node.name for node in self.topology.nodes]
        self.stop_agents(names)
        if mode == "none":  # every node's at once: each is an interpreter start-up and its own netns
            with ThreadPoolExecutor(max_workers=max(1, len(names)), thread_name_prefix="lab-cleanup") as pool:
                list(pool.map(lambda name: self.exec(name, _python_cli() + ["cleanup"], check=False,
                                                     capture_output=True), names))
        self.data["mode"] = mode
        self.save()
        if mode == "none":
            return
        for node in self.topology.nodes:
            self.start_agent(node.name, mode, wait=False)
        for node in self.topology.nodes:
            self.wait_agent_ready(node.name, timeout=timeout)

    def logs(self, node_name: str, tail: int | None = None) -> str:
        self.topology.node(node_name)
        path = self.dir / "logs" / f"{node_name}.log"
        if not path.exists():
            return ""
        lines = path.read_text(errors="replace").splitlines()
        return "\n".join(lines[-tail:] if tail else lines)

    # ---- status -------------------------------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        api = self.data.get("apiserver", {})
        return {
            "name": self.name,
            "mode": self.mode,
            "apiserver": {**api, "alive": procs.alive(api.get("pid")), "frozen": procs.stopped(api.get("pid"))},
            "kubeconfig": str(self.kubeconfig),
            "nodes": [{"name": n.name, "ip": n.ip, "ips": list(n.ips), "podCIDRs": list(n.pod_cidrs), "extraIPs": list(n.extra_ips), "podCIDR": n.pod_cidr, "zone": n.zone,
                       "agent": {**self.data["agents"].get(n.name, {}),
                                 "alive": procs.alive(self.data["agents"].get(n.name, {}).get("pid"))}}
                      for n in self.topology.nodes],
            "pods": [{"name": p.name, "node": p.node, "ip": p.ip, "ips": list(p.ips), "labels": dict(p.labels),
                      "listen": list(p.listen), "server": p.server, "alive": procs.alive(self.data["pods"].get(p.name, {}).get("pid"))}
                     for p in self.topology.pods],
            "clients": [{"name": c.name, "ip": c.ip, "ips": list(c.ips)} for c in self.topology.clients],
        }


def destroy(name: str) -> None:
    """Remove every namespace, process, cgroup, bpffs mount and file of lab NAME. Idempotent; needs no state."""
    lab_root = state.lab_dir(name)
    bpffs = lab_root / "bpffs"
    if bpffs.is_dir():
        for mount in sorted(bpffs.iterdir()):
            subprocess.run(["umount", "-l", str(mount)], capture_output=True)
    netns.destroy(name)
    state.remove(name)


def destroy_all() -> list[str]:
    names = sorted(set(state.known_labs()) | set(naming.leftover_labs()))
    for name in names:
        destroy(name)
    shutil.rmtree(state.BPF_CACHE, ignore_errors=True)
    return names


def host_port(ip: str, port: int) -> str:
    """`IP:PORT`, an IPv6 address in brackets (an IPv6-only lab's API server)."""
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"
