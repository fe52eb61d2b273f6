"""The sync progress an agent reports on /metrics, and what `lab agent NODE kill --during` reads of it.

The kill must land while a full sync is being written and no earlier than asked: the gauges go up
when a sync starts, follow the datapath's reports, and go back to 0 when it ends, also when it
fails; the lab's parser reads exactly those samples from the real exposition text.
"""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from ebpf_proxy.agent.metrics import Metrics
from ebpf_proxy.cli import main
from ebpf_proxy.datapath.fake import FakeDatapath
from ebpf_proxy.lab.agent_fault import SyncProgress, parse_progress
from ebpf_proxy.model import NodeConfig


def text(m: Metrics) -> str:
    return m.render().decode()


def test_gauges_follow_a_sync_and_the_lab_parses_them():
    m = Metrics()
    assert parse_progress(text(m)) == SyncProgress(full=False, partial=False, fraction=0.0)
    m.sync_started(full=True)
    m.sync_progress.set(0.25)
    assert parse_progress(text(m)) == SyncProgress(full=True, partial=False, fraction=0.25)
    m.sync_ended(full=True)
    m.sync_started(full=False)
    assert parse_progress(text(m)) == SyncProgress(full=False, partial=True, fraction=0.0)
    m.sync_ended(full=False)
    assert not parse_progress(text(m)).running


def test_a_datapath_reports_progress_only_to_whoever_listens():
    dp = FakeDatapath(NodeConfig("n1"))
    dp.report_progress(0.5)  # nobody listens: nothing happens
    seen = []
    dp.progress = seen.append
    dp.report_progress(0.5)
    assert seen == [0.5]


def test_kill_options_are_checked_before_anything_is_done():
    runner = CliRunner()
    out = runner.invoke(main, ["lab", "agent", "worker1", "kill", "--during", "sometimes"])
    assert out.exit_code == 2 and "sometimes" in out.output
    assert "kill" in runner.invoke(main, ["lab", "agent", "--help"]).output


@pytest.mark.parametrize("at", [-0.1, 1.5])
def test_kill_refuses_a_moment_outside_the_sync(at):
    from ebpf_proxy.lab import agent_fault
    from ebpf_proxy.lab.cluster import LabError

    class NoLab:
        class topology:
            @staticmethod
            def node(name):
                return name

    with pytest.raises(LabError, match="--at"):
        agent_fault.kill(NoLab(), "worker1", during="full-sync", at=at)
