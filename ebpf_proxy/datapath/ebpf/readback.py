"""A restart's read-back of the pinned maps, done by a helper process while the agent lists.

An agent restarted over pinned maps first reads back what they hold (adopt.read: every service
record, slot and backend, 1.3-1.9 s of CPU at 100,000 Services x 10 endpoints) before its
first sync can take them over. Nothing in that read depends on the Services the agent is
listing, and the list keeps the agent's one interpreter busy for seconds (its threads share one
CPU through the GIL) while a node has others. So, as soon as the datapath is created (agent.prepare_datapath,
before the list is done), `ReadAhead.start` runs `python -m ebpf_proxy.datapath.ebpf.readback`:
a helper that opens the pins read-only, reads them (adopt.read) and says it is ready. It keeps
what it read (in its own memory, not the agent's, where it would have added ~20 MiB to the peak
of the list) until the first sync asks for it: then it writes the ids of the maps it read and the
Snapshot (packed tables: ~22 MB, pickled and unpickled in ~15 ms each) to a pipe, and exits.
(A pickle: the helper is the agent's own child, the pipe private to the two.)

While it waits, the helper also makes what adopt() would make of each service id it read
(adopt.made_ahead: ~1.5 s of CPU at 100,000 Services, the larger part of a restart's takeover),
a chunk at a time, each chunk pickled at once, until the first sync asks (make_until_asked). It
sends what it made after the Snapshot; adopt() takes each as its own and makes the rest itself.
The agent only unpickles them (~0.3 s at 100,000 Services). Restarts alternating on one lab at
100,000 Services x 10 endpoints, 5 each: the first sync 4.5 -> 2.8 s, the restart (start to
healthy) 14.2 -> 12.4 s, medians (docs/benchmarks/2026-11-27-100k-madeahead).

The first sync takes it (`ReadAhead.take`) only if it is certainly what adopt.read would read
there and then: the helper read the very maps the loaded programs use (the kernel's map ids, which
are never reused while a map exists; a load that recreated a map, or pins replaced meanwhile, give
other ids), and nothing wrote them since (this agent writes them only from its first sync on; the
programs write only the connection and affinity maps, whose entries reference ids the read
already counted; the agent before this one has exited, as a DaemonSet replaces its pod: two
agents over the same maps would race with any read-back, the first sync's own included).
Anything else (the helper failed, timed out, or read other maps) is logged and the first sync
reads the maps itself, as before: the read-ahead can only save time.
"""

from __future__ import annotations

import argparse
import itertools
import logging
import pickle
import select
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import BinaryIO

from ebpf_proxy.datapath.ebpf import adopt
from ebpf_proxy.datapath.ebpf import structs as s
from ebpf_proxy.datapath.ebpf.maps import Maps, Maps6

log = logging.getLogger(__name__)

# How long the first sync waits for a helper still reading (100,000 Services x 10 endpoints take
# ~2 s); past it the helper is stopped and the sync reads the maps itself.
WAIT_SECONDS = 60.0


def map_ids(maps: Maps) -> dict[str, int]:
    """The kernel's id of each of the datapath's maps, by name: which map objects `maps` are."""
    return {name: maps.map_id(name) for name in s.MAPS}


def read_pinned(pin_dir: Path, family: int) -> tuple[dict[str, int], adopt.Snapshot]:
    """(map ids, adopt.read of family `family`'s view) of the maps pinned in `pin_dir`."""
    maps = Maps.open_pinned(pin_dir, readonly=True)
    try:
        view = maps if family == 4 else Maps6(maps)
        return map_ids(maps), adopt.read(view)
    finally:
        maps.close()


# ServiceEntries the helper makes (adopt.made_ahead) and pickles at a time while it waits for
# SEND: ~30 ms of its CPU, the most it answers SEND late, and no more of them held unpickled
MADE_CHUNK = 1000

READY = b"ready\n"  # the helper, once it has read the maps
SEND = b"send\n"  # the first sync, to the helper: write them


class ReadAhead:
    """One helper's read-back of a family's pinned maps, started now, taken by the first sync."""

    def __init__(self, pin_dir: Path, family: int) -> None:
        self.pin_dir, self.family = pin_dir, family
        self._error = ""
        self._proc: subprocess.Popen | None = None
        self._done = threading.Event()  # the helper is ready, or failed (_error says how)

    @classmethod
    def start(cls, pin_dir: Path, family: int) -> ReadAhead:
        ahead = cls(pin_dir, family)
        try:
            ahead._proc = subprocess.Popen(
                [sys.executable, "-m", __name__, "--pin-dir", str(pin_dir), "--family", str(family)],
                # its messages (a warning, why it failed) come before READY on the one pipe, read
                # as they come: a helper never blocks on a full pipe nobody reads
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        except OSError as exc:
            ahead._error = f"cannot start: {exc}"
            ahead._done.set()
            return ahead
        threading.Thread(target=ahead._collect, name=f"readback-ipv{family}", daemon=True).start()
        return ahead

    def _collect(self) -> None:
        """Wait for the helper's READY; or its end, and its last message as the reason."""
        proc = self._proc
        assert proc is not None and proc.stdout is not None
        last = ""
        try:
            for line in proc.stdout:
                if line == READY:
                    return
                last = line.decode(errors="replace").strip() or last
            self._error = f"exited with status {proc.wait()}: {last}"
        except Exception as exc:  # noqa: BLE001 - any failure means: read in the agent instead
            self._error = f"failed: {exc}"
        finally:
            self._done.set()

    def take(self, maps: Maps, wait: float = WAIT_SECONDS) -> adopt.Snapshot | None:
        """The helper's Snapshot if it read `maps` themselves (see the module docstring); None,
        logged, otherwise. Waits up to `wait` seconds for a helper still reading."""
        started = time.monotonic()
        if not self._done.wait(wait):
            self.stop()
            return self._refuse(f"still reading after {wait:g} s: stopped")
        if self._error:
            return self._refuse(self._error)
        proc = self._proc
        assert proc is not None and proc.stdin is not None and proc.stdout is not None
        try:
            proc.stdin.write(SEND)
            proc.stdin.close()
            ids, snap = pickle.load(proc.stdout)  # streamed: no copy of the whole pickle held
            snap.made = [None] * (snap.max_svc_id + 1)  # the highest id of any record: made's too
            while (made := pickle.load(proc.stdout)) is not None:
                for entries in made:
                    snap.made[entries.svc_id] = entries
        except Exception as exc:  # noqa: BLE001
            return self._refuse(f"sent what is not a read-back ({exc})")
        finally:
            self.stop()
        made = sum(entries is not None for entries in snap.made)
        mine = map_ids(maps)
        if ids != mine:
            moved = sorted(name for name in mine if ids.get(name) != mine[name])
            return self._refuse(f"read other maps than the ones loaded ({', '.join(moved)})")
        log.info("IPv%d maps read back by a helper process while the agent listed (taken in %.3f s; "
                 "the entries of %d of %d service ids made ahead)", self.family, time.monotonic() - started,
                 made, snap.records.service_count(),
                 extra={"pin_dir": str(self.pin_dir), "family": f"IPv{self.family}", "made_ahead": made})
        return snap

    def _refuse(self, why: str) -> None:
        log.warning("read-ahead of the pinned IPv%d maps not used: the helper %s; the first sync reads "
                    "them itself", self.family, why, extra={"pin_dir": str(self.pin_dir), "family": f"IPv{self.family}"})
        return None

    def stop(self) -> None:
        """End the helper (done, or no longer wanted: the datapath closed before its first sync)
        and release its pipes."""
        proc = self._proc
        if proc is None:
            return
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        for pipe in (proc.stdin, proc.stdout):
            if pipe is not None:
                pipe.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=f"python -m {__name__}", description=__doc__.splitlines()[0])
    parser.add_argument("--pin-dir", required=True, type=Path, help="the datapath's pin directory")
    parser.add_argument("--family", required=True, type=int, choices=(4, 6), help="which family's maps")
    args = parser.parse_args(argv)
    try:
        result = read_pinned(args.pin_dir, args.family)
    except OSError as exc:
        print(f"{exc.filename or args.pin_dir}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    out, ask = sys.stdout.buffer, sys.stdin.buffer
    out.write(READY)
    out.flush()
    made = make_until_asked(result[1], ask)
    if ask.readline() == SEND:  # else the agent went away (EOF): nothing to send
        pickle.dump(result, out, protocol=pickle.HIGHEST_PROTOCOL)
        for chunk in made:
            out.write(chunk)
        pickle.dump(None, out)
        out.flush()
    return 0


def make_until_asked(snap: adopt.Snapshot, ask: BinaryIO, chunk: int = MADE_CHUNK) -> list[bytes]:
    """adopt.made_ahead of every service id of `snap`, `chunk` ids at a time, each chunk pickled
    (a list of ServiceEntries), until they are all made or `ask` has something to read (the
    first sync's SEND, or EOF): what is made by then is sent, the first sync makes the rest."""
    ids = snap.records.service_ids()
    made: list[bytes] = []
    while not select.select([ask], [], [], 0)[0]:
        entries = [adopt.made_ahead(snap, svc_id) for svc_id in itertools.islice(ids, chunk)]
        if not entries:
            break
        made.append(pickle.dumps(entries, protocol=pickle.HIGHEST_PROTOCOL))
    return made


if __name__ == "__main__":
    sys.exit(main())
