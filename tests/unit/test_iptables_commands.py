"""IptablesCommands' sysctl reads: in the agent (its own namespace, the plain runner) the value is
read from /proc/sys by the agent itself, a process start less per read on a restart's full sync;
with a command prefix (another namespace) or an injected runner, `cat` runs as before."""

from __future__ import annotations

import subprocess

from ebpf_proxy.datapath.iptables import apply
from ebpf_proxy.datapath.iptables.apply import IptablesCommands

KEY = "net.ipv4.ip_forward"  # in every network namespace, readable without privileges


def test_the_agents_own_namespace_is_read_without_a_command(monkeypatch):
    expected = open("/proc/sys/net/ipv4/ip_forward").read().strip()

    def no_command(*_args, **_kw):
        raise AssertionError("a process was started to read a sysctl")

    monkeypatch.setattr(subprocess, "run", no_command)
    cmd = IptablesCommands()
    assert cmd.sysctl_get(KEY) == expected
    assert cmd.sysctl_get("net.netfilter.no_such_key_here") is None


def test_another_namespace_reads_with_cat_through_the_plain_runner(monkeypatch):
    seen = []

    def plain(cmd, stdin=None):
        seen.append(tuple(cmd))
        return subprocess.CompletedProcess(cmd, 0, "1\n", "")

    monkeypatch.setattr(apply, "run_command", plain)  # the plain runner, recording
    prefix = ("nsenter", "--net=/run/netns/x")
    assert IptablesCommands(prefix=prefix).sysctl_get(KEY) == "1"
    assert seen == [(*prefix, "cat", "/proc/sys/net/ipv4/ip_forward")]
    IptablesCommands().sysctl_get(KEY)  # no prefix: read in place, as above
    assert len(seen) == 1


def test_an_injected_runner_reads_with_cat():
    seen = []

    def runner(cmd, stdin=None):
        seen.append(tuple(cmd))
        return subprocess.CompletedProcess(cmd, 1, "", "No such file")

    assert IptablesCommands(runner=runner).sysctl_get(KEY) is None
    assert seen == [("cat", "/proc/sys/net/ipv4/ip_forward")]
