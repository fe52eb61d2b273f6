"""datapath/ebpf/readback.py's helper protocol, with stand-in helpers (no BPF): what the agent
makes of a helper that talks, fails or hangs. The real helper over real pins is tested in
tests/bpf/test_services.py and tests/bpf/test_datapath.py."""

from __future__ import annotations

import sys

from ebpf_proxy.datapath.ebpf import readback


def _helper(tmp_path, monkeypatch, body: str) -> None:
    """Make ReadAhead.start run `body` (a shell script) instead of the Python helper."""
    script = tmp_path / "helper"
    script.write_text("#!/bin/sh\n" + body)
    script.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(script))


def test_a_helper_that_fails_after_much_talk_is_refused_with_its_last_words(tmp_path, monkeypatch, caplog):
    """200 KB of messages (more than a pipe holds) and then why it failed: read as they come, so the
    helper never blocks on a full pipe, and its last line is the reason logged."""
    _helper(tmp_path, monkeypatch, "head -c 200000 /dev/zero | tr '\\0' 'x' >&2; echo >&2; echo 'no maps here' >&2; exit 3\n")
    caplog.set_level("WARNING", logger=readback.__name__)
    assert readback.ReadAhead.start(tmp_path, 4).take(maps=None, wait=30) is None  # type: ignore[arg-type]
    assert "the helper exited with status 3: no maps here; the first sync reads them itself" in caplog.text


def test_a_helper_still_reading_at_the_deadline_is_stopped_and_refused(tmp_path, monkeypatch, caplog):
    _helper(tmp_path, monkeypatch, "exec sleep 60\n")
    caplog.set_level("WARNING", logger=readback.__name__)
    ahead = readback.ReadAhead.start(tmp_path, 6)
    assert ahead.take(maps=None, wait=0.2) is None  # type: ignore[arg-type]
    assert "IPv6 maps not used: the helper still reading after 0.2 s: stopped" in caplog.text
    assert ahead._proc.returncode is not None, "killed and reaped"


def test_a_helper_that_sends_garbage_is_refused(tmp_path, monkeypatch, caplog):
    _helper(tmp_path, monkeypatch, "echo ready; read line; echo 'not a pickle'\n")
    caplog.set_level("WARNING", logger=readback.__name__)
    assert readback.ReadAhead.start(tmp_path, 4).take(maps=None, wait=30) is None  # type: ignore[arg-type]
    assert "the helper sent what is not a read-back" in caplog.text
