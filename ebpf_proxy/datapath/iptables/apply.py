"""Running iptables, iptables-save, iptables-restore and sysctl, optionally inside another netns.

The agent runs inside its node's network namespace, so normally the commands run as they are.
Tests (and the lab) point a datapath at a namespace of their own with a command prefix such as
`nsenter --net=/run/netns/NS`, so that nothing ever touches the namespace the tests run in.
The runner is injectable so the sync logic can be unit-tested without root.
"""

from __future__ import annotations

import os
import re
import subprocess
from collections.abc import Callable, Sequence
from typing import BinaryIO

Runner = Callable[[Sequence[str], "str | None"], subprocess.CompletedProcess]

# A full restore of 10,000 services (~80,000 rules) takes 20-30 s with the nft backend on 2 cores;
# the limit only catches a hung command, it must not cut a big restore short.
COMMAND_TIMEOUT_SECONDS = 300
_LINE_RE = re.compile(r"line:? (\d+)")
_QUOTED_RE = re.compile(r"[`'\"]([^`'\"\s]+)'")


def run_command(cmd: Sequence[str], stdin: str | None = None) -> subprocess.CompletedProcess:
    """Run `cmd` with `stdin` as its input (else /dev/null), its output and errors as text.

    The streams are memory files (memfd), not pipes. Through a pipe, Python reads an
    iptables-save of 10,000 Services (~9 MB) in ~300 reads of 32 KiB, each taking the interpreter
    lock back; when another thread is busy (a restart's render while the backend detection reads
    its saves in a thread) each of those waits up to the switch interval, and one save took
    ~1.4 s instead of ~0.15 s. Here the only wait is for the process to end, with the lock
    released, and the output is read in one call. A memfd needs no writable filesystem."""
    with _memory_file("stdin") as given, _memory_file("stdout") as out, _memory_file("stderr") as err:
        if stdin is not None:
            given.write(stdin.encode())
            given.seek(0)
        result = subprocess.run(list(cmd), stdin=given if stdin is not None else subprocess.DEVNULL,
                                stdout=out, stderr=err, timeout=COMMAND_TIMEOUT_SECONDS, check=False)
        out.seek(0)
        err.seek(0)
        return subprocess.CompletedProcess(result.args, result.returncode, out.read().decode(), err.read().decode())


def _memory_file(name: str) -> BinaryIO:
    """An anonymous file in memory, read/write, closed (and freed) with the returned object."""
    return open(os.memfd_create(f"epx-{name}", os.MFD_CLOEXEC), "w+b")


class IptablesError(RuntimeError):
    """An iptables command failed; the message names the command and carries its stderr."""

    def __init__(self, cmd: Sequence[str], result: subprocess.CompletedProcess) -> None:
        self.cmd = tuple(cmd)
        self.returncode = result.returncode
        self.stderr = (result.stderr or "").strip()
        super().__init__(f"{' '.join(self.cmd)} exited {self.returncode}: {self.stderr}")


class RestoreError(IptablesError):
    """iptables-restore rejected its input. Carries stderr and the offending input line, so the
    log says what was wrong; the caller retries with a full sync."""

    def __init__(self, cmd: Sequence[str], result: subprocess.CompletedProcess, text: str) -> None:
        super().__init__(cmd, result)
        self.input = text
        self.line_no: int | None = None
        self.line: str | None = None
        match = _LINE_RE.search(self.stderr)
        lines = text.splitlines()
        if match and 0 < int(match.group(1)) <= len(lines):
            self.line_no = int(match.group(1))
            self.line = lines[self.line_no - 1]
        if self.line is None or self.line == "COMMIT":
            # The nft backend checks jump targets only at COMMIT and reports that line; the
            # message names the culprit, so point at the first rule that mentions it instead.
            for name in _QUOTED_RE.findall(self.stderr):
                hit = next((i for i, line in enumerate(lines) if line.startswith("-A ") and name in line.split()), None)
                if hit is not None:
                    self.line_no, self.line = hit + 1, lines[hit]
                    break
        where = f"; input line {self.line_no}: {self.line}" if self.line is not None else ""
        self.args = (f"{' '.join(self.cmd)} exited {self.returncode}: {self.stderr}{where}",)


class IptablesCommands:
    """The few iptables operations the datapath needs, each one command line."""

    def __init__(
        self,
        *,
        iptables: Sequence[str] = ("iptables",),
        iptables_save: Sequence[str] = ("iptables-save",),
        iptables_restore: Sequence[str] = ("iptables-restore",),
        prefix: Sequence[str] = (),
        runner: Runner | None = None,
    ) -> None:
        self._iptables = (*prefix, *iptables)
        self._save = (*prefix, *iptables_save)
        self._restore = (*prefix, *iptables_restore)
        self._run = runner or run_command

    def _checked(self, cmd: Sequence[str], stdin: str | None = None) -> str:
        return _checked(self._run, cmd, stdin)

    def save(self, table: str) -> str:
        return self._checked((*self._save, "-t", table))

    def restore(self, text: str) -> None:
        """Apply `text` atomically; --noflush keeps every chain the input does not declare."""
        cmd = (*self._restore, "-w", "--noflush")
        result = self._run(cmd, text)
        if result.returncode != 0:
            raise RestoreError(cmd, result, text)

    def rule_exists(self, table: str, chain: str, args: Sequence[str]) -> bool:
        result = self._run((*self._iptables, "-w", "-t", table, "-C", chain, *args), None)
        return result.returncode == 0

    def insert_rule(self, table: str, chain: str, args: Sequence[str]) -> None:
        self._checked((*self._iptables, "-w", "-t", table, "-I", chain, *args))

    def delete_rule(self, table: str, chain: str, args: Sequence[str]) -> None:
        self._checked((*self._iptables, "-w", "-t", table, "-D", chain, *args))

    def new_chain(self, table: str, chain: str) -> None:
        self._checked((*self._iptables, "-w", "-t", table, "-N", chain))


class Sysctls:
    """The kernel settings the iptables datapath reads and makes (route_localnet,
    nf_conntrack_tcp_be_liberal), in the network namespace its commands run in: its own, or
    another one through `prefix`. Apart from IptablesCommands because they need no iptables
    backend: a restart reads them while the backend's detection still runs.

    Through /proc/sys with cat and sh rather than procps' sysctl, which slim images lack;
    /proc/sys/net shows the network namespace of the process reading it."""

    def __init__(self, *, prefix: Sequence[str] = (), runner: Runner | None = None) -> None:
        self._prefix = tuple(prefix)
        self._run = runner or run_command

    def get(self, key: str) -> str | None:
        """The value, or None when the key does not exist (e.g. conntrack module not loaded).
        Read by this process where the commands run in its own namespace with the plain runner
        (the agent): a `cat` each was a process start on a restart's full sync, three of them."""
        path = _sysctl_path(key)
        if not self._prefix and self._run is run_command:
            try:
                with open(path) as f:
                    return f.read().strip()
            except OSError:
                return None
        result = self._run((*self._prefix, "cat", path), None)
        return (result.stdout or "").strip() if result.returncode == 0 else None

    def set(self, key: str, value: str) -> None:
        """Write `value`; IptablesError (naming the command) when the write fails."""
        path = _sysctl_path(key)
        _checked(self._run, (*self._prefix, "sh", "-c", 'printf %s "$1" > "$2"', "sysctl-set", value, path))


def _checked(run: Runner, cmd: Sequence[str], stdin: str | None = None) -> str:
    """`cmd`'s output; IptablesError, naming the command and its stderr, when it fails."""
    result = run(cmd, stdin)
    if result.returncode != 0:
        raise IptablesError(cmd, result)
    return result.stdout or ""


_SYSCTL_KEY_RE = re.compile(r"[a-z0-9_]+(\.[a-z0-9_]+)+")


def _sysctl_path(key: str) -> str:
    if not _SYSCTL_KEY_RE.fullmatch(key):
        raise ValueError(f"not a sysctl key: {key!r}")
    return "/proc/sys/" + key.replace(".", "/")
