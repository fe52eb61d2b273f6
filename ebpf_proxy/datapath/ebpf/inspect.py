"""What a running eBPF datapath has counted and holds, read from its pinned maps.

Whoever debugs service traffic on a node needs the per-reason counters *now*: not the figures the
agent exported after its last sync, and without an agent that compiles anything. Every program
counts each packet under exactly one `structs.Reason` in the per-CPU array epx_stats, and the
maps are pinned under <bpffs>/ebpf-proxy/ (pins.py), so any process on the node can open them.
This module does that read-only (BPF_F_RDONLY: a debugging tool must not be able to change the
datapath), and also classifies reasons into verdicts, which the agent's live metrics share
(`verdict()`), so `ebpf-proxy stats` and /metrics speak the same vocabulary.

`Snapshot` is plain data: `snapshot()` builds it from synthetic counters too, so the rendering
is testable without root.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from ebpf_proxy.datapath.ebpf import libbpf, pins
from ebpf_proxy.datapath.ebpf import structs as s
from ebpf_proxy.datapath.ebpf.datapath import DEFAULT_BPFFS
from ebpf_proxy.datapath.ebpf.maps import Maps

BPF_F_RDONLY = libbpf.BPF_F_RDONLY

VERDICTS = ("drop", "reject", "pass", "translate", "event", "none")

# Reasons whose packet was rewritten (DNAT, SNAT and their reverses, socket LB, ARP): the rest
# follow from their name's prefix, see verdict().
_TRANSLATE = frozenset({
    s.Reason.FWD_NEW, s.Reason.FWD_ESTABLISHED, s.Reason.SNAT, s.Reason.REV_SNAT, s.Reason.REV_DNAT,
    s.Reason.SOCK_FWD, s.Reason.SOCK_REV, s.Reason.ARP_MASQ, s.Reason.ICMP_RELATED,
})

# The maps whose fill level matters when debugging (capacity, leaks), with what one entry is.
MAP_CONTENTS: dict[str, str] = {
    "epx_svc": "service frontends (clusterIP, nodePort, externalIP, LB IP)",
    "epx_backend": "backends",
    "epx_slot": "backend slots (cluster and local)",
    "epx_ct4": "connection-table entries (2 per connection, 4 if masqueraded)",
    "epx_affinity": "session-affinity entries",
    "epx_src_range": "loadBalancerSourceRanges entries",
    "epx_frag4": "IPv4 fragments awaiting their ports",
    "epx_sock_rev": "socket-LB UDP reverse entries",
    "epx_node_addr": "node addresses",
    "epx_pod_cidr": "local-traffic detector CIDRs",
    "epx_iface": "pod and local-traffic devices",
}


class InspectError(RuntimeError):
    """The pinned maps cannot be read; the message names the path and what to check."""


class NoPinnedMaps(InspectError):
    """No datapath's maps are pinned where we looked."""


def verdict(reason: s.Reason) -> str:
    """What happened to a packet counted under `reason`: drop, reject, pass, translate, event (an
    EV_* slot counts something that happened, such as an eviction, not a packet), or none
    (CONTINUE, which is never counted)."""
    if reason.name.startswith("EV_"):
        return "event"
    if reason.is_drop:
        return "drop"
    if reason.name.startswith("PASS_"):
        return "pass"
    if reason.name.endswith("REJECT"):
        return "reject"
    if reason in _TRANSLATE:
        return "translate"
    return "none"


COUNTED_REASONS = tuple(r for r in s.Reason if verdict(r) != "none")


@dataclass(frozen=True)
class ReasonCount:
    reason: s.Reason
    packets: int
    bytes: int

    @property
    def verdict(self) -> str:
        return verdict(self.reason)

    @property
    def is_drop(self) -> bool:
        return self.reason.is_drop


@dataclass(frozen=True)
class MapUsage:
    name: str
    entries: int
    max_entries: int

    @property
    def contents(self) -> str:
        return MAP_CONTENTS.get(self.name, "")


@dataclass(frozen=True)
class Snapshot:
    """Counters of every counted reason (zeros included) and map fill levels, from one pin dir."""

    pin_dir: Path | None
    reasons: tuple[ReasonCount, ...]
    maps: tuple[MapUsage, ...]

    def nonzero(self) -> tuple[ReasonCount, ...]:
        return tuple(r for r in self.reasons if r.packets or r.bytes)

    @property
    def dropped_packets(self) -> int:
        return sum(r.packets for r in self.reasons if r.is_drop)

    def to_json(self) -> dict:
        """The `stats --json` object. Every counted reason is present, zero or not, so a script can
        index any name without guarding against a missing key."""
        return {
            "pin_dir": str(self.pin_dir) if self.pin_dir is not None else None,
            "reasons": {r.reason.name: {"packets": r.packets, "bytes": r.bytes, "drop": r.is_drop,
                                        "verdict": r.verdict} for r in self.reasons},
            "maps": {m.name: {"entries": m.entries, "max_entries": m.max_entries} for m in self.maps},
        }


def snapshot(counters: Mapping[s.Reason, tuple[int, int]], maps: Mapping[str, tuple[int, int]] | None = None,
             pin_dir: Path | None = None) -> Snapshot:
    """A Snapshot from (packets, bytes) per reason (a reason absent counts zero) and
    (entries, max_entries) per map name, in MAP_CONTENTS order."""
    reasons = tuple(ReasonCount(r, *counters.get(r, (0, 0))) for r in COUNTED_REASONS)
    usage = tuple(MapUsage(name, *maps[name]) for name in MAP_CONTENTS if maps and name in maps)
    return Snapshot(pin_dir, reasons, usage)


# ---- reading the pinned maps ----


def locate(bpffs: str | Path | None = None) -> Path:
    """The pin directory to read: under `bpffs` when given; otherwise the one whose datapath serves
    this network namespace (found by netns cookie, as cleanup finds it: a lab node's bpffs is not
    /sys/fs/bpf), else the default /sys/fs/bpf/ebpf-proxy."""
    if bpffs is not None:
        return pins.pin_dir(bpffs)
    found = pins.find_pin_dirs(pins.netns_cookie())
    return found[0] if found else pins.pin_dir(DEFAULT_BPFFS)


def _open_readonly(path: Path) -> int:
    """An fd of the map pinned at `path` that can read but not write. Raises OSError."""
    return libbpf.obj_get_readonly(str(path))


def _open_all(pin_dir: Path, by_default: bool) -> dict[str, int]:
    if not (pin_dir / "epx_stats").exists():
        hint = " (and no bpf mount holds the maps of this network namespace's datapath; give --bpffs)" \
            if by_default else ""
        raise NoPinnedMaps(f"no ebpf-proxy maps pinned under {pin_dir}{hint}: "
                           "is the agent running in ebpf mode on this node?")
    missing = sorted(name for name in s.MAPS if not (pin_dir / name).exists())
    if missing:
        raise InspectError(f"{pin_dir}: maps {', '.join(missing)} are not pinned: the agent that pinned these "
                           "maps is another version of ebpf-proxy (or is starting); retry once it has synced")
    fds: dict[str, int] = {}
    try:
        for name in s.MAPS:
            fds[name] = _open_readonly(pin_dir / name)
            _check_layout(pin_dir / name, fds[name])
    except BaseException:
        for fd in fds.values():
            os.close(fd)
        raise
    return fds


def _check_layout(path: Path, fd: int) -> None:
    """Refuse maps of another build instead of misreading them."""
    spec = s.MAPS[path.name]
    info = libbpf.map_info(fd)
    want = (ctypes.sizeof(spec.key), ctypes.sizeof(spec.leaf))
    if (info.key_size, info.value_size) != want:
        raise InspectError(f"{path}: key/value size {info.key_size}/{info.value_size}, this ebpf-proxy expects "
                           f"{want[0]}/{want[1]}: the agent is another version; run this version's stats")


def open_maps_readonly(pin_dir: Path, by_default: bool = False) -> Maps:
    """Every map pinned in `pin_dir`, opened read-only and checked against this build's layouts
    (stats, trace). Raises InspectError (NoPinnedMaps when nothing is there)."""
    try:
        fds = _open_all(pin_dir, by_default=by_default)
    except libbpf.LibbpfMissing as exc:
        raise InspectError(str(exc)) from exc
    except PermissionError as exc:
        raise InspectError(f"{exc.filename}: {exc.strerror}: reading BPF maps needs root (CAP_BPF)") from exc
    except OSError as exc:
        raise InspectError(f"{exc.filename or pin_dir}: cannot open: {exc.strerror or exc}") from exc
    return Maps(fds, owned=True)


def read(bpffs: str | Path | None = None) -> Snapshot:
    """Counters and map fill levels of the datapath pinned under `bpffs` (see locate()), opened
    read-only without compiling anything. Raises InspectError (NoPinnedMaps when nothing is there)."""
    pin_dir = locate(bpffs)
    maps = open_maps_readonly(pin_dir, by_default=bpffs is None)
    try:
        counters = maps.stats()
        usage = {name: (maps.count(name), libbpf.map_info(maps._fd(name)).max_entries) for name in MAP_CONTENTS}
    except OSError as exc:
        raise InspectError(f"{pin_dir}: reading the maps failed: {exc}") from exc
    finally:
        maps.close()
    return snapshot(counters, usage, pin_dir)
