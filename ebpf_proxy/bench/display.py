"""What the bench shows while it runs: a progress bar, the current step, and the figures so far.

On a terminal this is one live rich view (progress above, a table that grows one row per
measured point). Elsewhere (CI logs, a pipe) a live view would print nothing useful until the
end, so each step and each row is printed as one plain line instead.
"""

from __future__ import annotations

from rich.console import Console, Group
from rich.live import Live
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table


def _num(x: float | None) -> str:
    if x is None:
        return "–"
    return f"{x:,.0f}" if abs(x) >= 100 else f"{x:.3g}"


def row_cells(row: dict) -> list[str]:
    return [row["metric"], row["path"] or "–", row["mode"], f"{row['services']:,}", _num(row["value"]),
            row["unit"], _num(row.get("p50")), _num(row.get("p99")), f"{row['spread'] * 100:.0f}%"]


COLUMNS = ("metric", "path", "mode", "services", "value", "unit", "p50", "p99", "spread")


class Display:
    """Context manager; `total` steps for the bar, then step()/detail()/advance()/row()/note()."""

    def __init__(self, total: int, console: Console | None = None) -> None:
        self.console = console or Console(stderr=True)
        self.live_mode = self.console.is_terminal
        self.progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                 TimeElapsedColumn(), console=self.console)
        self.task = self.progress.add_task("bench", total=total)
        self.table = Table(*COLUMNS, title="ebpf-proxy bench", expand=False)
        self._live: Live | None = None

    def __enter__(self) -> "Display":
        if self.live_mode:
            self._live = Live(Group(self.progress, self.table), console=self.console, refresh_per_second=4)
            self._live.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self._live is not None:
            self._live.__exit__(*exc)
            self._live = None

    def step(self, text: str) -> None:
        self.progress.update(self.task, description=text)
        if not self.live_mode:
            self.console.print(f"[bench] {text}", highlight=False, markup=False)

    def detail(self, text: str) -> None:
        """Progress within a step (a run's rate, a change's latency): live view only, not logged."""
        self.progress.update(self.task, description=text)

    def advance(self, steps: int = 1) -> None:
        self.progress.advance(self.task, steps)

    def row(self, row: dict) -> None:
        cells = row_cells(row)
        self.table.add_row(*cells)
        if not self.live_mode:
            line = "  ".join(f"{c}={v}" for c, v in zip(COLUMNS, cells))
            self.console.print(f"[bench]   {line}", highlight=False, markup=False)

    def note(self, text: str) -> None:
        self.console.print(f"[bench] note: {text}", highlight=False, markup=False)
