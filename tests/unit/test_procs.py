"""procs.alive, state and parent: the one pid check of the lab and the kubeconfig child's directory sweep."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from ebpf_proxy import procs


def test_this_process_is_alive_and_no_pid_is_not():
    assert procs.alive(os.getpid())
    assert not procs.alive(None) and not procs.alive(0)
    assert procs.state(None) is None and procs.parent(None) is None


def test_a_childs_parent_is_this_process():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert procs.parent(child.pid) == os.getpid()
        assert procs.parent(os.getpid()) == os.getppid()
    finally:
        child.kill()
        child.wait()
    assert procs.parent(child.pid) is None


def test_a_zombie_and_a_reaped_child_are_gone():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 10
    while procs.alive(child.pid):  # it exits, unreaped: a zombie
        assert time.monotonic() < deadline, "the child neither exited nor counted as gone"
        time.sleep(0.01)
    assert procs.state(child.pid) == "Z", "the test meant a zombie"
    child.wait()
    assert not procs.alive(child.pid)


def test_a_running_child_is_alive_and_a_stopped_one_says_so():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert procs.alive(child.pid) and not procs.stopped(child.pid)
        os.kill(child.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 10
        while not procs.stopped(child.pid):
            assert time.monotonic() < deadline, f"state {procs.state(child.pid)!r} after SIGSTOP"
            time.sleep(0.01)
        assert procs.alive(child.pid), "a stopped process is still alive (lab apiserver freeze)"
    finally:
        child.kill()
        child.wait()
    assert not procs.alive(child.pid)
