"""`lab audit`: `ebpf-proxy audit` on every node of a lab, asking each node's agent where it listens."""

from __future__ import annotations

import json
import sys

from ebpf_proxy.lab.cluster import AGENT_METRICS_PORT, host_port


def run(lab, nodes: list[str] | None = None, repair: bool = False, timeout: float = 180.0) -> dict[str, dict]:
    """node -> the agent's audit report (plus "exit": `audit`'s status), for `nodes` (default: all)."""
    results = {}
    for name in nodes or [n.name for n in lab.topology.nodes]:
        address = host_port(lab.topology.node(name).ip, AGENT_METRICS_PORT)
        argv = [sys.executable, "-m", "ebpf_proxy", "audit", "--json", "--metrics-address", address]
        if repair:
            argv.append("--repair")
        done = lab.exec(name, argv, check=False, timeout=timeout, capture_output=True, text=True)
        try:
            report = json.loads(done.stdout)
        except ValueError:
            report = {"error": f"audit on {name} failed (exit {done.returncode}): "
                               f"{(done.stderr or done.stdout).strip()[-2000:]}"}
        report["exit"] = done.returncode
        results[name] = report
    return results
