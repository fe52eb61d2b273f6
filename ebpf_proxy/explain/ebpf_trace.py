"""Explain one packet with the eBPF datapath's own loaded programs (the eBPF half of `trace`).

Nothing here re-implements a decision. The programs pinned under <bpffs>/ebpf-proxy/progs/ are
opened by pin path (no compile) and run in trace mode (bpf/lib/common.h), a dry run that writes
no connection, affinity entry, masquerade port or counter and records what it decided in the
per-CPU map epx_trace; this module reads that record back and puts it into the one answer shape
(result.Trace). The hooks run in the kernel's order for the packet's origin:

  external  xdp_lb, then tc_ingress, on the device the packet arrives through (the route back to
            its source, or `flow.in_iface`); xdp_lb only where that device carries it (the
            agent's --bpf-xdp-mode generic or native; with off, the default, tc_ingress alone
            decides, and makes the same drops)
  pod       tc_ingress on the pod's device (its routed veth, or its port of the pod bridge)
  host      the cgroup connect4/connect6 (TCP) or sendmsg4/sendmsg6 (UDP) program. BPF_PROG_TEST_RUN
            cannot run CGROUP_SOCK_ADDR programs, so a short-lived child process joins the node's
            cgroup (the one the pinned socket-LB link is attached to) and calls connect()/sendto()
            on a socket (AF_INET, or AF_INET6 for an IPv6 flow) marked EPX_TRACE_MARK: the real
            program decides, records, and fails the call (EPERM), so nothing is sent.
and, after a DNAT, tc_egress on the device toward the backend, which shows the masquerade of an
established connection; a new connection has no entry in a dry run, so its source after
masquerade is the recorded decision applied to epx_config's masquerade address.

IPv6 flows take the same programs and hooks (their IPv6 path, bpf/lib/tc6.h and sock_lb.c's
sock6 side) with IPv6 frames, and read the IPv6 maps (Maps6) and epx_config6's masquerade address,
while the node's IPv6 Services are the eBPF datapath's (CFG6_F_ON in epx_config6: ipv6_served).
Otherwise ip6tables serves them, and `trace` walks its rules instead (cli/trace.py).

Must run inside the node's network namespace (BPF_PROG_TEST_RUN takes the ingress device by
ifindex, which names a device of the caller's netns; the lab's `run_in_netns` does it).
"""

from __future__ import annotations

import errno
import json
import os
import secrets
import socket
import struct
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from ebpf_proxy.datapath.ebpf import inspect, libbpf, pins, testrun
from ebpf_proxy.datapath.ebpf.loader import PROGS_SUBDIR, xdp_program_is_ours
from ebpf_proxy.datapath.ebpf import structs as s
from ebpf_proxy.datapath.ebpf.maps import Maps, Maps6, ip6_str, ip_str, port_int, slot_bank
from ebpf_proxy.explain.packet import FlowSpec, host_port, is_loopback, split_host_port
from ebpf_proxy.explain.result import Step, Trace
from ebpf_proxy.model import Protocol

TC_ACT_OK, TC_ACT_SHOT, TC_ACT_REDIRECT = 0, 2, 7
XDP_DROP, XDP_PASS = 1, 2

HOOK_NAMES = {
    s.HOOK_XDP: "xdp",
    s.HOOK_TC_INGRESS: "tc-ingress",
    s.HOOK_TC_EGRESS: "tc-egress",
    s.HOOK_SOCK_CONNECT4: "cgroup/connect4",
    s.HOOK_SOCK_SENDMSG4: "cgroup/sendmsg4",
    s.HOOK_SOCK_CONNECT6: "cgroup/connect6",
    s.HOOK_SOCK_SENDMSG6: "cgroup/sendmsg6",
}
# the socket-LB program behind each socket hook (pins.CGROUP_PROGRAMS names its cgroup hook)
SOCK_PROGRAMS = {
    s.HOOK_SOCK_CONNECT4: "sock_connect4",
    s.HOOK_SOCK_SENDMSG4: "sock_sendmsg4",
    s.HOOK_SOCK_CONNECT6: "sock_connect6",
    s.HOOK_SOCK_SENDMSG6: "sock_sendmsg6",
}
ORIGIN_NAMES = {s.ORIGIN_POD: "pod", s.ORIGIN_NODE: "node", s.ORIGIN_EXTERNAL: "external",
                s.ORIGIN_LOCALHOST: "localhost"}

_DNAT = {s.Reason.FWD_NEW, s.Reason.FWD_ESTABLISHED, s.Reason.SOCK_FWD}
_REJECT = {s.Reason.REJECT, s.Reason.SOCK_REJECT}
# lb4_policy verdicts that can come before it chose an endpoint set and a masquerade
_BEFORE_SCOPE = _REJECT | {s.Reason.DROP_SOURCE_RANGE}

Names = Mapping[tuple[str, int, str], str]


class TraceError(RuntimeError):
    """The trace could not be run; the message says what is missing and where."""


# ---- the packet ----


def _csum(data: bytes) -> int:
    if len(data) % 2:
        data += b"\0"
    total = sum(struct.unpack(f"!{len(data) // 2}H", data))
    while total >> 16:
        total = (total & 0xFFFF) + (total >> 16)
    return ~total & 0xFFFF


def _crc32c(data: bytes) -> int:
    """CRC32c (Castagnoli, RFC 3309; SCTP's checksum, RFC 4960 appendix B), bit by bit: traces
    build one short packet."""
    crc = 0xFFFFFFFF
    for byte in data:
        crc ^= byte
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)
    return crc ^ 0xFFFFFFFF


def build_frame(flow: FlowSpec, dst_mac: bytes = b"\x02\0\0\0\0\x0b", src_mac: bytes = b"\x02\0\0\0\0\x0a") -> bytes:
    """Ethernet + IPv4 or IPv6 (the flow's family) + a TCP SYN (or a UDP datagram with 4 bytes of
    payload, or an SCTP INIT), checksums valid. A plain builder rather than scapy: the
    agent image, where `trace` runs, has no scapy."""
    v6 = flow.family == 6
    family = socket.AF_INET6 if v6 else socket.AF_INET
    src, dst = socket.inet_pton(family, flow.src), socket.inet_pton(family, flow.dst)
    if flow.protocol == Protocol.UDP:
        proto, payload = socket.IPPROTO_UDP, b"ping"
        l4, check_at = struct.pack("!HHHH", flow.sport, flow.dport, 8 + len(payload), 0) + payload, 6
    elif flow.protocol == Protocol.TCP:
        proto = socket.IPPROTO_TCP
        l4, check_at = struct.pack("!HHIIBBHHH", flow.sport, flow.dport, 1, 0, 5 << 4, 0x02, 64240, 0, 0), 16
    elif flow.protocol == Protocol.SCTP:
        proto = socket.IPPROTO_SCTP
        # INIT (type 1, 20 bytes): initiate tag, a_rwnd, outbound and inbound streams, initial TSN
        init = struct.pack("!BBHIIHHI", 1, 0, 20, 0x65707874, 65535, 1, 1, 1)
        l4 = struct.pack("!HHII", flow.sport, flow.dport, 0, 0) + init  # verification tag 0: an INIT's
        l4 = l4[:8] + struct.pack("<I", _crc32c(l4)) + l4[12:]  # stored little-endian, as the kernel does
        check_at = None  # the CRC32c covers the SCTP packet alone: no pseudo-header
    else:
        raise TraceError(f"{flow.protocol.value} over IPv{flow.family}: the eBPF datapath serves TCP, UDP and SCTP")
    if check_at is not None:
        # the pseudo-header: RFC 8200 8.1 (32-bit length, next header last) or RFC 793's
        pseudo = src + dst + (struct.pack("!I3xB", len(l4), proto) if v6 else struct.pack("!BBH", 0, proto, len(l4)))
        check = _csum(pseudo + l4)
        if proto == socket.IPPROTO_UDP:
            check = check or 0xFFFF  # 0 means "no checksum" (and is not allowed at all over IPv6)
        l4 = l4[:check_at] + struct.pack("!H", check) + l4[check_at + 2:]
    if v6:
        ip = struct.pack("!IHBB16s16s", 6 << 28, len(l4), proto, 64, src, dst)
        return dst_mac + src_mac + b"\x86\xdd" + ip + l4
    ip = struct.pack("!BBHHHBBH4s4s", 0x45, 0, 20 + len(l4), 1, 0x4000, 64, proto, 0, src, dst)
    ip = ip[:10] + struct.pack("!H", _csum(ip)) + ip[12:]
    return dst_mac + src_mac + b"\x08\x00" + ip + l4


def _frame_dst(frame: bytes) -> tuple[str, int] | None:
    """(daddr, dport) of an IPv4 or IPv6 TCP/UDP/SCTP frame (build_frame's: no IPv6 extension
    headers)."""
    if frame[12:14] == b"\x86\xdd":
        if len(frame) < 14 + 40 + 4 or frame[20] not in (socket.IPPROTO_TCP, socket.IPPROTO_UDP, socket.IPPROTO_SCTP):
            return None
        return socket.inet_ntop(socket.AF_INET6, frame[38:54]), struct.unpack("!H", frame[56:58])[0]
    if len(frame) < 34 or frame[12:14] != b"\x08\x00":
        return None
    ihl = (frame[14] & 0x0F) * 4
    if frame[23] not in (socket.IPPROTO_TCP, socket.IPPROTO_UDP, socket.IPPROTO_SCTP) or len(frame) < 14 + ihl + 4:
        return None
    return socket.inet_ntoa(frame[30:34]), struct.unpack("!H", frame[14 + ihl + 2: 14 + ihl + 4])[0]


def _rec_addr(rec: s.EpxTraceRec, which: str) -> str:
    """A record's backend or snat address, in the family it was decided in (TRACE_F_IPV6: the
    16-byte backend_addr6 / snat_addr6)."""
    if rec.flags & s.TRACE_F_IPV6:
        return ip6_str(s.In6.from_buffer_copy(bytes(getattr(rec, f"{which}_addr6"))))
    return ip_str(getattr(rec, f"{which}_addr"))


def _rec_backend(rec: s.EpxTraceRec) -> str:
    """The record's backend as IP:PORT ([IPv6]:PORT)."""
    return host_port(_rec_addr(rec, "backend"), port_int(rec.backend_port))


# ---- where the programs and maps are ----


@dataclass
class _Datapath:
    pin_dir: Path
    maps: Maps
    progs: dict[str, int]

    def family_maps(self, v6: bool) -> Maps:
        """The maps a decision of that family reads: epx_* or the epx_*6 view over the same fds."""
        return Maps6(self.maps) if v6 else self.maps

    def ipv6_on(self) -> bool:
        """CFG6_F_ON: the programs serve this node's IPv6 Services (else ip6tables does)."""
        return bool(Maps6(self.maps).config().flags & s.CFG6_F_ON)

    def masquerade_address(self, v6: bool) -> str | None:
        """epx_config's (IPv4) or epx_config6's (IPv6) masquerade address, None when unset."""
        if v6:
            addr = Maps6(self.maps).config().snat_addr
            return ip6_str(addr) if any(bytes(addr)) else None
        cfg = self.maps.config()
        return ip_str(cfg.snat_addr) if cfg.snat_addr else None

    def close(self) -> None:
        self.maps.close()
        for fd in self.progs.values():
            os.close(fd)


def _open(bpffs: str | Path) -> _Datapath:
    pin_dir = pins.pin_dir(bpffs)
    if not (pin_dir / "epx_stats").exists() and (Path(bpffs) / "epx_stats").exists():
        pin_dir = Path(bpffs)  # the pin directory itself was given (as maps.py accepts it too)
    try:
        maps = inspect.open_maps_readonly(pin_dir)
    except inspect.InspectError as exc:
        raise TraceError(str(exc)) from exc
    builds = sorted((pin_dir / PROGS_SUBDIR).glob("*"), key=lambda p: p.stat().st_mtime)
    if not builds:
        maps.close()
        raise TraceError(f"no programs pinned under {pin_dir / PROGS_SUBDIR}: is the agent running in ebpf mode?")
    progs: dict[str, int] = {}
    try:
        for name in ("xdp_lb", "tc_ingress", "tc_egress"):
            progs[name] = libbpf.obj_get(str(builds[-1] / name))
            _check_traceable(maps, progs[name], f"{builds[-1] / name}")
    except (OSError, TraceError) as exc:
        maps.close()
        for fd in progs.values():
            os.close(fd)
        if isinstance(exc, TraceError):
            raise
        raise TraceError(f"{builds[-1]}: cannot open the pinned programs: {exc}") from exc
    return _Datapath(pin_dir, maps, progs)


def _check_traceable(maps: Maps, prog_fd: int, what: str) -> None:
    """Refuse a program without trace mode: it would take the trace packet (or socket) for a live
    one and write connections and counters (or really connect). Such a program does not use
    this datapath's epx_trace map."""
    trace_map = maps.map_id("epx_trace")
    _, map_ids = libbpf.prog_info(prog_fd)
    if trace_map not in map_ids:
        raise TraceError(f"{what} has no trace mode (it does not use this datapath's epx_trace): it was built by "
                         "another version of ebpf-proxy; restart the agent with this version to trace")


def _check_netns(cfg: s.LB4Config) -> None:
    """BPF_PROG_TEST_RUN takes devices of the caller's netns, and the socket LB acts only in the
    node's: a trace must run in the network namespace the datapath serves."""
    here = pins.netns_cookie()
    if cfg.host_netns_cookie and here and here != cfg.host_netns_cookie:
        raise TraceError("this is not the network namespace the datapath serves: run the trace inside the node's "
                         "netns (in the lab: lab exec NODE, or ebpf_proxy.lab._setns.run_in_netns)")


# ---- devices (of the calling thread's netns) ----


def _ipr():
    from pyroute2 import IPRoute  # noqa: PLC0415

    return IPRoute()


def _route(ipr, dst: str) -> tuple[int | None, str | None]:
    """(output ifindex, preferred source) of the route to `dst`."""
    try:
        msg = ipr.route("get", dst=dst)[0]
    except Exception:  # noqa: BLE001 - no route: the caller says so
        return None, None
    return msg.get_attr("RTA_OIF"), msg.get_attr("RTA_PREFSRC")


def _link(ipr, index: int):
    links = ipr.get_links(index)
    return links[0] if links else None


def _link_name(ipr, index: int | None) -> str:
    if not index:
        return "?"
    link = _link(ipr, index)
    return link.get_attr("IFLA_IFNAME") if link is not None else str(index)


NETNS_DIR = "/run/netns"


def _bridge_port(ipr, bridge: int, addr: str) -> int | None:
    """The port of `bridge` behind which `addr` lives: its neighbour entry's MAC in the bridge's
    forwarding database, else (the node has not talked to it yet) the veth whose other end holds
    `addr` in one of the named network namespaces (where CNIs and the lab keep pods')."""
    ports = {link["index"] for link in ipr.get_links() if link.get_attr("IFLA_MASTER") == bridge}
    mac = None
    for neigh in ipr.get_neighbours(ifindex=bridge, dst=addr):
        mac = neigh.get_attr("NDA_LLADDR")
    if mac:
        for entry in ipr.fdb("dump"):
            if entry.get_attr("NDA_LLADDR") == mac and entry.get("ifindex") in ports:
                return entry.get("ifindex")
    try:
        names = sorted(os.listdir(NETNS_DIR))
    except OSError:
        return None
    from pyroute2 import IPRoute  # noqa: PLC0415

    for name in names:
        try:
            with IPRoute(netns=name) as other:
                for found in other.get_addr(address=addr):
                    links = other.get_links(found["index"])
                    peer = links[0].get_attr("IFLA_LINK") if links else None
                    if peer in ports:
                        return peer
        except Exception:  # noqa: BLE001,S112 - a namespace gone meanwhile, or not ours to read
            continue
    return None


def _ingress_device(ipr, flow: FlowSpec) -> int:
    """Where the packet meets the node: `in_iface`, else the device of the route back to its source
    (for a pod on a bridge, its port of the bridge, where tc_ingress runs)."""
    if flow.in_iface:
        try:
            return socket.if_nametoindex(flow.in_iface)
        except OSError:
            raise TraceError(f"--in-iface: no device {flow.in_iface!r} in this network namespace") from None
    oif, _ = _route(ipr, flow.src)
    if not oif:
        raise TraceError(f"no route to {flow.src} in this network namespace: give the ingress device (in_iface)")
    link = _link(ipr, oif)
    info = link.get_attr("IFLA_LINKINFO") if link is not None else None
    if info is not None and info.get_attr("IFLA_INFO_KIND") == "bridge":
        return _bridge_port(ipr, oif, flow.src) or oif
    return oif


def _mac(ipr, index: int) -> bytes:
    link = _link(ipr, index)
    addr = link.get_attr("IFLA_ADDRESS") if link is not None else None
    return bytes.fromhex(addr.replace(":", "")) if addr and len(addr) == 17 else b"\x02\0\0\0\0\x0b"


# ---- running a program in trace mode ----


def _nonce() -> int:
    return secrets.randbelow((1 << 31) - 2) + 1  # fits SO_PRIORITY (an int)


def _record(dp: _Datapath, nonce: int, hook: int) -> s.EpxTraceRec:
    rec = dp.maps.trace_record(nonce)
    if rec is None or rec.hook != hook:
        raise TraceError(f"{HOOK_NAMES[hook]}: the program left no trace record: the pinned programs predate "
                         "trace mode (restart the agent with this version)")
    return rec


def _run_tc(dp: _Datapath, prog: str, frame: bytes, ifindex: int, hook: int) -> tuple[int, bytes, s.EpxTraceRec]:
    nonce = _nonce()
    ctx = testrun.SkBuffCtx(mark=s.TRACE_MARK, ifindex=ifindex)
    ctx.cb[0], ctx.cb[1] = s.TRACE_MAGIC, nonce
    result = testrun.run(dp.progs[prog], frame, ctx=ctx)
    return result.retval, result.packet, _record(dp, nonce, hook)


def _run_xdp(dp: _Datapath, frame: bytes, ifindex: int) -> tuple[int, s.EpxTraceRec]:
    nonce = _nonce()
    meta = bytes(s.EpxTraceMeta(magic=s.TRACE_MAGIC, nonce=nonce))
    ctx = testrun.XdpMd(data=len(meta), data_end=len(meta) + len(frame), ingress_ifindex=ifindex)
    result = testrun.run(dp.progs["xdp_lb"], meta + frame, ctx=ctx)
    return result.retval, _record(dp, nonce, s.HOOK_XDP)


# ---- the socket path (host origin) ----

_SOCK_CHILD = r"""
import json, os, socket, sys
cgroup, dst, port, udp, mark, prio = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4] == "1", int(sys.argv[5]), int(sys.argv[6])
family = socket.AF_INET6 if ":" in dst else socket.AF_INET
with open(os.path.join(cgroup, "cgroup.procs"), "w") as f:
    f.write(str(os.getpid()))
sock = socket.socket(family, socket.SOCK_DGRAM if udp else socket.SOCK_STREAM)
sock.setsockopt(socket.SOL_SOCKET, socket.SO_MARK, mark)
sock.setsockopt(socket.SOL_SOCKET, socket.SO_PRIORITY, prio)
sock.setblocking(False)
try:
    if udp:
        sock.sendto(b"", (dst, port))
    else:
        sock.connect((dst, port))
    err = 0
except OSError as exc:
    err = exc.errno
print(json.dumps({"errno": err}))
"""


def _cgroup_mounts() -> list[Path]:
    with open("/proc/self/mounts") as mounts:
        return [Path(f[1]) for f in (line.split() for line in mounts) if len(f) > 2 and f[2] == "cgroup2"]


def socket_lb_cgroup(pin_dir: Path) -> Path:
    """The cgroup the pinned socket-LB link is attached to (found by its cgroup id, an inode)."""
    pin = pin_dir / pins.LINKS_SUBDIR / "sock_connect4"
    try:
        fd = libbpf.obj_get(str(pin))
    except OSError as exc:
        raise TraceError(f"{pin}: no socket-LB link pinned ({exc.strerror}): the node's socket LB is not attached") from exc
    try:
        cgroup_id = libbpf.link_info(fd).cgroup_id
    finally:
        os.close(fd)
    for root in _cgroup_mounts():
        for dirpath, _dirs, _files in os.walk(root):
            if os.stat(dirpath).st_ino == cgroup_id:
                return Path(dirpath)
    raise TraceError(f"the socket LB is attached to cgroup id {cgroup_id}, which no cgroup2 mount shows")


def _check_socket_lb(dp: _Datapath, cgroup: Path, program: str) -> None:
    """The socket LB's `program` runs for processes of `cgroup`, in a build with trace mode: else a
    marked socket would not be stopped, and would really connect or send."""
    attach = pins.CGROUP_PROGRAMS[program]
    try:
        target = os.open(cgroup, os.O_RDONLY | os.O_DIRECTORY)
    except OSError as exc:
        raise TraceError(f"cgroup {cgroup}: {exc.strerror}") from exc
    try:
        ids = libbpf.prog_query(target, attach, libbpf.BPF_F_QUERY_EFFECTIVE)
    except OSError as exc:
        raise TraceError(f"cgroup {cgroup}: cannot list its {program} programs: {exc}") from exc
    finally:
        os.close(target)
    ours = 0
    for prog_id in ids:
        try:
            fd = libbpf.prog_fd_by_id(prog_id)
        except OSError:
            continue
        try:
            if libbpf.prog_info(fd)[0].name.decode() == program:
                _check_traceable(dp.maps, fd, f"{program} (program id {prog_id}) on {cgroup}")
                ours += 1
        finally:
            os.close(fd)
    if not ours:
        raise TraceError(f"no {program} program runs for cgroup {cgroup}: the socket LB is not attached there, so "
                         "a node process's connection would not be decided by it (give the node's cgroup)")


def _sock_hook(flow: FlowSpec) -> int:
    """The socket hook a node process's call of this flow runs: connect (TCP) or sendmsg (UDP) of
    its socket's family (an IPv6 destination: an AF_INET6 socket)."""
    udp = flow.protocol == Protocol.UDP
    if flow.family == 6:
        return s.HOOK_SOCK_SENDMSG6 if udp else s.HOOK_SOCK_CONNECT6
    return s.HOOK_SOCK_SENDMSG4 if udp else s.HOOK_SOCK_CONNECT4


def _run_sock(dp: _Datapath, flow: FlowSpec, cgroup: Path) -> s.EpxTraceRec:
    udp = flow.protocol == Protocol.UDP
    hook = _sock_hook(flow)
    _check_socket_lb(dp, cgroup, SOCK_PROGRAMS[hook])
    nonce = _nonce()
    argv = [sys.executable, "-I", "-S", "-c", _SOCK_CHILD, str(cgroup), flow.dst, str(flow.dport),
            "1" if udp else "0", str(s.TRACE_MARK), str(nonce)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=10, stdin=subprocess.DEVNULL)
    if done.returncode != 0:
        raise TraceError(f"the trace socket in cgroup {cgroup} failed: {done.stderr.strip().splitlines()[-1:]}")
    err = json.loads(done.stdout.strip().splitlines()[-1])["errno"]
    rec = dp.maps.trace_record(nonce)
    if rec is None or rec.hook != hook:
        what = "succeeded" if not err else os.strerror(err)
        raise TraceError(f"{HOOK_NAMES[hook]}: the socket program left no record (the call {what}): is {cgroup} "
                         "the node's cgroup, and are the programs of this version?")
    if err != errno.EPERM:
        raise TraceError(f"{HOOK_NAMES[hook]}: the trace call ended with {os.strerror(err) if err else 'success'}, "
                         "not EPERM")
    return rec


# ---- reading the decision ----


def _backends(dp: _Datapath, rec: s.EpxTraceRec, v6: bool) -> list[str]:
    """Every backend of the scope the decision chose among (or the connection's own), read from
    the maps of the decision's family."""
    if rec.flags & s.TRACE_F_ESTABLISHED:
        return [_rec_backend(rec)]
    if not rec.flags & s.TRACE_F_POLICY:
        return []
    maps = dp.family_maps(v6)
    count = rec.svc_local_count if rec.scope == s.LB4_SCOPE_LOCAL else rec.svc_count
    out = []
    for slot in range(count):
        backend_id = maps.slot(rec.svc_id, rec.scope, slot, bank=slot_bank(rec.svc_flags))
        backend = maps.backend(backend_id) if backend_id is not None else None
        if backend is not None:
            out.append(host_port(backend.addr, backend.port))
    return out


def reason_text(reason: s.Reason) -> str:
    """The reason as the JSON says it: the structs.Reason name and what it means."""
    return f"{reason.name}: {reason.description}"


def _verdict(reason: s.Reason) -> str:
    if reason in _DNAT:
        return "dnat"
    if reason in _REJECT:
        return "reject"
    if reason.is_drop:
        return "drop"
    return "pass"


def _service_name(names: Names | None, flow: FlowSpec) -> str | None:
    if not names:
        return None
    for proto in (flow.protocol, flow.protocol.value, flow.protocol.lower):
        name = names.get((flow.dst, flow.dport, proto))
        if name:
            return name
    return None


def _scope_words(rec: s.EpxTraceRec) -> str:
    if rec.scope == s.LB4_SCOPE_LOCAL:
        why = "internalTrafficPolicy=Local" if not rec.svc_flags & s.LB4_F_EXTERNAL else "externalTrafficPolicy=Local"
        return f"this node's endpoints only: {why}"
    return "every endpoint"


def _masq_words(rec: s.EpxTraceRec) -> str:
    if rec.masq & s.TRACE_MASQ_HAIRPIN and not rec.masq & s.TRACE_MASQ_POLICY:
        return "masquerade (hairpin: the pod reaches itself)"
    return "masquerade" if rec.masq else "no masquerade"


def _decision_words(rec: s.EpxTraceRec, reason: s.Reason) -> str:
    parts = [reason_text(reason)]
    if rec.flags & s.TRACE_F_ESTABLISHED:
        parts.append(f"connection table: established, backend {_rec_backend(rec)}")
    elif rec.flags & s.TRACE_F_POLICY and reason in _BEFORE_SCOPE:
        parts.append(f"origin {ORIGIN_NAMES.get(rec.origin, rec.origin)}")  # decided before an endpoint set
    elif rec.flags & s.TRACE_F_POLICY:
        parts.append(f"origin {ORIGIN_NAMES.get(rec.origin, rec.origin)}, {_scope_words(rec)}, {_masq_words(rec)}")
        if rec.flags & s.TRACE_F_BACKEND:
            how = "session affinity" if rec.flags & s.TRACE_F_AFFINITY else "random slot"
            parts.append(f"this run picked {_rec_backend(rec)} ({how})")
    return "; ".join(parts)


def _story(verdict: str, reason: s.Reason, rec: s.EpxTraceRec, service: str | None, flow: FlowSpec,
           backends: list[str], source_after: str | None, where: str, masquerade: bool = False) -> str:
    svc = f" {service}" if service else f" {host_port(flow.dst, flow.dport)}/{flow.protocol.lower}"
    if reason == s.Reason.DROP_NO_LOCAL_EXTERNAL:
        return (f"drop{svc}: externalTrafficPolicy=Local and this node has no local endpoint; traffic from "
                f"outside the node ({flow.src}, origin {ORIGIN_NAMES.get(rec.origin, '?')}) may use local "
                f"endpoints only, so {where} drops it")
    if reason == s.Reason.DROP_NO_LOCAL_INTERNAL:
        return f"drop{svc}: internalTrafficPolicy=Local and this node has no local endpoint; {where} drops it"
    if reason == s.Reason.DROP_SOURCE_RANGE:
        return f"drop{svc}: loadBalancerSourceRanges do not admit {flow.src}; {where} drops it"
    if verdict == "reject":
        how = "connect() fails with ECONNREFUSED" if reason == s.Reason.SOCK_REJECT else \
            "an ICMP port unreachable goes back to the client"
        return f"reject{svc}: no usable endpoint; {how}"
    if verdict == "dnat":
        seen = f"the node's address ({source_after})" if masquerade else f"the client's address ({source_after})"
        return f"dnat{svc}: to one of {', '.join(backends)} ({_scope_words(rec)}); the backend sees {seen}"
    return f"{verdict}{svc}: {reason_text(reason)}"


def trace_ebpf(flow: FlowSpec, bpffs: str | Path, names: Names | None = None, cgroup: str | Path | None = None) -> Trace:
    """Explain `flow` with the programs and maps pinned under `bpffs` (the agent's --bpffs), from
    inside the node's network namespace. `names` maps a frontend (ip, port, protocol) to the
    service's "ns/name:port" (the CLI fills it from the API or the iptables comments; the maps hold
    no names); without it `service` is null. `cgroup`: the node's cgroup for host-originated
    flows (default: the one the pinned socket-LB link is attached to). An IPv6 flow needs the
    node's IPv6 path on (ipv6_served): else ip6tables serves it, and this raises TraceError."""
    dp = _open(bpffs)
    try:
        with _ipr() as ipr:
            return _trace(dp, ipr, flow, names, cgroup)
    finally:
        dp.close()


def ipv6_served(bpffs: str | Path) -> bool:
    """Whether the eBPF datapath pinned under `bpffs` serves this node's IPv6 Services (CFG6_F_ON
    in epx_config6): then an IPv6 flow is traced through the programs, else through ip6tables."""
    dp = _open(bpffs)
    try:
        return dp.ipv6_on()
    finally:
        dp.close()


def _trace(dp: _Datapath, ipr, flow: FlowSpec, names: Names | None, cgroup: str | Path | None) -> Trace:
    service = _service_name(names, flow)
    cfg = dp.maps.config()
    _check_netns(cfg)
    v6 = flow.family == 6
    if v6 and not dp.ipv6_on():
        raise TraceError(f"{flow.dst}: this node's eBPF datapath does not serve IPv6 (CFG6_F_ON unset in "
                         f"{dp.pin_dir / 'epx_config6'}): ip6tables does, trace its rules instead")
    snat = dp.masquerade_address(v6)
    steps: list[Step] = []
    details: dict = {"dryRun": True}

    if flow.origin == "host":
        if flow.protocol == Protocol.SCTP:
            raise TraceError("sctp from the node itself: the socket LB serves TCP and UDP sockets only, and the TC "
                             "programs do not translate the node's own packets (bpf/sock_lb.c): the eBPF datapath "
                             "does not balance node-originated SCTP")
        cg = Path(cgroup) if cgroup else socket_lb_cgroup(dp.pin_dir)
        rec = _run_sock(dp, flow, cg)
        reason = s.Reason(rec.reason)
        program = SOCK_PROGRAMS[rec.hook]
        if rec.flags & s.TRACE_F_NETNS:
            action = "not the node's network namespace: the socket LB does nothing here (pods take the TC path)"
        elif not rec.flags & s.TRACE_F_SERVICE:
            action = f"{reason_text(s.Reason.PASS_NO_SERVICE)}: the call goes to {host_port(flow.dst, flow.dport)} unchanged"
            reason = s.Reason.PASS_NO_SERVICE
        else:
            action = _decision_words(rec, reason) + " (decided at the socket: no packet carries the frontend)"
        steps.append(Step(HOOK_NAMES[rec.hook], program, action))
        details.update(_rec_details(rec, cgroup=str(cg)))
        verdict = _verdict(reason) if rec.flags & s.TRACE_F_SERVICE else "pass"
        backends = _backends(dp, rec, v6) if verdict == "dnat" else []
        source_after = None
        if verdict == "dnat":
            if is_loopback(flow.dst):  # a 127.0.0.1 socket: tc_egress masquerades it (no ::1 NodePorts)
                source_after = snat
            else:  # the kernel picks the source of the route to the backend
                source_after = _route(ipr, _rec_addr(rec, "backend"))[1] or snat
        return Trace("ebpf", verdict, reason_text(reason), service, tuple(backends), bool(rec.masq) and verdict == "dnat",
                     source_after, tuple(steps),
                     story=_story(verdict, reason, rec, service, flow, backends, source_after, program,
                                  masquerade=bool(rec.masq) and verdict == "dnat"),
                     details=details)

    ifindex = _ingress_device(ipr, flow)
    ifname = _link_name(ipr, ifindex)
    frame = build_frame(flow, dst_mac=_mac(ipr, ifindex))
    details["ingress"] = ifname

    if flow.origin == "external" and xdp_program_is_ours(ipr, ifindex):  # a packet meets XDP only where it is attached
        retval, rec = _run_xdp(dp, frame, ifindex)
        reason = s.Reason(rec.reason)
        if retval == XDP_DROP:
            steps.append(Step("xdp", f"xdp_lb@{ifname}", f"XDP_DROP before an skb exists: {_decision_words(rec, reason)}"))
            details.update(_rec_details(rec))
            return Trace("ebpf", "drop", reason_text(reason), service, (), False, None, tuple(steps),
                         story=_story("drop", reason, rec, service, flow, [], None, "xdp_lb"), details=details)
        what = "established connection" if rec.flags & s.TRACE_F_ESTABLISHED else \
            "no early drop" if rec.flags & s.TRACE_F_SERVICE else "not a service frontend"
        steps.append(Step("xdp", f"xdp_lb@{ifname}", f"XDP_PASS ({what}): tc_ingress decides"))

    retval, out, rec = _run_tc(dp, "tc_ingress", frame, ifindex, s.HOOK_TC_INGRESS)
    reason = s.Reason(rec.reason)
    verdict = _verdict(reason)
    action = _decision_words(rec, reason)
    if verdict == "dnat":
        dst = _frame_dst(out)
        action += f"; DNAT to {dst[0]}:{dst[1]}" if dst else ""
    steps.append(Step("tc-ingress", f"tc_ingress@{ifname}", action + " (dry run: nothing written)"))
    details.update(_rec_details(rec))

    backends = _backends(dp, rec, v6) if verdict == "dnat" else []
    masquerade = verdict == "dnat" and _masquerades(rec, backends, flow)
    hairpin = [b for b in backends if split_host_port(b)[0] == flow.src]
    if hairpin and not masquerade:
        details["hairpinBackends"] = hairpin  # only a pick of these is masqueraded (rule 3)
    source_after = None
    if verdict == "dnat":
        source_after = snat if masquerade else flow.src
        oif, _ = _route(ipr, _rec_addr(rec, "backend"))
        if oif:  # the packet this run DNATed, on its way out toward the backend it picked
            _, _, erec = _run_tc(dp, "tc_egress", out, oif, s.HOOK_TC_EGRESS)
            ereason = s.Reason(erec.reason)
            if erec.flags & s.TRACE_F_SNAT:
                source_after = _rec_addr(erec, "snat")
                eaction = f"{reason_text(ereason)}: source {host_port(source_after, port_int(erec.snat_port))}"
            elif rec.masq:
                eaction = (f"{reason_text(ereason)}; a dry run made no connection entry, so the masquerade decided "
                           f"at ingress is applied here: source {snat} "
                           f"({'epx_config6' if v6 else 'epx_config'} snat_addr)")
                if rec.masq == s.TRACE_MASQ_HAIRPIN:
                    eaction += " (hairpin: this run picked the client itself)"
            else:
                eaction = f"{reason_text(ereason)}: source kept ({flow.src})"
            steps.append(Step("tc-egress", f"tc_egress@{_link_name(ipr, oif)}", eaction))
    where = f"tc_ingress@{ifname}"
    return Trace("ebpf", verdict, reason_text(reason), service, tuple(backends), masquerade, source_after,
                 tuple(steps), story=_story(verdict, reason, rec, service, flow, backends, source_after, where,
                                            masquerade=masquerade),
                 details=details)


def _masquerades(rec: s.EpxTraceRec, backends: list[str], flow: FlowSpec) -> bool:
    """Whether the backend sees the node's address, whichever backend of the set it is: the policy
    (or an established connection's entry) says so, or every backend is the client itself
    (hairpin). A set where only some are the client depends on the draw: not masqueraded."""
    if rec.flags & s.TRACE_F_ESTABLISHED or rec.masq & s.TRACE_MASQ_POLICY:
        return bool(rec.masq)
    return bool(backends) and all(split_host_port(b)[0] == flow.src for b in backends)


def _rec_details(rec: s.EpxTraceRec, **extra) -> dict:
    out = {
        "hook": HOOK_NAMES.get(rec.hook, str(rec.hook)),
        "reason": s.Reason(rec.reason).name,
        "established": bool(rec.flags & s.TRACE_F_ESTABLISHED),
    }
    if rec.flags & s.TRACE_F_SERVICE:
        out.update(svcId=rec.svc_id, svcFlags=rec.svc_flags, clusterSlots=rec.svc_count, localSlots=rec.svc_local_count)
    if rec.flags & s.TRACE_F_POLICY and s.Reason(rec.reason) in _BEFORE_SCOPE:
        out.update(origin=ORIGIN_NAMES.get(rec.origin, str(rec.origin)))
    elif rec.flags & s.TRACE_F_POLICY:
        out.update(origin=ORIGIN_NAMES.get(rec.origin, str(rec.origin)),
                   scope="local" if rec.scope == s.LB4_SCOPE_LOCAL else "cluster",
                   masqueradePolicy=bool(rec.masq & s.TRACE_MASQ_POLICY),
                   hairpin=bool(rec.masq & s.TRACE_MASQ_HAIRPIN))
    if rec.flags & s.TRACE_F_BACKEND:
        out.update(picked=_rec_backend(rec), backendId=rec.backend_id,
                   affinity=bool(rec.flags & s.TRACE_F_AFFINITY))
    out.update(extra)
    return out


__all__ = ["TraceError", "build_frame", "ipv6_served", "reason_text", "socket_lb_cgroup", "trace_ebpf"]
