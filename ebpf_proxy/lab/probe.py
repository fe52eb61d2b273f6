"""The probe: open fresh connections to a target from inside a netns and record who answered.

Every end-to-end test and every iptables-vs-eBPF comparison stands on this, so each attempt is
reduced to one of exactly three outcomes, the ones a service proxy can produce for a packet:

  ok       something answered. With our echo server behind the target, `pod`, `backend` (the
           address the pod received the connection on, i.e. after DNAT) and `source` (the
           client address the pod saw, i.e. after any SNAT) are filled in from its JSON reply.
           If whatever answered is not our echo server (no JSON line; an accepted TCP connection
           closed without one), the outcome is still "ok" -- the packet was delivered and
           answered -- but pod, backend and source are null. Tests assert on `pod` to tell them
           apart.
  refused  actively rejected: a TCP RST, or *any* ICMP error (port/host/net unreachable,
           administratively prohibited: ECONNREFUSED, EHOSTUNREACH, ENETUNREACH, EHOSTDOWN,
           EACCES), on TCP or UDP; also a connection reset before the reply line, and the local
           equivalents (no route; a `prohibit` route). Note an ARP/ND failure also surfaces as
           EHOSTUNREACH, after ~3 s, so with a timeout over 3 s a neighbour that never answers
           counts as refused; with the default 1 s it is a timeout.
  timeout  no answer within `timeout`: dropped. Also a TCP connection that is established but
           sends no complete line in time, and the local forms of a silent drop that the kernel
           reports at once: a `blackhole` route (EINVAL), a connect() denied by a local hook
           (EPERM). A UDP send refused by a local firewall (EPERM) is ambiguous -- DROP and REJECT
           both cause it -- so the probe still waits for the ICMP error a REJECT sends: refused
           if it comes, timeout if not, exactly as a remote client would see it.
           Beware the kernel's ICMP rate limit (a burst of ~6-8 errors per destination, then ~1/s):
           a burst of UDP probes to a port that REJECTs turns into timeouts after the first few.

SCTP (`IP:PORT/sctp`) is probed as TCP is, over a one-to-one socket: an ABORT is refused
(ECONNREFUSED), no INIT ACK in time is a timeout. On a kernel without SCTP sockets the probe
cannot be made and raises ProbeError naming the cause (lab/sctp.py).

Anything else (the source IP is not configured, file descriptors exhausted...) is a mistake in
the set-up, not an outcome: it raises ProbeError.

The namespace switch happens once per probe() call, in a throwaway thread (see _setns), and the
attempts run sequentially from there; a few hundred probes inside a node take well under a second.
When a cgroup is given (probing "from a node" whose agent attaches cgroup BPF hooks), the attempts
run instead in a `python -m ebpf_proxy.lab.probe` child that joins it, at ~50 ms per call.
"""

from __future__ import annotations

import argparse
import errno
import ipaddress
import json
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Callable

from ebpf_proxy.lab._setns import run_in_netns
from ebpf_proxy.lab.echo import PROTOS, format_addr, parse_reply
from ebpf_proxy.lab.sctp import sctp_available

DEFAULT_PAYLOAD = b"probe"
MAX_LINE = 4096  # our echo server's line is ~120 bytes; a longer "line" is not ours

# Not exported by Python's socket module: let connect() pick the source port, so binding a source
# address does not reserve a port for every (address, port 0) bind.
IP_BIND_ADDRESS_NO_PORT = getattr(socket, "IP_BIND_ADDRESS_NO_PORT", 24)

_REFUSED_ERRNOS = frozenset(
    {errno.ECONNREFUSED, errno.EHOSTUNREACH, errno.ENETUNREACH, errno.EHOSTDOWN, errno.EACCES, errno.ECONNRESET}
)
_DROPPED_ERRNOS = frozenset({errno.EINVAL, errno.EPERM})


class Outcome(StrEnum):
    OK = "ok"
    REFUSED = "refused"
    TIMEOUT = "timeout"


class TargetError(ValueError):
    """A target string that is not IP:PORT[/tcp|udp|sctp]."""


class ProbeError(RuntimeError):
    """The probe itself could not run (bad source IP, no such netns, out of sockets...)."""


# --- target ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Target:
    ip: str
    port: int
    proto: str = "tcp"

    @property
    def family(self) -> socket.AddressFamily:
        return socket.AF_INET6 if ":" in self.ip else socket.AF_INET

    @property
    def addr(self) -> str:
        return format_addr(self.ip, self.port)

    def __str__(self) -> str:
        return f"{self.addr}/{self.proto}"


def parse_target(text: str, proto: str | None = None) -> Target:
    """Parse 'IP:PORT[/tcp|udp|sctp]' ('[IPv6]:PORT[/...]' for IPv6); `proto` fills in (or must agree with) the suffix."""
    if not isinstance(text, str):
        raise TargetError(f"target must be a string IP:PORT[/tcp|udp|sctp], not {type(text).__name__}")
    raw = text.strip()
    if not raw:
        raise TargetError("empty target: expected IP:PORT[/tcp|udp|sctp], e.g. 10.96.0.10:80/tcp")
    addr_part, slash, suffix = raw.partition("/")
    suffix = suffix.lower()
    if slash and suffix not in PROTOS:
        raise TargetError(f"target {text!r}: protocol after '/' must be tcp, udp or sctp, not {suffix!r}")
    if proto is not None:
        proto = proto.lower()
        if proto not in PROTOS:
            raise TargetError(f"protocol must be tcp, udp or sctp, not {proto!r}")
        if slash and suffix != proto:
            raise TargetError(f"target {text!r} says /{suffix} but proto={proto!r} was asked for")
    final_proto = suffix or proto or "tcp"

    if addr_part.startswith("["):
        host, bracket, port_s = addr_part[1:].partition("]")
        if not bracket or not port_s.startswith(":"):
            raise TargetError(f"target {text!r}: expected [IPv6]:PORT")
        port_s = port_s[1:]
    else:
        host, colon, port_s = addr_part.rpartition(":")
        if not colon:
            raise TargetError(f"target {text!r}: missing ':PORT' (expected IP:PORT[/tcp|udp|sctp])")
        if ":" in host:
            raise TargetError(f"target {text!r}: write IPv6 addresses as [IPv6]:PORT")
    if not host:
        raise TargetError(f"target {text!r}: missing IP before ':PORT'")
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        raise TargetError(f"target {text!r}: {host!r} is not an IP address (names are not resolved)") from None
    if not port_s.isdigit() or not 1 <= int(port_s) <= 65535:
        raise TargetError(f"target {text!r}: port must be a number from 1 to 65535, not {port_s!r}")
    return Target(str(ip), int(port_s), final_proto)


# --- results -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class ProbeResult:
    outcome: Outcome
    pod: str | None = None
    backend: str | None = None  # "IP:PORT" the pod received the connection on
    source: str | None = None  # "IP:PORT" the pod saw as the client

    def to_dict(self) -> dict[str, Any]:
        return {"outcome": str(self.outcome), "pod": self.pod, "backend": self.backend, "source": self.source}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ProbeResult:
        return cls(Outcome(d["outcome"]), d.get("pod"), d.get("backend"), d.get("source"))


@dataclass
class ProbeReport:
    """The results of one probe() call; to_json() is the stable shape scripts rely on."""

    label: str  # where the probe ran from (node, pod or client name): the JSON's "from"
    target: Target
    results: list[ProbeResult] = field(default_factory=list)

    @property
    def by_pod(self) -> dict[str, int]:
        """Answers per echo-server pod (ok results naming a pod), sorted by pod name."""
        counts: dict[str, int] = {}
        for r in self.results:
            if r.outcome is Outcome.OK and r.pod is not None:
                counts[r.pod] = counts.get(r.pod, 0) + 1
        return dict(sorted(counts.items()))

    @property
    def summary(self) -> dict[str, Any]:
        counts = {str(o): 0 for o in Outcome}
        for r in self.results:
            counts[str(r.outcome)] += 1
        return {**counts, "by_pod": self.by_pod}

    @property
    def pods(self) -> set[str]:
        return {r.pod for r in self.results if r.pod is not None}

    @property
    def sources(self) -> set[str]:
        return {r.source for r in self.results if r.source is not None}

    @property
    def source_ips(self) -> set[str]:
        """The client IPs the pods saw, ports dropped: what SNAT assertions usually want."""
        return {s.rsplit(":", 1)[0].strip("[]") for s in self.sources}

    @property
    def backends(self) -> set[str]:
        return {r.backend for r in self.results if r.backend is not None}

    @property
    def outcomes(self) -> set[Outcome]:
        return {r.outcome for r in self.results}

    @property
    def all_ok(self) -> bool:
        return bool(self.results) and self.outcomes == {Outcome.OK}

    def to_json(self) -> dict[str, Any]:
        """The stable JSON object scripts rely on (json.dumps-ready); see dumps() for text."""
        return {
            "from": self.label,
            "to": str(self.target),
            "results": [r.to_dict() for r in self.results],
            "summary": self.summary,
        }

    def dumps(self, indent: int | None = None) -> str:
        return json.dumps(self.to_json(), indent=indent)

    @classmethod
    def from_json(cls, data: dict[str, Any] | str) -> ProbeReport:
        """Inverse of to_json() (or of dumps(), given the text)."""
        d = json.loads(data) if isinstance(data, str) else data
        return cls(d["from"], parse_target(d["to"]), [ProbeResult.from_dict(r) for r in d["results"]])


# --- one attempt (runs inside the target netns) ------------------------------------------------


def _classify(exc: OSError) -> Outcome:
    if isinstance(exc, TimeoutError):  # socket.timeout, and kernel ETIMEDOUT
        return Outcome.TIMEOUT
    if exc.errno in _REFUSED_ERRNOS:
        return Outcome.REFUSED
    if exc.errno in _DROPPED_ERRNOS:
        return Outcome.TIMEOUT
    raise ProbeError(f"probe failed unexpectedly: {exc}") from exc


def _answered(data: bytes) -> ProbeResult:
    reply = parse_reply(data)
    if reply is None:
        return ProbeResult(Outcome.OK)
    return ProbeResult(Outcome.OK, reply["pod"], reply["local"], reply["peer"])


def _new_socket(target: Target, kind: int, source_ip: str | None, proto: int = 0) -> socket.socket:
    sock = socket.socket(target.family, kind, proto)
    if source_ip is not None:
        if kind == socket.SOCK_STREAM:
            try:
                sock.setsockopt(socket.IPPROTO_IP, IP_BIND_ADDRESS_NO_PORT, 1)
            except OSError:
                pass  # only an optimisation
        try:
            sock.bind((source_ip, 0))
        except OSError as exc:
            sock.close()
            raise ProbeError(f"cannot use source IP {source_ip}: {exc}") from exc
    return sock


def _stream_once(target: Target, source_ip: str | None, timeout: float, proto: int = 0) -> ProbeResult:
    """One TCP connection, or (proto IPPROTO_SCTP) one SCTP association on a one-to-one socket:
    connect, then read the echo server's line."""
    deadline = time.monotonic() + timeout
    sock = _new_socket(target, socket.SOCK_STREAM, source_ip, proto)
    try:
        sock.settimeout(timeout)
        try:
            sock.connect((target.ip, target.port))
        except OSError as exc:
            return ProbeResult(_classify(exc))
        buf = bytearray()
        while b"\n" not in buf and len(buf) < MAX_LINE:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return ProbeResult(Outcome.TIMEOUT)
            sock.settimeout(remaining)
            try:
                chunk = sock.recv(MAX_LINE)
            except OSError as exc:
                return ProbeResult(_classify(exc))
            if not chunk:
                break  # closed without (a complete) line: answered, but not by our echo server
            buf += chunk
        return _answered(bytes(buf))
    finally:
        sock.close()


def _udp_once(target: Target, source_ip: str | None, timeout: float, payload: bytes) -> ProbeResult:
    sock = _new_socket(target, socket.SOCK_DGRAM, source_ip)
    try:
        sock.settimeout(timeout)
        try:
            sock.connect((target.ip, target.port))  # route lookup only; also filters replies by peer
        except OSError as exc:
            return ProbeResult(_classify(exc))
        try:
            sock.send(payload)
        except OSError as exc:
            # EPERM: a local netfilter DROP *or* REJECT; only an ICMP error on recv() tells them apart.
            if exc.errno != errno.EPERM:
                return ProbeResult(_classify(exc))
        try:
            data = sock.recv(65535)
        except OSError as exc:
            return ProbeResult(_classify(exc))
        return _answered(data)
    finally:
        sock.close()


def _run(target: Target, count: int, source_ip: str | None, timeout: float, payload: bytes) -> list[ProbeResult]:
    if target.proto == "tcp":
        return [_stream_once(target, source_ip, timeout) for _ in range(count)]
    if target.proto == "sctp":
        return [_stream_once(target, source_ip, timeout, socket.IPPROTO_SCTP) for _ in range(count)]
    return [_udp_once(target, source_ip, timeout, payload) for _ in range(count)]


# --- running somewhere else --------------------------------------------------------------------


def join_cgroup(cgroup: str) -> None:
    """Move this whole process into cgroup v2 directory `cgroup` (sockets made afterwards belong to it)."""
    procs = os.path.join(cgroup, "cgroup.procs")
    try:
        with open(procs, "w") as f:
            f.write(str(os.getpid()))
    except OSError as exc:
        raise ProbeError(f"cannot join cgroup {cgroup}: {exc}") from exc


def _run_in_subprocess(
    netns: str | None, cgroup: str, target: Target, count: int, source_ip: str | None, timeout: float, payload: bytes
) -> list[ProbeResult]:
    """Run the attempts in a fresh `python -m ebpf_proxy.lab.probe` that first joins `cgroup`.

    A cgroup is a property of the whole process (a thread cannot join one alone), and cgroup BPF
    hooks pick a socket's cgroup when it is created, so probing "from a node" as its agent's
    socket-level load balancing sees it needs a process inside the node's cgroup. A new process
    is the safe way to get one from a possibly multithreaded caller (~50 ms per probe() call).
    """
    argv = [sys.executable, "-m", "ebpf_proxy.lab.probe", str(target), "--count", str(count),
            "--timeout", repr(timeout), "--cgroup", cgroup, "--payload-hex", payload.hex()]
    if netns is not None:
        argv += ["--netns", netns]
    if source_ip is not None:
        argv += ["--source-ip", source_ip]
    limit = count * (timeout + 1) + 30
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=limit, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired as exc:
        raise ProbeError(f"probe subprocess did not finish in {limit:.0f}s") from exc
    if done.returncode not in (0, 1):
        raise ProbeError(done.stderr.strip().removeprefix("probe: ") or f"probe subprocess exited {done.returncode}")
    return ProbeReport.from_json(done.stdout).results


# --- public entry points -----------------------------------------------------------------------


def probe(
    netns: str | None,
    target: str | Target,
    count: int = 1,
    source_ip: str | None = None,
    timeout: float = 1.0,
    proto: str | None = None,
    *,
    label: str | None = None,
    cgroup: str | None = None,
    payload: bytes = DEFAULT_PAYLOAD,
) -> ProbeReport:
    """Make `count` fresh TCP connections, UDP exchanges or SCTP associations to `target`, one after another, from netns `netns`.

    `netns` None probes from the caller's own namespace. `source_ip` is bound before connecting
    (it must be configured in that netns). `timeout` bounds each attempt as a whole. `label` is
    the report's "from" (default: the netns name, or "local"). `cgroup` (a cgroup v2 directory)
    runs the attempts in a process inside it, so cgroup BPF hooks apply as they would to a
    program running there; without it they run in a thread of this process.
    """
    tgt = target if isinstance(target, Target) else parse_target(target, proto)
    if proto is not None and proto.lower() != tgt.proto:
        raise TargetError(f"target {tgt} is {tgt.proto}, but proto={proto!r} was asked for")
    if count < 1:
        raise ValueError(f"count must be at least 1, not {count}")
    if timeout <= 0:
        raise ValueError(f"timeout must be positive, not {timeout}")
    if source_ip is not None:
        try:
            src = ipaddress.ip_address(source_ip)
        except ValueError:
            raise ProbeError(f"source IP {source_ip!r} is not an IP address") from None
        if (src.version == 6) != (tgt.family == socket.AF_INET6):
            raise ProbeError(f"source IP {source_ip} and target {tgt} are not the same IP version")
        source_ip = str(src)
    if tgt.proto == "sctp" and (why := sctp_available()) is not None:
        raise ProbeError(f"cannot probe {tgt}: {why}")
    if cgroup is not None:
        results = _run_in_subprocess(netns, cgroup, tgt, count, source_ip, timeout, payload)
    else:
        try:
            results = run_in_netns(netns, _run, tgt, count, source_ip, timeout, payload)
        except FileNotFoundError as exc:
            raise ProbeError(str(exc)) from exc
    return ProbeReport(label or netns or "local", tgt, results)


class ProbeWaitTimeout(TimeoutError):
    """wait_until_ok gave up; `.last` holds the last report."""

    def __init__(self, message: str, last: ProbeReport) -> None:
        super().__init__(message)
        self.last = last


def wait_until_ok(
    netns: str | None,
    target: str | Target,
    timeout: float = 10.0,
    *,
    count: int = 1,
    until: Callable[[ProbeReport], bool] | None = None,
    interval: float = 0.05,
    probe_timeout: float = 0.5,
    source_ip: str | None = None,
    proto: str | None = None,
    label: str | None = None,
    cgroup: str | None = None,
) -> ProbeReport:
    """Probe every `interval` s until a report satisfies `until` (default: all `count` attempts ok).

    For tests that wait for a datapath to converge. Returns the satisfying report; raises
    ProbeWaitTimeout (carrying the last report) once `timeout` seconds have passed.
    """
    check = until or (lambda report: report.all_ok)
    end = time.monotonic() + timeout
    while True:
        last = probe(netns, target, count, source_ip, probe_timeout, proto, label=label, cgroup=cgroup)
        if check(last):
            return last
        if time.monotonic() + interval >= end:
            raise ProbeWaitTimeout(f"{last.target} from {last.label} not ok after {timeout}s: {last.summary}", last)
        time.sleep(interval)


def main(argv: list[str] | None = None) -> int:
    """`python -m ebpf_proxy.lab.probe TARGET ...`: print the report; exit 0 if all ok, 1 if not, 2 on errors."""
    parser = argparse.ArgumentParser(prog="python -m ebpf_proxy.lab.probe", description=probe.__doc__.split("\n")[0])
    parser.add_argument("target", help="IP:PORT[/tcp|udp|sctp]")
    parser.add_argument("--netns", help="probe from this named netns (default: where we run)")
    parser.add_argument("--cgroup", help="join this cgroup v2 directory first (cgroup BPF hooks then apply)")
    parser.add_argument("--from", dest="label", help='the report\'s "from" label')
    parser.add_argument("-c", "--count", type=int, default=1)
    parser.add_argument("--source-ip")
    parser.add_argument("--timeout", type=float, default=1.0)
    parser.add_argument("--payload-hex", default=DEFAULT_PAYLOAD.hex(), help="UDP request payload, hex-encoded")
    args = parser.parse_args(argv)
    try:
        if args.cgroup:
            join_cgroup(args.cgroup)  # before any socket exists; this process has a single thread
        report = probe(args.netns, args.target, args.count, args.source_ip, args.timeout,
                       label=args.label, payload=bytes.fromhex(args.payload_hex))
    except (ProbeError, ValueError) as exc:  # TargetError is a ValueError
        print(f"probe: {exc}", file=sys.stderr)
        return 2
    print(report.dumps())
    return 0 if report.all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
