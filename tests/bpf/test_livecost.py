"""bench/livecost.py: the kernel's own run-time counters of the pinned programs, while BPF
statistics are on, and only then."""

from __future__ import annotations

from pathlib import Path

import pytest

from ebpf_proxy.bench import livecost
from tests.bpf import world as w
from tests.bpf.packets import run, tcp

pytestmark = [pytest.mark.bpf, pytest.mark.root]


def test_counts_each_run_of_each_program_while_statistics_are_on(datapath, maps, pin_dir):
    w.install(maps, w.web())
    live = livecost.LiveCost(pin_dir)
    try:
        with livecost.statistics_on():
            before = live.sample()
            for port in range(40000, 40025):
                run(datapath, "tc_ingress", tcp(w.POD_CLIENT, port, w.VIP, 80))
            after = live.sample()
        idle = live.sample()
        run(datapath, "tc_ingress", tcp(w.POD_CLIENT, 41000, w.VIP, 80))
        unseen = live.sample()
    finally:
        live.close()
    assert after["tc_ingress"].run_cnt - before["tc_ingress"].run_cnt == 25
    cost = livecost.ns_per_run(before, after)
    assert cost["tc_ingress"] is not None and cost["tc_ingress"] > 0
    assert cost["tc_egress"] is None  # it did not run
    assert unseen == idle, "with the statistics off again, the kernel counts nothing"
    assert not live.fds


def test_a_pin_directory_without_the_programs_is_named(tmp_path: Path):
    (tmp_path / "progs" / "0123abcd").mkdir(parents=True)
    (tmp_path / "progs" / "0123abcd" / "tc_ingress").write_text("")
    with pytest.raises(livecost.LiveCostError, match=r"progs: no pinned program tc_egress"):
        livecost.program_pins(tmp_path)
    with pytest.raises(livecost.LiveCostError, match="no pinned program tc_ingress, tc_egress"):
        livecost.program_pins(tmp_path / "nothing")


def test_ns_per_run():
    before = {"a": livecost.Sample(1_000, 10), "b": livecost.Sample(0, 0)}
    after = {"a": livecost.Sample(3_000, 14), "b": livecost.Sample(0, 0)}
    assert livecost.ns_per_run(before, after) == {"a": 500.0, "b": None}
