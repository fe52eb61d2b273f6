"""Switching proxy modes on a node without breaking connections: make before break.

An agent that starts in one mode while the other mode's datapath is still in place (its agent
was stopped: a DaemonSet rolled to another mode, `lab mode`, or kube-proxy's rules left behind)
does not clean up first. It programs its own datapath beside the old one, moves the old one's
established connections into its own connection tracking, and only then removes the old one:

- iptables -> ebpf. The eBPF programs attach with CFG_F_NETFILTER_FIRST: any packet without
  an epx_ct4 entry, even a SYN, is left to netfilter, whose rules and conntrack keep serving
  (bpf/lib/lb4.h). Each connection the kernel translated is written into epx_ct4 and its kernel
  entry deleted; a handshake under way is left to finish first (its SYN-ACK would be INVALID to
  a netfilter without the entry). Once those the kernel had at the start are moved, and at a
  moment when no handshake is under way, CFG_F_NETFILTER_MIDSTREAM makes new connections (a SYN)
  the programs' own; what the rules made meanwhile is moved too, then the flag is cleared and
  the iptables rules are removed. (With SYNs ours from the start, a SYN the client retransmits
  for a handshake its first SYN began through the rules would open a second connection beside
  the kernel's: the two clash in conntrack and the handshake stalls.)
- ebpf -> iptables. The iptables rules go in first (inert: TC translates before netfilter
  looks). epx_config gets CFG_F_NETFILTER_FIRST: from then on the programs translate only the
  connections in epx_ct4, anything else reaches the new rules. Each connection is written into
  the kernel's conntrack with its NAT (datapath/kernel_nat.py) and forgotten in epx_ct4; then
  the programs are detached and the pins removed.

IPv6 (ebpf mode serves it with the programs too): the programs' IPv6 path moves no connections
(bpf/lib/lb6.h). Switching to ebpf, the ip6tables rules stay until the IPv6 datapath's first sync
switched the programs' IPv6 path on, then go (remove_ip6tables_leftovers, or the cleanup below);
switching to iptables, the ip6tables rules are in place (every family syncs before the handover)
when the programs, both families' at once, are removed. Either way the IPv6 connections the old
datapath translated break; new ones never wait. The handover itself runs on the IPv4 family's
datapath, or the IPv6 one's on an IPv6-only node (whose old datapath is then found and removed
the same way).

A connection is moved in three steps, microseconds apart: its epx_ct4 entry is held
(CT4_S_HELD: its packets are dropped), the kernel's entry is deleted or made, the epx_ct4 entry
is released or forgotten. With both in place a packet would be tracked by netfilter as a new
connection, and its NAT would give it another source port: the backend would answer with a
reset. A dropped packet is retransmitted.
New connections never wait: the old datapath serves until the new one is programmed.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from ebpf_proxy.agent.cleanup import CleanupResult, cleanup_all, mode_variants
from ebpf_proxy.datapath import Datapath, DatapathUnavailable, create_datapath
from ebpf_proxy.model import NodeConfig

log = logging.getLogger(__name__)

OTHER_MODE = {"ebpf": "iptables", "iptables": "ebpf"}
HALF_OPEN_SETTLE = 2.0  # seconds a handshake under way may take to finish before it is adopted anyway
HALF_OPEN_POLL = 0.05


@dataclass
class HandoverResult:
    """What one mode switch moved (logged once, exposed for tests and the lab)."""

    from_mode: str
    to_mode: str
    counts: dict[str, int] = field(default_factory=dict)
    cleanup: list[CleanupResult] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def failed(self) -> bool:
        return bool(self.counts.get("failed")) or any(r.failed for r in self.cleanup)


def _variant_installed(mode: str, node: NodeConfig, factory: Callable[..., Datapath], **opts: Any) -> bool:
    for _mode, _label, extra in mode_variants((mode,)):
        try:
            other = factory(mode, node, **opts, **extra)
        except (DatapathUnavailable, FileNotFoundError):
            continue  # not installable here: it cannot have installed anything either
        try:
            if other.installed():
                return True
        except Exception:  # noqa: BLE001 - a check that cannot run must not stop the agent
            log.warning("cannot tell whether the %s datapath is installed", mode, exc_info=True)
        finally:
            other.close()
    return False


def previous_mode(mode: str, node: NodeConfig, factory: Callable[..., Datapath] = create_datapath,
                  **opts: Any) -> str | None:
    """The other kernel mode, when its datapath is on this node; else None."""
    other = OTHER_MODE.get(mode)
    if other and _variant_installed(other, node, factory, **opts):
        return other
    return None


def _key(conn) -> tuple:
    return conn.proto, conn.client, conn.client_port, conn.frontend, conn.frontend_port


def _into_ebpf(datapath: Any, kernel_conntrack: Callable[[], Any] | None = None,
               settle: float = HALF_OPEN_SETTLE, poll: float = HALF_OPEN_POLL) -> dict[str, int]:
    """Adopt the kernel's connections in the two phases of the module docstring."""
    if kernel_conntrack is None:
        from ebpf_proxy.datapath.kernel_nat import KernelConntrack as kernel_conntrack

    counts: dict[str, int] = {}
    try:
        with kernel_conntrack() as kernel:
            mover = _Mover(datapath, kernel, counts, poll)
            at_start = list(kernel.dump())
            first = {_key(c) for c in at_start}
            mover.adopt_until(lambda pending: not any(_key(c) in first for c in pending), settle, at_start)
            mover.wait_for(lambda pending: not any(c.half_open for c in pending), settle)
            datapath.take_new_connections()
            mover.adopt_until(lambda pending: not pending, settle)
    finally:  # whatever happened, packets without an entry are the programs' own again
        datapath.end_handover()
    return counts


class _Mover:
    """Adopts what the kernel translates, a handshake only once it is done (or time is up)."""

    def __init__(self, datapath: Any, kernel: Any, counts: dict[str, int], poll: float) -> None:
        self.datapath, self.kernel, self.counts, self.poll = datapath, kernel, counts, poll
        self.done: set[tuple] = set()

    def pending(self) -> list:
        return [c for c in self.kernel.dump() if _key(c) not in self.done]

    def wait_for(self, condition: Callable[[list], bool], settle: float) -> None:
        deadline = time.monotonic() + settle
        while not condition(self.pending()) and time.monotonic() < deadline:
            time.sleep(self.poll)

    def adopt_until(self, finished: Callable[[list], bool], settle: float, dumped: list | None = None) -> None:
        """Adopt settled connections until `finished(what is left)`; after `settle` seconds,
        adopt whatever is left as it is. `dumped`: the kernel's table, if just read."""
        deadline = time.monotonic() + settle
        while True:
            pending, dumped = (self.pending() if dumped is None else dumped), None
            last = time.monotonic() >= deadline
            ready = pending if last else [c for c in pending if not c.half_open]
            if last and any(c.half_open for c in pending):
                log.warning("handshakes still under way after %.1f s, adopted as they are: %s", settle,
                            "; ".join(f"{c.describe()} (state {c.tcp_state})" for c in pending if c.half_open))
            if ready:
                for key, n in self.datapath.adopt_connections(ready, adopted=self.kernel.remove).items():
                    self.counts[key] = self.counts.get(key, 0) + n
            self.done.update(_key(c) for c in ready)
            if last or finished([c for c in pending if _key(c) not in self.done]):
                return
            time.sleep(self.poll)


def _out_of_ebpf(pin_dir) -> dict[str, int]:
    from ebpf_proxy.datapath.ebpf import handover as ebpf_handover
    from ebpf_proxy.datapath.ebpf import structs
    from ebpf_proxy.datapath.ebpf.maps import Maps
    from ebpf_proxy.datapath.kernel_nat import KernelConntrack

    counts = {"moved": 0, "failed": 0}
    maps = Maps.open_pinned(pin_dir)
    try:
        ebpf_handover.set_handover(maps, structs.CFG_F_NETFILTER_FIRST)
        outgoing = ebpf_handover.outgoing(maps, time.monotonic_ns())
        log.info("handing over %d connections to the kernel's conntrack", len(outgoing))
        with KernelConntrack() as kernel:
            for conn in outgoing:
                # held (its packets dropped) while both know it: see common.h, CT4_S_HELD
                ebpf_handover.hold(maps, conn)
                try:
                    kernel.install(conn)
                except OSError as exc:
                    ebpf_handover.hold(maps, conn, held=False)
                    log.warning("connection %s not handed over: %s", conn.describe(), exc)
                    counts["failed"] += 1
                    continue
                ebpf_handover.forget(maps, conn)
                counts["moved"] += 1
    finally:
        maps.close()
    return counts


def remove_ip6tables_leftovers(node_name: str, factory: Callable[..., Datapath] = create_datapath,
                               **opts: Any) -> list[CleanupResult]:
    """In ebpf mode the programs serve IPv6: remove the ip6tables rules an earlier agent left (an
    iptables-mode agent, or an ebpf-mode agent from before the programs served IPv6, which served
    IPv6 with ip6tables), which would otherwise still act on what the programs pass up (a node's
    own connections to a Service, NodePorts the programs leave alone) with rules of the past.
    Called once the IPv6 datapath's first sync switched the programs' IPv6 path on (make before
    break). IPv6 connections the rules translated are not moved (the programs' IPv6 path has no
    handover, bpf/lib/lb6.h): they break, as at any restart of an iptables-mode node's rules.
    Each variant only where it is installed; never raises."""
    results = cleanup_all(node_name, modes=("iptables",), factory=factory, families=(6,), only_installed=True, **opts)
    if results:
        log.info("removed the ip6tables rules an earlier agent left: the eBPF programs serve IPv6",
                 extra={"cleanup": "; ".join(r.line() for r in results)})
    return results


def hand_over(mode: str, previous: str, datapath: Datapath, node: NodeConfig,
              factory: Callable[..., Datapath] = create_datapath, **opts: Any) -> HandoverResult:
    """Move `previous`'s connections to `datapath` (programmed: its first sync is done), then
    remove `previous`'s datapath. Never raises: a connection that cannot be moved is counted
    and logged, and the old datapath is removed all the same (left in place, it would keep
    translating with what it held when its agent stopped)."""
    started = time.monotonic()
    result = HandoverResult(from_mode=previous, to_mode=mode)
    try:
        if mode == "ebpf":
            result.counts = _into_ebpf(datapath)
        else:
            old = factory(previous, node, **opts)
            try:
                pin_dir = old.serving_pin_dir()  # type: ignore[attr-defined]
            finally:
                old.close()
            result.counts = _out_of_ebpf(pin_dir) if pin_dir is not None else {}
    except Exception as exc:  # noqa: BLE001 - see the docstring
        log.error("handing connections over from %s failed: %s", previous, exc, exc_info=True)
        result.counts["failed"] = result.counts.get("failed", 0) + 1
    result.cleanup = cleanup_all(node.node_name, modes=(previous,), factory=factory, **opts)
    result.seconds = time.monotonic() - started
    log.info("mode switch: %s -> %s done", previous, mode, extra={
        "from_mode": previous, "to_mode": mode, "seconds": round(result.seconds, 3), **result.counts,
        "cleanup": "; ".join(r.line() for r in result.cleanup)})
    return result
