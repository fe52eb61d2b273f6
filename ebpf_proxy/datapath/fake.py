"""A datapath that records what it was asked: lets control-plane tests run without root."""

from __future__ import annotations

from ebpf_proxy.datapath.base import Datapath, SyncResult
from ebpf_proxy.model import ChangeSet, ProxyState


class FakeDatapath(Datapath):
    mode = "fake"

    def __init__(self, node, fail_times: int = 0) -> None:
        super().__init__(node)
        self.syncs: list[tuple[ProxyState, ChangeSet]] = []
        self.cleanups = 0
        self._fail_times = fail_times

    def sync(self, state: ProxyState, changes: ChangeSet) -> SyncResult:
        if self._fail_times > 0:
            self._fail_times -= 1
            raise RuntimeError("fake datapath: injected sync failure")
        self.syncs.append((state, changes))
        return SyncResult(counts={"services": len(state.services)})

    def cleanup(self) -> None:
        self.cleanups += 1

    @property
    def last_state(self) -> ProxyState | None:
        return self.syncs[-1][0] if self.syncs else None
