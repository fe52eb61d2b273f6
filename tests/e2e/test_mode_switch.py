"""iptables <-> ebpf mode switch under load, make before break (issue 13, part 4; agent/handover.py).

On the e2e lab (web-1 on worker1, web-2 on worker3, client-1 on worker2, `outside` routed
through worker1), long-lived TCP connections exchange 3,000-byte echoes every 20 ms, without
pause, while fresh connections go to the same Service, through its ClusterIP from client-1
and its NodePort from outside. The connections:

- client-1 -> ClusterIP (DNAT on worker2, no masquerade);
- outside -> worker1's NodePort landing on web-1 (local) and on web-2 (remote), both masqueraded.

`lab mode ebpf` then moves the iptables mode's connections into epx_ct4 (the kernel's
masquerade ports lie outside ours: CFG_F_ADOPTED_MASQ until they are gone), a second set
of the same connections is opened, and `lab mode iptables` moves all of them into the kernel's
conntrack. Every connection must answer every echo across both switches, no fresh connection may
fail, and after each switch nothing of the other mode is left. Printed (-s): each switch's time,
echoes per connection, fresh connections ok / failed, what each node's agent moved.
"""

from __future__ import annotations

import os
import re
import threading
import time

import pytest

from ebpf_proxy.datapath.ebpf import pins
from ebpf_proxy.lab.prober import Prober
from tests.e2e.conftest import _lab
from tests.e2e.scenario_runner import TOPOLOGY
from tests.e2e.test_ebpf_only import Conn

pytestmark = [pytest.mark.root, pytest.mark.e2e, pytest.mark.bpf]

VIP, NODE_PORT = "10.96.102.10", 31180
GATEWAY = "172.20.20.15"  # worker1, where `outside` enters
MANIFESTS = f"""
apiVersion: v1
kind: Service
metadata: {{name: switch}}
spec:
  type: NodePort
  clusterIP: {VIP}
  selector: {{app: web}}
  ports: [{{name: http, port: 80, targetPort: 80, nodePort: {NODE_PORT}}}]
"""
ECHO_EVERY = 0.02
PAYLOAD = 3000  # two segments and more: a wrong translation of any of them shows
# A fresh connection fails when it is not answered within this: time for a SYN or ACK
# retransmitted once (after 1 s), as around the moment programs are attached or detached on a
# loaded 2-core machine; an application's connect timeout is longer still.
PROBE_TIMEOUT = 3.0


@pytest.fixture(scope="module")
def lab():
    yield from _lab(f"msw{os.getpid() % 10000}", TOPOLOGY, "iptables")


class Pump:
    """Echoes PAYLOAD bytes over each connection every ECHO_EVERY seconds until stopped."""

    def __init__(self) -> None:
        self.conns: dict[str, Conn] = {}
        self.echoes: dict[str, int] = {}
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def add(self, name: str, conn: Conn) -> None:
        self.conns[name], self.echoes[name] = conn, 0
        thread = threading.Thread(target=self._run, args=(name, conn), daemon=True, name=f"pump-{name}")
        self._threads.append(thread)
        thread.start()

    def _run(self, name: str, conn: Conn) -> None:
        i = 0
        while not self._stop.is_set():
            payload = (f"{name}/{i}/".encode() * PAYLOAD)[:PAYLOAD]
            try:
                if conn.echo(payload) != payload:
                    raise AssertionError("echo differs")
            except Exception as exc:  # noqa: BLE001 - any failure of the connection is the finding
                self.errors.append(f"{time.strftime('%H:%M:%S')} {name}: {exc!r}")
                return
            self.echoes[name] += 1
            i += 1
            self._stop.wait(ECHO_EVERY)

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=10)
        for conn in self.conns.values():
            conn.close()


def open_conns(lab, tag: str) -> dict[str, Conn]:
    """client-1 -> ClusterIP, and outside -> NodePort once onto each web pod."""
    out = {f"{tag} client-1->clusterIP": Conn(lab, "client-1", VIP, 80)}
    for _ in range(40):  # the backend is the datapath's choice: try until both pods answered
        conn = Conn(lab, "outside", GATEWAY, NODE_PORT)
        name = f"{tag} outside->nodePort->{conn.hello['pod']}"
        if name in out:
            conn.close()
        else:
            out[name] = conn
        if len(out) == 3:
            break
    assert len(out) == 3, f"the NodePort never landed on both web pods: {sorted(out)}"
    return out


def switched(lab, node: str) -> dict[str, str]:
    """The last `mode switch` line of the node's agent, as key=value pairs."""
    lines = [line for line in lab.logs(node).splitlines() if "mode switch:" in line]
    assert lines, f"{node}: the agent logged no mode switch"
    return dict(re.findall(r"(\w+)=(\"[^\"]*\"|\S+)", lines[-1]))


def switch_timeline(lab) -> str:
    """Every agent's steps of the switches, in time order (what a failure is read against)."""
    steps = ("starting", "datapath is in place", "programs attached", "handing over", "mode switch:", "stopped",
             "handshakes still")
    lines = [f"{line[11:23]} {node}: {line.split(': ', 1)[-1][:300]}"
             for node in (n.name for n in lab.topology.nodes)
             for line in lab.logs(node).splitlines() if any(s in line for s in steps) and "watch" not in line]
    return "\n".join(sorted(lines))


def other_mode_gone(lab, mode: str) -> None:
    for node in (n.name for n in lab.topology.nodes):
        if mode == "ebpf":
            assert "KUBE-" not in lab.iptables_save(node), f"{node}: iptables chains left in ebpf mode"
        else:
            assert not (lab.dir / "bpffs" / node / pins.PIN_SUBDIR).exists(), f"{node}: pins left in iptables mode"


def test_established_connections_survive_both_switches_and_new_ones_never_fail(lab):
    lab.apply_manifests(MANIFESTS, "switch")
    lab.wait_converged()
    pump = Pump()
    figures = []
    try:
        for name, conn in open_conns(lab, "A").items():
            pump.add(name, conn)
        with Prober(lab, [("client-1", f"{VIP}:80"), ("outside", f"{GATEWAY}:{NODE_PORT}")],
                    timeout=PROBE_TIMEOUT) as prober:
            for mode in ("ebpf", "iptables"):
                started = time.monotonic()
                lab.set_mode(mode)
                took = time.monotonic() - started
                time.sleep(1.0)  # echoes after the switch, on the new datapath alone
                other_mode_gone(lab, mode)
                moved = {n: switched(lab, n) for n in ("worker1", "worker2")}
                figures.append((mode, took, dict(pump.echoes), prober.counts(), moved))
                assert not pump.errors, f"connections broke switching to {mode}: {pump.errors}"
                if mode == "ebpf":  # a second set, made by the eBPF programs, for the way back
                    for name, conn in open_conns(lab, "B").items():
                        pump.add(name, conn)
            time.sleep(1.0)
        ok, failed = prober.counts()
        timeline = switch_timeline(lab)
    finally:
        pump.stop()
        lab.delete_manifests(MANIFESTS, "switch")
    for mode, took, echoes, (p_ok, p_failed), moved in figures:
        print(f"\nswitch to {mode}: {took:.1f} s (stop, start, first sync, handover on 3 nodes); "
              f"fresh connections so far {p_ok} ok / {p_failed} failed")
        print("  echoes so far: " + ", ".join(f"{k}: {v}" for k, v in echoes.items()))
        for node, line in moved.items():
            print(f"  {node}: " + " ".join(f"{k}={v}" for k, v in line.items() if k not in ("cleanup",)))
    assert not pump.errors, pump.errors
    assert failed == 0, f"{failed} fresh connections failed: {prober.failed[:10]}\n{timeline}"
    assert ok > 50, f"too few fresh connections to prove anything ({ok})"
    assert all(n > 50 for n in pump.echoes.values()), pump.echoes
    into_ebpf, out_of_ebpf = figures[0][4], figures[1][4]
    # worker2 DNATs client-1's connection, worker1 DNATs and masquerades outside's two
    assert int(into_ebpf["worker2"]["adopted"]) >= 1 and int(into_ebpf["worker1"]["adopted"]) >= 2, into_ebpf
    assert int(out_of_ebpf["worker2"]["moved"]) >= 2 and int(out_of_ebpf["worker1"]["moved"]) >= 4, out_of_ebpf
    assert all(int(line.get("failed", 0)) == 0 for line in out_of_ebpf.values()), out_of_ebpf
