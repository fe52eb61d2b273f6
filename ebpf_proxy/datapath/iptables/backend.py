"""Which iptables backend to drive: legacy or nft, the way kube-proxy's iptables-wrapper decides.

Two rules: never mix the backends in one network namespace (each keeps its own tables: rules in
one are invisible to the other, and both run), and when nothing decides, pick the faster one.
So: the backend that already holds Kubernetes chains (kubelet's, or ours from an earlier run)
wins; else the one holding more rules; else legacy when it is installed, because with iptables
1.8.9 `iptables-nft-restore --noflush` of a 10,000-service ruleset takes ~40 s where
`iptables-legacy-restore --noflush` takes ~0.7 s (measured on this project's 2-core machine).

Each IP family has its own commands (ip6tables, ip6tables-save, ... for IPv6) and is decided on
its own, from its own save command's output, as kube-proxy's iptables-wrapper does.
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass

log = logging.getLogger(__name__)

COMMANDS: dict[str, dict[str, tuple[str, ...]]] = {
    "legacy": {"iptables": ("iptables-legacy",), "iptables_save": ("iptables-legacy-save",),
               "iptables_restore": ("iptables-legacy-restore",)},
    "nft": {"iptables": ("iptables-nft",), "iptables_save": ("iptables-nft-save",),
            "iptables_restore": ("iptables-nft-restore",)},
    # whatever the system's `iptables` alternative points at
    "default": {"iptables": ("iptables",), "iptables_save": ("iptables-save",),
                "iptables_restore": ("iptables-restore",)},
}
# the same for IPv6: ip6tables keeps tables of its own, beside iptables'
COMMANDS6: dict[str, dict[str, tuple[str, ...]]] = {
    "legacy": {"iptables": ("ip6tables-legacy",), "iptables_save": ("ip6tables-legacy-save",),
               "iptables_restore": ("ip6tables-legacy-restore",)},
    "nft": {"iptables": ("ip6tables-nft",), "iptables_save": ("ip6tables-nft-save",),
            "iptables_restore": ("ip6tables-nft-restore",)},
    "default": {"iptables": ("ip6tables",), "iptables_save": ("ip6tables-save",),
                "iptables_restore": ("ip6tables-restore",)},
}
BACKENDS = ("auto", "legacy", "nft", "default")
FAMILIES = (4, 6)

Run = Callable[[Sequence[str]], "tuple[int, str]"]


@dataclass(frozen=True)
class Detected:
    """The backend chosen, and the whole iptables-save of it read to decide (None when it was not
    read, or failed): a datapath's first full sync reads its chains from that save instead of
    saving again (~0.2 s of a restart at 10,000 Services)."""

    backend: str
    save: str | None = None


def _rules(output: str) -> tuple[int, int]:
    """(Kubernetes chains, rules) in an iptables-save dump: lines starting ":KUBE-" or "-A KUBE-",
    and lines starting "-A ". Counted in place: a save at 10,000 Services has ~110,000 lines,
    and this runs while the agent lists."""
    text = "\n" + output
    return text.count("\n:KUBE-") + text.count("\n-A KUBE-"), text.count("\n-A ")


def family_commands(family: int = 4) -> dict[str, dict[str, tuple[str, ...]]]:
    """backend -> the three command tuples, for IP `family` (4: iptables, 6: ip6tables)."""
    if family not in FAMILIES:
        raise ValueError(f"iptables backend: IP family {family!r} is not 4 or 6")
    return COMMANDS if family == 4 else COMMANDS6


def detect(run: Run, prefix: Sequence[str] = (), family: int = 4) -> str:
    """'legacy' or 'nft' (or 'default' when neither variant is installed), for IP `family`."""
    return detect_reading(run, prefix, family).backend


def detect_reading(run: Run, prefix: Sequence[str] = (), family: int = 4) -> Detected:
    """detect(), with the chosen backend's save output when it was read to decide."""
    table = family_commands(family)
    seen: dict[str, tuple[int, int]] = {}
    saves: dict[str, str] = {}
    for name in ("legacy", "nft"):
        save = table[name]["iptables_save"]
        if shutil.which(save[0]) is None:
            continue
        code, out = run([*prefix, *save])
        seen[name] = _rules(out) if code == 0 else (0, 0)
        if code == 0:
            saves[name] = out
    if not seen:
        return Detected("default")
    used = {name: counts for name, counts in seen.items() if counts != (0, 0)}
    if used:
        choice = max(used, key=lambda name: used[name])
        why = f"it already holds rules ({used[choice][0]} Kubernetes, {used[choice][1]} in all)"
    else:
        choice = "legacy" if "legacy" in seen else "nft"
        why = "no backend holds rules yet" + (": legacy restores large rulesets far faster" if choice == "legacy" else "")
    if family == 4:
        log.info("iptables backend: %s (%s)", choice, why, extra={"backend": choice})
    else:
        log.info("ip6tables backend: %s (%s)", choice, why, extra={"backend": choice, "family": family})
    return Detected(choice, saves.get(choice))


def commands(backend: str, run: Run, prefix: Sequence[str] = (), family: int = 4) -> dict[str, tuple[str, ...]]:
    """The three command tuples for BACKEND ('auto' detects) and IP `family`."""
    if backend not in BACKENDS:
        raise ValueError(f"iptables backend: {backend!r} is not one of {', '.join(BACKENDS)}")
    table = family_commands(family)
    return table[detect(run, prefix, family) if backend == "auto" else backend]
