"""`ebpf-proxy stats`: why the eBPF datapath passed, rewrote or dropped packets, right now.

Every packet a program looks at is counted under one named reason; this prints those counters
(read from the pinned maps, see datapath/ebpf/inspect.py) next to what each reason means, drops
first and highlighted, plus how full the maps are. It works whether or not the agent has synced
lately, and never compiles or writes anything.
"""

from __future__ import annotations

import json
import sys

import click

from ebpf_proxy.datapath.ebpf import inspect as epx_inspect

EPILOG = """\b
Examples:
  ebpf-proxy stats                                   # this node's datapath, non-zero reasons
  ebpf-proxy stats --all                             # every reason, zero or not
  ebpf-proxy stats --json | jq .reasons.DROP_NO_LOCAL_EXTERNAL
  ebpf-proxy lab exec worker2 -- .venv/bin/ebpf-proxy stats   # a lab node (its bpffs is found)

\b
Exit status: 0, or 1 when no pinned maps could be read (the message names the path).
"""

VERDICT_STYLE = {"drop": "bold red", "reject": "yellow", "pass": "dim", "translate": "", "event": "yellow", "none": "dim"}
# Drops first (what the reader is looking for), then rejects, then the rest.
VERDICT_ORDER = {v: i for i, v in enumerate(epx_inspect.VERDICTS)}


def reason_table(snap: epx_inspect.Snapshot, show_all: bool):
    """The per-reason table: non-zero rows only unless `show_all`; drops first, in red."""
    from rich.table import Table

    rows = snap.reasons if show_all else snap.nonzero()
    table = Table(title=f"datapath counters ({snap.pin_dir})" if snap.pin_dir else "datapath counters",
                  caption="since the maps were created, all CPUs summed", title_justify="left")
    table.add_column("reason", no_wrap=True)
    table.add_column("verdict", no_wrap=True)
    table.add_column("packets", justify="right", no_wrap=True)
    table.add_column("bytes", justify="right", no_wrap=True)
    table.add_column("meaning", overflow="fold")
    for row in sorted(rows, key=lambda r: (VERDICT_ORDER[r.verdict], r.reason)):
        style = "" if row.verdict == "drop" and not row.packets else VERDICT_STYLE[row.verdict]
        table.add_row(row.reason.name, row.verdict, f"{row.packets:,}", f"{row.bytes:,}", row.reason.description,
                      style=style)
    return table


def map_table(snap: epx_inspect.Snapshot):
    from rich.table import Table

    table = Table(title="maps", title_justify="left")
    table.add_column("map", no_wrap=True)
    table.add_column("entries", justify="right", no_wrap=True)
    table.add_column("capacity", justify="right", no_wrap=True)
    table.add_column("holds")
    for m in snap.maps:
        full = m.max_entries and m.entries >= 0.9 * m.max_entries
        table.add_row(m.name, f"{m.entries:,}", f"{m.max_entries:,}", m.contents, style="bold yellow" if full else "")
    return table


def render(snap: epx_inspect.Snapshot, console, show_all: bool = False) -> None:
    """Both tables and a one-line drop summary on `console` (a rich Console)."""
    if show_all or snap.nonzero():
        console.print(reason_table(snap, show_all))
    else:
        console.print("no packet counted yet (--all lists every reason)")
    drops = [r for r in snap.reasons if r.is_drop and r.packets]
    if drops:
        names = ", ".join(r.reason.name for r in sorted(drops, key=lambda r: -r.packets))
        console.print(f"[bold red]{snap.dropped_packets:,} packets dropped[/]: {names}")
    else:
        console.print("no packet dropped")
    if snap.maps:
        console.print(map_table(snap))


@click.command(epilog=EPILOG)
@click.option("--bpffs", default=None, type=click.Path(file_okay=False),
              help="bpffs mount holding the pinned maps (default: the one whose datapath serves this "
                   "network namespace, else /sys/fs/bpf).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object (every reason, zeros included).")
@click.option("--all", "show_all", is_flag=True, help="List every reason, not only those that counted packets.")
def stats(bpffs: str | None, as_json: bool, show_all: bool) -> None:
    """Per-reason packet counters of the eBPF datapath (drops highlighted) and map sizes."""
    try:
        snap = epx_inspect.read(bpffs)
    except epx_inspect.InspectError as exc:
        raise click.ClickException(str(exc)) from exc
    if as_json:
        click.echo(json.dumps(snap.to_json()))
        return
    from rich.console import Console

    render(snap, Console(file=sys.stdout), show_all)


COMMANDS = [stats]
