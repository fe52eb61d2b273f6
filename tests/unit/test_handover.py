"""The mode switch's orchestration (agent/handover.py), with fake datapaths and a fake conntrack:
which mode is taken over, when a handshake is adopted, and that the old mode is removed even
when moving its connections fails. The real moves are tested in tests/bpf/test_tc_handover.py,
tests/lab/test_kernel_nat.py and, with real traffic, tests/e2e/test_mode_switch.py."""

from __future__ import annotations

import socket
from dataclasses import replace

from ebpf_proxy.agent import handover
from ebpf_proxy.datapath.fake import FakeDatapath
from ebpf_proxy.datapath.kernel_nat import TCP_ESTABLISHED, TCP_SYN_SENT, NatConnection
from ebpf_proxy.model import NodeConfig

NODE = NodeConfig(node_name="n1")
EST = NatConnection(socket.IPPROTO_TCP, "10.244.1.5", 40000, "10.96.0.10", 80, "10.244.2.7", 8080,
                    "10.244.1.5", 40000, 300)
SYN = replace(EST, client_port=40001, source_port=40001, tcp_state=TCP_SYN_SENT, seen_reply=False)


class Installed(FakeDatapath):
    """A datapath that says whether it is on the node, and records what the handover asks."""

    def __init__(self, node, mode: str, installed: bool = False, fail: bool = False, **opts) -> None:
        super().__init__(node)
        self.mode, self._installed, self.fail, self.opts = mode, installed, fail, opts
        self.batches: list[list[NatConnection]] = []
        self.steps: list[str] = []
        self.ended = False

    def installed(self) -> bool:
        return self._installed

    def adopt_connections(self, connections, adopted):
        if self.fail:
            raise OSError("maps gone")
        connections = list(connections)
        if connections:
            self.batches.append(connections)
            self.steps.append("adopt " + ",".join(str(c.client_port) for c in connections))
        for conn in connections:
            adopted(conn)
        return {"adopted": len(connections)}

    def take_new_connections(self) -> None:
        self.steps.append("SYNs ours")

    def end_handover(self) -> None:
        self.ended = True


class Kernel:
    """conntrack whose dumps are given in turn (the last one repeats); records removals."""

    def __init__(self, *dumps) -> None:
        self.dumps, self.removed = list(dumps), []

    def __call__(self):
        return self

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None

    def dump(self):
        current = self.dumps.pop(0) if len(self.dumps) > 1 else self.dumps[0]
        return [c for c in current if c not in self.removed]

    def remove(self, conn) -> bool:
        self.removed.append(conn)
        return True


def factory_with(installed: set[tuple[str, str | None]], created: list):
    def factory(mode, node, backend=None, **opts):
        dp = Installed(node, mode, installed=(mode, backend) in installed, **opts)
        created.append(dp)
        return dp
    return factory


def test_the_other_mode_is_taken_over_when_any_of_its_backends_holds_it():
    created: list = []
    assert handover.previous_mode("ebpf", NODE, factory_with({("iptables", "nft")}, created)) == "iptables"
    assert handover.previous_mode("iptables", NODE, factory_with({("ebpf", None)}, created)) == "ebpf"
    assert handover.previous_mode("ebpf", NODE, factory_with(set(), created)) is None
    assert handover.previous_mode("ebpf", NODE, factory_with({("ebpf", None)}, created)) is None  # its own mode
    assert all(dp.cleanups == 0 for dp in created), "asking must not remove anything"


def test_a_handshake_is_adopted_once_it_is_established_and_only_then_are_syns_ours():
    dp = Installed(NODE, "ebpf")
    kernel = Kernel([EST, SYN], [EST, replace(SYN, tcp_state=TCP_ESTABLISHED, seen_reply=True)])
    counts = handover._into_ebpf(dp, kernel, settle=5.0, poll=0.001)
    assert dp.steps == ["adopt 40000", "adopt 40001", "SYNs ours"]
    assert counts == {"adopted": 2} and dp.ended and len(kernel.removed) == 2


def test_what_the_rules_made_meanwhile_is_moved_after_syns_are_ours():
    late = replace(EST, client_port=40002, source_port=40002)
    dp = Installed(NODE, "ebpf")
    handover._into_ebpf(dp, Kernel([EST], [late]), settle=5.0, poll=0.001)
    assert dp.steps == ["adopt 40000", "SYNs ours", "adopt 40002"]


def test_a_handshake_that_never_finishes_is_adopted_as_it_is_after_the_settle_time():
    dp = Installed(NODE, "ebpf")
    handover._into_ebpf(dp, Kernel([EST, SYN]), settle=0.05, poll=0.001)
    assert dp.steps == ["adopt 40000", "adopt 40001", "SYNs ours"] and dp.ended


def test_the_flag_is_cleared_even_when_adopting_fails():
    dp = Installed(NODE, "ebpf", fail=True)
    try:
        handover._into_ebpf(dp, Kernel([EST]), settle=0.05, poll=0.001)
    except OSError:
        pass
    assert dp.ended


def test_the_old_mode_is_removed_even_when_moving_its_connections_fails(monkeypatch):
    cleaned = []
    monkeypatch.setattr(handover, "cleanup_all", lambda node, modes, factory, **o: cleaned.append(modes) or [])
    monkeypatch.setattr(handover, "_into_ebpf", lambda dp: dp.adopt_connections([EST], adopted=print))
    result = handover.hand_over("ebpf", "iptables", Installed(NODE, "ebpf", fail=True), NODE)
    assert result.failed and result.counts == {"failed": 1}
    assert cleaned == [("iptables",)]
