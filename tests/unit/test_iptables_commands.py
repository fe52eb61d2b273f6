"""Sysctls' reads and writes, and run_command. The sysctls: in the agent (its own namespace,
the plain runner) the value is read from /proc/sys by the agent itself, a process start less per
read on a restart's full sync; with a command prefix (another namespace) or an injected runner,
`cat` runs as before. run_command: its streams are memory files, whole in and out."""

from __future__ import annotations

import subprocess

import pytest

from ebpf_proxy.datapath.iptables import apply
from ebpf_proxy.datapath.iptables.apply import IptablesError, Sysctls

KEY = "net.ipv4.ip_forward"  # in every network namespace, readable without privileges


def test_the_agents_own_namespace_is_read_without_a_command(monkeypatch):
    expected = open("/proc/sys/net/ipv4/ip_forward").read().strip()

    def no_command(*_args, **_kw):
        raise AssertionError("a process was started to read a sysctl")

    monkeypatch.setattr(subprocess, "run", no_command)
    sysctls = Sysctls()
    assert sysctls.get(KEY) == expected
    assert sysctls.get("net.netfilter.no_such_key_here") is None


def test_another_namespace_reads_with_cat_through_the_plain_runner(monkeypatch):
    seen = []

    def plain(cmd, stdin=None):
        seen.append(tuple(cmd))
        return subprocess.CompletedProcess(cmd, 0, "1\n", "")

    monkeypatch.setattr(apply, "run_command", plain)  # the plain runner, recording
    prefix = ("nsenter", "--net=/run/netns/x")
    assert Sysctls(prefix=prefix).get(KEY) == "1"
    assert seen == [(*prefix, "cat", "/proc/sys/net/ipv4/ip_forward")]
    Sysctls().get(KEY)  # no prefix: read in place, as above
    assert len(seen) == 1


def test_an_injected_runner_reads_with_cat():
    seen = []

    def runner(cmd, stdin=None):
        seen.append(tuple(cmd))
        return subprocess.CompletedProcess(cmd, 1, "", "No such file")

    assert Sysctls(runner=runner).get(KEY) is None
    assert seen == [("cat", "/proc/sys/net/ipv4/ip_forward")]


def test_a_write_goes_through_sh_and_a_failed_one_names_its_command():
    seen = []

    def runner(cmd, stdin=None):
        seen.append(tuple(cmd))
        return subprocess.CompletedProcess(cmd, 0 if len(seen) == 1 else 1, "", "Read-only file system")

    prefix = ("nsenter", "--net=/run/netns/x")
    sysctls = Sysctls(prefix=prefix, runner=runner)
    sysctls.set("net.ipv4.conf.all.route_localnet", "1")
    assert seen == [(*prefix, "sh", "-c", 'printf %s "$1" > "$2"', "sysctl-set", "1",
                     "/proc/sys/net/ipv4/conf/all/route_localnet")]
    with pytest.raises(IptablesError, match=r"/proc/sys/net/ipv4/conf/all/route_localnet exited 1: Read-only"):
        sysctls.set("net.ipv4.conf.all.route_localnet", "1")
    with pytest.raises(ValueError, match="not a sysctl key: '../etc/passwd'"):
        sysctls.get("../etc/passwd")


# ---- run_command: memory files, not pipes ----------------------------------------------------


def test_run_command_passes_input_and_returns_output_and_errors_whole():
    big = "".join(f"-A KUBE-SEP-{i:012d} -j KUBE-MARK-MASQ\n" for i in range(200_000))  # ~9 MB, as a save at 10,000
    result = apply.run_command(["sh", "-c", 'cat; echo "bad line" >&2; exit 3'], big)
    assert result.returncode == 3 and result.stdout == big and result.stderr == "bad line\n"


def test_run_command_gives_no_input_when_asked_for_none():
    # /dev/null, not the agent's own stdin: `cat` ends at once instead of waiting on a terminal
    assert apply.run_command(["cat"]).stdout == ""


def test_run_command_names_a_command_that_does_not_exist():
    try:
        apply.run_command(["/nonexistent/iptables-save"])
    except OSError as exc:
        assert "/nonexistent/iptables-save" in str(exc)
    else:
        raise AssertionError("no OSError")


def test_sysctls_are_read_while_the_backend_detection_still_runs():
    """A restart's first full sync reads its sysctls and renders before the detection's saves end
    (IptablesDatapath._sysctls): only the restore and the jumps need the chosen backend."""
    import threading

    from ebpf_proxy.datapath.iptables import IptablesDatapath
    from ebpf_proxy.model import NodeConfig

    release = threading.Event()

    def runner(cmd, stdin=None):
        if cmd[0].endswith("-save"):
            release.wait(30)  # the detection's saves hang until released
            return subprocess.CompletedProcess(cmd, 0, "", "")
        return subprocess.CompletedProcess(cmd, 0, "0\n", "")

    dp = IptablesDatapath(NodeConfig("n", node_ips=("192.0.2.1",)), backend="auto", runner=runner)
    prepared = threading.Thread(target=dp._prepare_node, daemon=True)
    prepared.start()
    prepared.join(5)
    try:
        assert not prepared.is_alive(), "the sysctls waited for the backend detection"
    finally:
        release.set()
    dp._save_ahead.take(60)
