"""The one interface every datapath implements: the agent decides *what*, a datapath decides *how*."""

from __future__ import annotations

import abc
from collections.abc import Callable
from dataclasses import dataclass, field

from ebpf_proxy.model import ChangeSet, NodeConfig, ProxyState


@dataclass
class SyncResult:
    """What a sync did, for metrics and logs (e.g. {"rules": 412} or {"map_writes": 3})."""

    counts: dict[str, int] = field(default_factory=dict)


class Datapath(abc.ABC):
    """Programs the kernel so that packets follow `ProxyState` (see shared SEMANTICS.md)."""

    mode: str = ""
    progress: Callable[[float], None] | None = None  # see report_progress

    def __init__(self, node: NodeConfig) -> None:
        self.node = node

    def report_progress(self, fraction: float) -> None:
        """How far the running sync is, 0..1, for whoever set `progress` (the agent: the gauge
        ebpf_proxy_sync_progress, which `lab agent NODE kill --during full-sync` watches to kill
        an agent halfway through a long sync)."""
        if self.progress is not None:
            self.progress(fraction)

    @abc.abstractmethod
    def sync(self, state: ProxyState, changes: ChangeSet) -> SyncResult:
        """Make the kernel match `state`. `changes` says what moved since the last successful sync;
        with `changes.full` the datapath reconciles everything. Raises on failure (the runner retries)."""

    @abc.abstractmethod
    def cleanup(self) -> None:
        """Remove everything this datapath ever installed on this node (idempotent)."""

    def installed(self) -> bool:
        """Whether this mode's kernel state is on the node, whoever put it there (a mode switch
        asks it of the mode it replaces, agent/handover.py)."""
        return False

    def prefetch(self) -> None:
        """Called once the datapath exists, while the agent still lists: start, in the background,
        what the first sync will read that does not depend on the Services (ebpf: a restart's
        read-back of the pinned maps). Nothing by default."""

    def expect_handover(self) -> None:
        """Called before the first sync when the other mode's datapath is still in place and its
        connections will be moved over once this one is programmed (agent/handover.py)."""

    def stats(self) -> dict[str, int]:
        """Kernel state size (rules, map entries) for metrics and the bench."""
        return {}

    def close(self) -> None:
        """Stop without removing the datapath (SIGTERM): traffic keeps flowing across restarts."""
