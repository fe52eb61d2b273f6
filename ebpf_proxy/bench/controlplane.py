"""Control-plane figures: full sync, single-change latency, burst convergence.

Every figure is timed against the kernel (kernelstate), not against what the agent says:

- full sync: restart one node's agent with every Service present, wait until its /healthz
  answers 200 (which it does only after its first successful sync of everything it listed),
  and take the time from the process's start to that sync's end, when the kernel is complete:
  the agent's kubeproxy_sync_proxy_rules_last_timestamp_seconds, against the wall clock read
  when the process was started (process start-up and initial list included). The time until
  /healthz answered is kept beside it (`healthy_s`): later by the probe's period and by what
  the agent does right after the sync (its heap settle holds the interpreter ~0.1 s at 10,000
  Services, ~0.4 s at 100,000, and the health server waits for it), as are the agent's own
  first-sync duration (kubeproxy_sync_full_proxy_rules_duration_seconds) and the restarted
  agent's CPU seconds and peak RSS. Before the restarts the running agent audits once
  (`audit_before`), as it does every --audit-period: the restart is that of an agent that has
  run for one, and an iptables agent's clean audit is the proof its successor's first full sync
  restores no table against (datapath/iptables/proof.py);
- update latency: move one endpoint of one Service to an address never used before, then poll
  the node's kernel until that address is programmed. The clock starts before the write is sent;
  its resolution is one kernel read (recorded per sample as `check_ms`);
- burst: write 1,000 such changes as fast as the API server takes them (several writers; all
  changes of one Service by one writer, in order), then poll until the kernel holds the change
  the server numbered last. The agent watches slices in resourceVersion order and each sync
  programs everything it has seen, so the last change programmed means all are; that is then
  verified on a full dump of the kernel's endpoints (and the clock runs on until it holds).
"""

from __future__ import annotations

import json
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

from ebpf_proxy import procs
from ebpf_proxy.bench import kernelstate, ports, procstat
from ebpf_proxy.bench.services import NAMESPACE, ROLE_LABEL, SERVICE_NAME_LABEL, BenchServices
from ebpf_proxy.lab import naming
from ebpf_proxy.lab.cluster import AGENT_HEALTHZ_PORT, AGENT_METRICS_PORT, Lab, LabError
from ebpf_proxy.lab.nshttp import http_get

FULL_SYNC_METRIC = "kubeproxy_sync_full_proxy_rules_duration_seconds"
# how often a restarted agent's /healthz is asked: the full-sync figure is the agent's own
# timestamp, so this bounds only how late that is read (and `healthy_s`'s resolution). Each ask
# costs the agent a request thread under the interpreter lock: every 20 ms it was ~0.45 s of a
# 100,000-Service restart's ~10 s, taken from the start it measured
HEALTH_POLL_SECONDS = 0.1
LAST_SYNC_METRIC = "kubeproxy_sync_proxy_rules_last_timestamp_seconds"


class ControlPlaneError(RuntimeError):
    pass


def metric_value(text: str, name: str) -> float | None:
    """The value of an unlabelled sample `name` in Prometheus text format, None if absent."""
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{} "):
            try:
                return float(line.rsplit(" ", 1)[1])
            except ValueError:
                return None
    return None


def first_sync_seconds(metrics_text: str) -> float | None:
    """Mean full-sync duration the agent reports (right after start there is one sync: its time)."""
    total = metric_value(metrics_text, FULL_SYNC_METRIC + "_sum")
    count = metric_value(metrics_text, FULL_SYNC_METRIC + "_count")
    if total is None or not count:
        return None
    return total / count


def programmed_seconds(metrics_text: str, started_wall: float) -> float | None:
    """Seconds from `started_wall` (time.time() as the agent was started) to the end of its last
    successful sync, by its own clock (the same host's); None when it reports none since then.
    Read right after its first sync that is that sync, or a later one (a later figure, never an
    earlier one)."""
    synced = metric_value(metrics_text, LAST_SYNC_METRIC)
    if synced is None or synced <= started_wall:
        return None
    return synced - started_wall


def wait_until(check: Callable[[], bool], timeout: float, min_interval: float = 0.005) -> tuple[float, int, float]:
    """Poll `check` until true: (seconds taken, polls, mean seconds per check). ControlPlaneError on timeout."""
    start = time.monotonic()
    polls, spent = 0, 0.0
    while True:
        t = time.monotonic()
        ok = check()
        polls += 1
        spent += time.monotonic() - t
        now = time.monotonic()
        if ok:
            return now - start, polls, spent / polls
        if now - start > timeout:
            raise ControlPlaneError(f"not reached within {timeout:.0f}s ({polls} checks)")
        time.sleep(min_interval)


def _healthy(lab: Lab, node: str) -> bool:
    status, _ = http_get(naming.node_netns(lab.name, node), f"http://127.0.0.1:{AGENT_HEALTHZ_PORT}/healthz",
                         timeout=1.0)
    return status == 200


def _agent_get(lab: Lab, node: str, path: str, timeout: float) -> tuple[int, str]:
    """GET `path` of `node`'s agent's metrics address (/metrics, /audit), from inside the node."""
    return http_get(naming.node_netns(lab.name, node), f"http://{lab.topology.node(node).ip}:{AGENT_METRICS_PORT}{path}",
                    timeout=timeout)


AUDIT_TIMEOUT_SECONDS = 120.0  # a drift audit at 100,000 Services x 10 endpoints takes ~4 s


def audit(lab: Lab, node: str) -> dict[str, Any]:
    """Run `node`'s agent's drift audit now (GET /audit, no repair): {"seconds", "drifts"}."""
    start = time.monotonic()
    status, body = _agent_get(lab, node, "/audit", AUDIT_TIMEOUT_SECONDS)
    if status != 200:
        raise ControlPlaneError(f"agent on {node}: GET /audit answered HTTP {status}: {body[:200]}")
    try:
        drifts = len(json.loads(body).get("drifts", []))
    except (ValueError, AttributeError):
        raise ControlPlaneError(f"agent on {node}: GET /audit answered no JSON report: {body[:200]}") from None
    return {"seconds": round(time.monotonic() - start, 3), "drifts": drifts}


def full_sync(lab: Lab, node: str, mode: str, timeout: float, agent_args: Sequence[str] = ()) -> dict[str, Any]:
    """Restart `node`'s agent in `mode` and time it to its kernel complete, and to healthy; its
    usage since start, too."""
    lab.stop_agent(node)
    start, start_wall = time.monotonic(), time.time()
    pid = lab.start_agent(node, mode, wait=False, extra_args=agent_args)

    def ready() -> bool:
        if not procs.alive(pid):  # an agent that died is not waited for
            raise ControlPlaneError(f"agent on {node} (pid {pid}) exited")
        try:
            return _healthy(lab, node)
        except LabError as exc:
            raise ControlPlaneError(str(exc)) from exc

    try:
        wait_until(ready, timeout, min_interval=HEALTH_POLL_SECONDS)
    except ControlPlaneError as exc:
        raise ControlPlaneError(f"agent on {node} ({mode}) not healthy: {exc}; log tail:\n"
                                + lab.logs(node, tail=10)) from None
    healthy = time.monotonic() - start
    usage = procstat.read(pid)
    status, body = _agent_get(lab, node, "/metrics", 2.0)
    programmed = programmed_seconds(body, start_wall) if status == 200 else None
    if programmed is None:
        raise ControlPlaneError(f"agent on {node} ({mode}) healthy after {healthy:.2f} s but its /metrics "
                                f"(HTTP {status}) has no {LAST_SYNC_METRIC} since it started")
    return {"seconds": round(programmed, 4), "healthy_s": round(healthy, 4),
            "sync_metric_s": first_sync_seconds(body), "pid": pid,
            "cpu_seconds": round(usage.cpu_seconds, 3), "peak_rss_mib": round(usage.peak_rss_mib, 1)}


@dataclass
class Observer:
    """Reads one node's kernel for one mode: the hook every latency measurement polls."""

    lab: Lab
    node: str
    mode: str
    # service name -> its ClusterIP (read from the API server, see prepare()); a Service's
    # ClusterIP never changes, so one LIST serves every measurement of a size
    cluster_ips: dict[str, str] = field(default_factory=dict)

    def prepare(self, services: BenchServices, names: Iterable[str]) -> None:
        """Learn the ClusterIPs of `names` before a clock starts, so that has() polls only the
        kernel: the ebpf check then reads one frontend instead of dumping every backend."""
        if self.mode != "ebpf" or all(n in self.cluster_ips for n in names):
            return
        for svc in services.rest.list("Service", NAMESPACE, label_selector=ROLE_LABEL):
            ip = (svc.get("spec") or {}).get("clusterIP")
            if ip and ip != "None":
                self.cluster_ips[svc["metadata"]["name"]] = ip

    def has(self, ip: str, port: int, service: str) -> bool:
        spn = kernelstate.service_port_name(NAMESPACE, service)
        cluster_ip = self.cluster_ips.get(service)
        frontend = (cluster_ip, ports.SERVICE_PORT) if cluster_ip else None
        return kernelstate.kernel_has_endpoint(self.lab, self.node, self.mode, ip, port, spn, frontend)

    def endpoints(self) -> set[tuple[str, int]]:
        return kernelstate.kernel_endpoints(self.lab, self.node, self.mode)


def update_latency(services: BenchServices, observer: Observer, changes: int, timeout: float,
                   settle: float = 0.02, on_sample: Callable[[int, float], None] | None = None) -> list[dict]:
    """`changes` single-endpoint changes, one at a time: [{"ms", "check_ms", "service"}, ...]."""
    targets = services.churn_targets()
    samples = []
    for k in range(changes):
        service = targets[(services.next_target_index() + k) % len(targets)]
        obj, (ip, port) = services.changed_slice(service)
        observer.prepare(services, [service])
        start = time.monotonic()
        services.write(obj)
        try:
            _, polls, check = wait_until(lambda: observer.has(ip, port, service), timeout)
        except ControlPlaneError as exc:
            raise ControlPlaneError(f"change {k + 1} ({service} -> {ip}:{port}) on {observer.node}: {exc}") from None
        ms = (time.monotonic() - start) * 1000
        samples.append({"ms": round(ms, 3), "check_ms": round(check * 1000, 3), "polls": polls, "service": service})
        if on_sample:
            on_sample(k, ms)
        time.sleep(settle)  # let the agent finish its sync before the next change
    services.advance_targets(changes)
    return samples


def burst(services: BenchServices, observer: Observer, count: int, timeout: float, threads: int = 4) -> dict[str, Any]:
    """`count` changes written at once; seconds until the kernel holds every final endpoint."""
    targets = services.churn_targets()
    per_service: dict[str, list[dict]] = defaultdict(list)
    final: dict[str, dict] = {}
    for k in range(count):
        service = targets[(services.next_target_index() + k) % len(targets)]
        obj, _ = services.changed_slice(service)
        services.remember(obj)  # the next change of this service builds on this one
        final[service] = obj
        per_service[service].append(obj)
    # Each change puts a never-used address in; a service's last one is in the kernel only once
    # that last change is programmed (stale entries a datapath frees lazily do not matter).
    expected = set().union(*(services.expected_endpoints(o) for o in final.values()))
    observer.prepare(services, final)

    def write_all(objs: list[dict]) -> list[tuple[int, dict]]:
        return [(services.write(obj), obj) for obj in objs]

    start = time.monotonic()
    written = [w for batch in services.rest.map(write_all, list(per_service.values()), threads=threads) for w in batch]
    write_seconds = time.monotonic() - start
    _, last = max(written, key=lambda w: w[0])
    last_service = last["metadata"]["labels"][SERVICE_NAME_LABEL]
    last_ip, last_port = last["endpoints"][0]["addresses"][0], last["ports"][0]["port"]
    try:
        _, polls, check = wait_until(lambda: observer.has(last_ip, last_port, last_service), timeout)
        seconds = time.monotonic() - start
        missing = expected - observer.endpoints()
        if missing:  # not what the ordering argument promises: wait for the rest, and say so
            wait_until(lambda: expected <= observer.endpoints(), timeout, min_interval=0.05)
            seconds = time.monotonic() - start
    except ControlPlaneError as exc:
        raise ControlPlaneError(f"burst of {count} changes on {observer.node}: {exc}") from None
    services.advance_targets(count)
    return {"seconds": round(seconds, 4), "write_seconds": round(write_seconds, 4), "changes": count,
            "services": len(final), "polls": polls, "check_ms": round(check * 1000, 3),
            "missing_when_last_seen": len(missing)}
