#!/usr/bin/env python3
"""What tc_ingress costs per packet, for two builds of bpf/ side by side (BPF_PROG_TEST_RUN).

    sudo .venv/bin/python scripts/bpf-cost.py [--base REV] [--rounds 5] [--repeat 200000]

Compiles bpf/ as it is in git revision REV (default b4175ce, the last commit before trace mode)
and as it is in the work tree, each into a bpffs of its own under /run/ebpf-proxy-test/, installs
one ClusterIP service with three endpoints, and measures, alternating the builds each round:
  syn          a new connection from a pod: policy, backend choice, connection entries, DNAT
  established  an ACK of each of those connections: connection-table hit, DNAT
               (both one run per packet, as the kernel times it: with `repeat` the program runs
               again on the packet it already rewrote, which is no longer addressed to the service)
  est-repeat   the established path at the kernel's own average (repeat=N): a connection entry whose
               backend is the frontend itself, so the DNAT rewrites nothing and every run hits it
               (lookup, state and deadline update; no checksum helpers)
  pass         a packet to no service (untouched, so repeat=N is the kernel's own average)
  xdp          xdp_lb on a new connection to the service (passed on to TC; repeat=N)
and prints ns/run per round, the medians, and each program's size (translated instructions).
Attaches nothing anywhere; unmounts and removes what it made.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from scapy.layers.inet import IP, TCP  # noqa: E402
from scapy.layers.l2 import Ether  # noqa: E402

from ebpf_proxy.datapath.ebpf import libbpf, loader, testrun, toolchain  # noqa: E402
from ebpf_proxy.datapath.ebpf import structs as s  # noqa: E402
from ebpf_proxy.datapath.ebpf.maps import Maps, be16, be32  # noqa: E402
from tests.bpf import world as w  # noqa: E402

TEST_ROOT = Path("/run/ebpf-proxy-test")
SIZES = {name: min(n, 65536) for name, n in loader.MAX_ENTRIES.items()}


def build(src: Path, pin: Path):
    from bcc import BPF  # noqa: PLC0415

    cflags = [f'-DEPX_PIN_DIR="{pin}"', f"-I{src}"] + [f"-D{loader.map_macro(n)}={v}" for n, v in SIZES.items()]
    maps_mod = BPF(src_file=str(src / "maps.c").encode(), cflags=cflags)
    names = re.findall(r"BPF_TABLE_PINNED\(\"\w+\",[^,]+,[^,]+,\s*(\w+),", (src / "maps.c").read_text())
    fds = {n: maps_mod[n.encode()].get_fd() for n in names}
    fd_flags = [f"-DEPX_FD_{n}={fd}" for n, fd in fds.items()]
    tc = BPF(src_file=str(src / "tc_lb.c").encode(), cflags=cflags + fd_flags)
    prog = tc.load_func(b"tc_ingress", BPF.SCHED_CLS)
    xdp = BPF(src_file=str(src / "xdp_lb.c").encode(), cflags=cflags + fd_flags)
    xdp_prog = xdp.load_func(b"xdp_lb", BPF.XDP)
    fds.setdefault("epx_trace", fds["epx_stats"])  # a build without trace mode: never read here
    return (maps_mod, tc, xdp), Maps(fds), (prog.fd, xdp_prog.fd)


def syn(sport: int) -> bytes:
    return bytes(Ether() / IP(src=w.POD_CLIENT, dst=w.VIP) / TCP(sport=sport, dport=80, flags="S"))


def measure(maps: Maps, prog_fds: tuple[int, int], n_syn: int, repeat: int, sport0: int) -> tuple[float, ...]:
    prog_fd, xdp_fd = prog_fds
    maps.clear("epx_ct4")
    new = sum(testrun.run(prog_fd, syn(sport0 + i)).duration_ns for i in range(n_syn)) / n_syn
    acks = [bytes(Ether() / IP(src=w.POD_CLIENT, dst=w.VIP) / TCP(sport=sport0 + i, dport=80, flags="A"))
            for i in range(n_syn)]
    established = sum(testrun.run(prog_fd, ack).duration_ns for ack in acks) / n_syn
    key = s.CT4Key(saddr=be32(w.POD_CLIENT), daddr=be32(w.VIP), sport=be16(7), dport=be16(80), proto=6, kind=s.CT4_SVC)
    maps._put("epx_ct4", key, s.CT4Entry(expires=1 << 62, nat_addr=be32(w.VIP), nat_port=be16(80),
                                          svc_addr=be32(w.VIP), svc_port=be16(80), flags=s.CT4_F_SEEN_REPLY))
    same = bytes(Ether() / IP(src=w.POD_CLIENT, dst=w.VIP) / TCP(sport=7, dport=80, flags="A"))
    est_repeat = testrun.run(prog_fd, same, repeat=repeat).duration_ns
    other = bytes(Ether() / IP(src=w.POD_CLIENT, dst="10.96.0.99") / TCP(sport=sport0, dport=80, flags="A"))
    passed = testrun.run(prog_fd, other, repeat=repeat).duration_ns
    xdp = testrun.run(xdp_fd, syn(sport0 + n_syn), repeat=repeat).duration_ns
    return new, established, est_repeat, passed, xdp


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", default="b4175ce", help="git revision of the 'before' bpf/")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--syn", type=int, default=5000, help="new connections per round")
    ap.add_argument("--repeat", type=int, default=200000, help="established runs per round")
    args = ap.parse_args()
    toolchain.ensure_kernel_headers()
    TEST_ROOT.mkdir(parents=True, exist_ok=True)
    made: list[Path] = []
    with contextlib.ExitStack() as stack:
        base_src = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bpf-base-")))
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", args.base, "bpf"], check=True, capture_output=True)
        subprocess.run(["tar", "-x", "-C", str(base_src)], input=archive.stdout, check=True)
        builds = {}
        try:
            for label, src in ((f"before ({args.base})", base_src / "bpf"), ("after (work tree)", ROOT / "bpf")):
                pin = Path(tempfile.mkdtemp(prefix=f"cost-{os.getpid()}-", dir=TEST_ROOT))
                made.append(pin)
                loader.mount_bpffs(pin)
                modules, maps, fd = build(src, pin)
                maps.reset()
                w.install_node(maps)
                w.install(maps, w.web())
                info, _ = libbpf.prog_info(fd[0])
                builds[label] = (modules, maps, fd, info.xlated_prog_len // 8, info.jited_prog_len)
            results: dict[str, list[tuple[float, ...]]] = {label: [] for label in builds}
            for r in range(args.rounds):
                for label, (_, maps, fd, *_sizes) in builds.items():
                    results[label].append(measure(maps, fd, args.syn, args.repeat, 1024 + (r % 2) * 20000))
                    new, est, est_repeat, passed, xdp = results[label][-1]
                    print(f"round {r + 1} {label:<22} syn {new:7.1f}   established {est:6.1f}   "
                          f"est-repeat {est_repeat:6.1f}   pass {passed:6.1f}   xdp {xdp:5.1f}  (ns/run)", flush=True)
            print()
            for label, rows in results.items():
                _, _, _, insns, jited = builds[label]
                med = [statistics.median(r[i] for r in rows) for i in range(5)]
                print(f"{label:<22} median syn {med[0]:7.1f}   established {med[1]:6.1f}   est-repeat {med[2]:6.1f}"
                      f"   pass {med[3]:6.1f}   xdp {med[4]:5.1f}  (ns/run; tc_ingress: {insns} insns, {jited} bytes jited)")
        finally:
            for modules, *_ in builds.values():
                for m in modules:
                    m.cleanup()
            for pin in made:
                with contextlib.suppress(Exception):
                    loader.unmount_bpffs(pin)
                with contextlib.suppress(OSError):
                    pin.rmdir()
            with contextlib.suppress(OSError):
                TEST_ROOT.rmdir()
    return 0


if __name__ == "__main__":
    sys.exit(main())
