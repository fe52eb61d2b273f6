"""Remove everything any datapath mode installed on this node (`ebpf-proxy cleanup`).

An agent that is stopped leaves its datapath in place on purpose (traffic keeps flowing across
restarts), so uninstalling, or switching from ebpf to iptables, needs an explicit cleanup. It
tries every mode that leaves kernel state, whatever mode last ran: the operator should not have
to remember. A mode whose implementation cannot be imported here (no bcc, say) is skipped, not
failed: it cannot have installed anything from this installation either. The iptables mode is
cleaned per backend and per IP family (iptables and, where installed, ip6tables).
"""

from __future__ import annotations

import logging
import shutil
from dataclasses import dataclass
from typing import Any, Callable

from ebpf_proxy.datapath import KERNEL_MODES, Datapath, DatapathUnavailable, create_datapath
from ebpf_proxy.model import NodeConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CleanupResult:
    mode: str
    outcome: str  # "cleaned", "skipped" or "failed"
    detail: str = ""

    @property
    def failed(self) -> bool:
        return self.outcome == "failed"

    def line(self) -> str:
        return f"{self.mode}: {self.outcome}" + (f" ({self.detail})" if self.detail else "")


def mode_variants(modes: tuple[str, ...]) -> list[tuple[str, str, dict[str, str]]]:
    """(mode, label, extra options): the iptables mode once per installed backend, since rules
    left in either one (an earlier run may have picked the other) keep acting on packets.
    IPv4 only; `family_variants` adds the ip6tables ones."""
    out: list[tuple[str, str, dict[str, str]]] = []
    for mode in modes:
        backends = [b for b in ("legacy", "nft") if shutil.which(f"iptables-{b}-restore")] if mode == "iptables" else []
        out += [(mode, f"{mode} ({b})", {"backend": b}) for b in backends] or [(mode, mode, {})]
    return out


def family_variants(modes: tuple[str, ...]) -> list[tuple[str, str, dict[str, str], int]]:
    """(mode, label, extra options, IP family): `mode_variants` (family 4), then the iptables mode
    once more per installed ip6tables backend, family 6, since an IPv6 datapath keeps its rules in
    ip6tables, which iptables neither sees nor removes (kube-proxy's cleanup does both families
    too). No IPv6 variant where no ip6tables command is installed."""
    out: list[tuple[str, str, dict[str, str], int]] = []
    for mode in modes:
        out += [(mode, label, extra, 4) for mode, label, extra in mode_variants((mode,))]
        if mode != "iptables":
            continue
        backends = [b for b in ("legacy", "nft") if shutil.which(f"ip6tables-{b}-restore")]
        if backends:
            out += [(mode, f"{mode} ({b}, IPv6)", {"backend": b}, 6) for b in backends]
        elif shutil.which("ip6tables-restore"):
            out.append((mode, f"{mode} (IPv6)", {}, 6))
    return out


def cleanup_all(node_name: str, modes: tuple[str, ...] = KERNEL_MODES,
                factory: Callable[..., Datapath] = create_datapath, *, families: tuple[int, ...] = (4, 6),
                only_installed: bool = False, **opts: Any) -> list[CleanupResult]:
    """Run `cleanup()` of each mode's datapath (the iptables one per backend and IP family, of
    `families` only); one result per variant, never raises. `only_installed`: a variant whose
    datapath says nothing of it is installed is left alone, and has no result."""
    nodes = {family: NodeConfig(node_name=node_name, family=family) for family in (4, 6)}
    results = []
    for mode, label, extra, family in family_variants(modes):
        if family not in families:
            continue
        node = nodes[family]
        try:
            datapath = factory(mode, node, **opts, **extra)
        except DatapathUnavailable as exc:
            results.append(CleanupResult(label, "skipped", str(exc)))
            continue
        except Exception as exc:
            results.append(CleanupResult(label, "failed", f"cannot create the datapath: {exc}"))
            continue
        try:
            if only_installed and not datapath.installed():
                continue
            datapath.cleanup()
        except Exception as exc:
            results.append(CleanupResult(label, "failed", str(exc)))
        else:
            results.append(CleanupResult(label, "cleaned"))
        finally:
            try:
                datapath.close()
            except Exception:
                log.debug("closing the %s datapath after cleanup failed", mode, exc_info=True)
    for result in results:
        level = logging.ERROR if result.failed else logging.INFO
        log.log(level, "cleanup %s: %s", result.mode, result.outcome,
                extra={"mode": result.mode, "outcome": result.outcome, "detail": result.detail})
    return results
