"""Compile and pin the datapath in a short-lived process: `python -m ebpf_proxy.datapath.ebpf.compile`.

bcc compiles with LLVM inside the calling process: importing bcc alone maps ~60 MiB, a compile
leaves the process at ~250 MiB, and none of it is ever given back (shared/PLATFORM.md, pitfall 5).
The agent therefore never compiles itself: loader.load() runs this module as a child, which
compiles bpf/ with bcc, creates (or re-opens) the pinned maps, loads the programs and pins them
under <pin dir>/progs/<build id>/, stores the build in the node's program cache when given one
(objcache.py), then exits. The agent opens those pins by path, exactly as it
does after a restart, and its memory stays what its own state needs.

The one line on stdout is a JSON object, {"ok": true, "build": ..., "seconds": ...,
"peak_rss_mib": ...} or {"ok": false, "error": "..."}; bcc's diagnostics go to stderr.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path


def _peak_rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return 0.0


def _entries(text: str) -> tuple[str, int]:
    name, _, value = text.partition("=")
    if not name or not value.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r}: expected MAP=ENTRIES")
    return name, int(value)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m ebpf_proxy.datapath.ebpf.compile",
                                     description="Compile the eBPF datapath with bcc and pin it (maps and programs).")
    parser.add_argument("--pin-dir", required=True, type=Path, help="pin directory, on a bpf filesystem")
    parser.add_argument("--src-dir", required=True, type=Path, help="the C sources (bpf/)")
    parser.add_argument("--program", action="append", default=[], dest="programs", help="a program to load (repeat)")
    parser.add_argument("--max-entries", action="append", default=[], type=_entries, metavar="MAP=ENTRIES",
                        help="capacity of a map (repeat)")
    parser.add_argument("--build", required=True, help="the build id the caller expects (loader.build_id)")
    parser.add_argument("--cache-dir", type=Path, default=None, help="the node's program cache: store this build there")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="compile: %(levelname)s %(message)s")
    from ebpf_proxy.datapath.ebpf import loader, toolchain  # noqa: PLC0415 (after argument errors)

    loader.BPF_SRC_DIR = args.src_dir
    sizes = dict(args.max_entries)
    start = time.monotonic()
    try:
        build = loader.build_id(args.programs, {**loader.MAX_ENTRIES, **sizes})
        if build != args.build:
            raise loader.LoadError(f"build id {build} here, {args.build} in the agent: the sources changed "
                                   "while it started; restart it")
        loaded = loader.load(args.pin_dir, args.programs, sizes, in_process=True, cache_dir=args.cache_dir)
        loaded.close()
    except (loader.LoadError, toolchain.KernelHeadersMissing, OSError) as exc:
        print(json.dumps({"ok": False, "error": str(exc)}), flush=True)
        return 1
    print(json.dumps({"ok": True, "build": build, "seconds": round(time.monotonic() - start, 3),
                      "peak_rss_mib": round(_peak_rss_mib(), 1)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
