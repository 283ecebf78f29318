"""Live progress: a console bar, an ipywidgets panel in a notebook, and `watch` for a run dir.

Like `tqdm.auto`: the runner calls a progress callback with a list of `DatasetProgress`; a
monitor is such a callback, and `auto()` picks the widget inside a Jupyter kernel, the console
elsewhere (ipywidgets is imported only by the widget). `kit.watch(run_dir)` follows a run of
another process by polling the run database's totals (never its records).

    with monitor.auto() as mon:             # from kit.report import monitor
        await kit.generate(..., progress=mon)   # redraws at most once a second
    print(monitor.text(mon.last))            # plain-text summary for headless runs
"""

from __future__ import annotations

import dataclasses
import html
import os
import sqlite3
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from kit.errors import ConfigError, MissingPath
from kit.types import DatasetProgress

_DONE_STATES = ("budget_reached", "exhausted", "failed")


# ----------------------------------------------------------------------------- formatting


def _fmt_count(n: float) -> str:
    """Compact count: 812 -> '812', 9_540 -> '9.54k', 950_000 -> '950k', 26_600_000 -> '26.6M'."""
    for div, unit in ((1e9, "B"), (1e6, "M"), (1e3, "k")):
        if abs(n) >= div:
            v = n / div
            return f"{v:.{2 if abs(v) < 10 else 1 if abs(v) < 100 else 0}f}{unit}"
    return f"{n:.0f}"


def _fmt_duration(s: float | None) -> str:
    """Seconds as a short duration: 42 -> '42s', 245 -> '4m05s', 5000 -> '1h23m', None -> '-'."""
    if s is None or s != s or s == float("inf"):
        return "-"
    s = int(round(s))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def _bar(done: float, total: float, width: int = 20) -> str:
    """ASCII bar of done/total, clipped to full: _bar(1, 4, 8) -> '[##......]'."""
    frac = min(max(done / total, 0.0), 1.0) if total > 0 else 0.0
    filled = int(frac * width)
    return "[" + "#" * filled + "." * (width - filled) + "]"


def _scale(p: DatasetProgress) -> tuple[int, int]:
    """(done, total) a row's bar and % measure: tokens against the budget; with no budget (a
    pilot, which sends every chosen prompt) requests answered, failed or skipped of all."""
    if p.budget > 0:
        return p.tokens_done, p.budget
    return p.samples_done + p.errors + p.skipped, p.prompts_total


def _totals(progress: Sequence[DatasetProgress]) -> DatasetProgress:
    """Sum of all datasets as one DatasetProgress named 'total' (state: the least advanced)."""
    tot = DatasetProgress(dataset="total", budget=0)
    for f in dataclasses.fields(DatasetProgress):
        if f.type in ("int", "float"):  # every count, the budget and the rate
            setattr(tot, f.name, sum(getattr(p, f.name) for p in progress))
    order = ("running", "waiting", "stopped", "failed", "exhausted", "budget_reached")
    states = {p.state for p in progress}
    tot.state = next((s for s in order if s in states), "waiting")
    return tot


def _row(p: DatasetProgress, width: int) -> list[str]:
    """The cells of one table row."""
    done, total = _scale(p)
    pct = 100 * done / total if total > 0 else 0.0
    samples = f"{p.samples_done:,}" + (f"/{p.prompts_total:,}" if p.prompts_total else "")
    return [
        p.dataset,
        _bar(done, total, width),
        f"{pct:.0f}%",
        f"{_fmt_count(p.tokens_done)}/{_fmt_count(p.budget) if p.budget else '-'}",
        samples,
        f"{p.mean_completion:,.0f}",
        _fmt_count(p.tokens_per_s),
        _fmt_duration(p.eta_s),
        f"{p.errors:,}",
        f"{100 * p.truncation_share:.1f}%",
        p.state,
    ]


_HEADER = "dataset progress % tokens/budget samples mean tok/s ETA err trunc state".split()
_LEFT = {0, 1, 10}  # left-aligned columns; numbers align right


def text(progress: Sequence[DatasetProgress], width: int = 20) -> str:
    """Plain-text table: one line per dataset plus a total line when there are several,
    then one "note:" line per distinct DatasetProgress.note (why the run stopped, a server
    asking for a Retry-After over the cap), naming its datasets; `width`: each bar's.

    Example:
        >>> p = DatasetProgress("sharegpt", budget=10_000_000, tokens_done=6_524_000,
        ...                     samples_done=1_720, tokens_per_s=812.0, state="running")
        >>> print(text([p], width=10))
        dataset   progress        %  tokens/budget  samples   mean  tok/s    ETA  err  trunc  state
        sharegpt  [######....]  65%    6.52M/10.0M    1,720  3,793    812  1h11m    0   0.0%  running
    """
    if not progress:
        return "(no datasets yet)"
    rows = [_HEADER] + [_row(p, width) for p in progress]
    if len(progress) > 1:
        rows.append(_row(_totals(progress), width))
    widths = [max(len(r[i]) for r in rows) for i in range(len(_HEADER))]
    lines = []
    for r in rows:
        cells = [
            c.ljust(w) if i in _LEFT else c.rjust(w)
            for i, (c, w) in enumerate(zip(r, widths, strict=True))
        ]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines + _note_lines(progress))


def _note_lines(progress: Sequence[DatasetProgress]) -> list[str]:
    """'note (a, b): <note>' once per distinct note."""
    by_note: dict[str, list[str]] = {}
    for p in progress:
        if p.note:
            by_note.setdefault(p.note, []).append(p.dataset)
    return [f"note ({', '.join(names)}): {note}" for note, names in by_note.items()]


# ----------------------------------------------------------------------------- monitors


class Monitor:
    """A progress callback that renders at most once per `min_interval` seconds.

    Calls in between are coalesced: the latest list is kept and drawn by the next due
    call, by `close()`, by a call with `final=True`, or at once when the run has settled
    (no dataset running or waiting, nothing in flight: the runner's last report). A 5%
    slack keeps a caller that itself reports once a second from losing every other frame.
    Subclasses implement `render`. Usable as a context manager (closes on exit).
    """

    def __init__(self, min_interval: float = 1.0, clock: Callable[[], float] = time.monotonic):
        if not isinstance(min_interval, (int, float)) or min_interval < 0:
            raise ConfigError(f"Monitor.min_interval must be a number >= 0, got {min_interval!r}")
        self.min_interval = float(min_interval)
        self.clock = clock
        self.last: list[DatasetProgress] = []  # the latest list received (a snapshot)
        self.renders = 0
        self._t_render: float | None = None
        self._pending = False
        self.closed = False

    def __call__(self, progress: Sequence[DatasetProgress], final: bool = False) -> None:
        settled = _settled(progress) and progress != self.last
        self.last = [dataclasses.replace(p) for p in progress]
        now = self.clock()
        due = self._t_render is None or now - self._t_render >= 0.95 * self.min_interval
        if final or due or settled:
            self._draw(now)
        else:
            self._pending = True
        if final:
            self.close()

    def _draw(self, now: float) -> None:
        self.render(self.last)
        self.renders += 1
        self._t_render = now
        self._pending = False

    def close(self) -> None:
        """Render the last list if a throttled call has not been drawn yet; idempotent."""
        if self._pending:
            self._draw(self.clock())
        if not self.closed:
            self.closed = True
            self.finish()

    def render(self, progress: list[DatasetProgress]) -> None:
        raise NotImplementedError

    def finish(self) -> None:
        """Hook run once by close(), after the last render."""

    def __enter__(self) -> Monitor:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _settled(progress: Sequence[DatasetProgress]) -> bool:
    """True when no dataset is running or waiting and no request is in flight."""
    busy = any(p.state in ("running", "waiting") or p.in_flight for p in progress)
    return bool(progress) and not busy


def _is_tty(file) -> bool:
    """True when file is a terminal that understands ANSI cursor moves."""
    try:
        return bool(file.isatty()) and os.environ.get("TERM") != "dumb"
    except (AttributeError, ValueError):
        return False


class ConsoleMonitor(Monitor):
    """Text table on a terminal (redrawn in place) or plain blocks in a log file (default
    sys.stderr); min_interval defaults to 1 s on a tty, 30 s otherwise (a log gets one block
    per 30 s, plus the final one).

    Example:
        >>> import io
        >>> out = io.StringIO()
        >>> with ConsoleMonitor(out, min_interval=0, width=4) as mon:
        ...     mon([DatasetProgress("a", budget=100, tokens_done=50, samples_done=2)])
        >>> print(out.getvalue().splitlines()[-1])
        a        [##..]    50%         50/100        2    25      0    -    0   0.0%  waiting
    """

    def __init__(self, file=None, min_interval: float | None = None, width: int = 20, **kw):
        self.file = file if file is not None else sys.stderr
        self.tty = _is_tty(self.file)
        if min_interval is None:
            min_interval = 1.0 if self.tty else 30.0
        super().__init__(min_interval, **kw)
        self.width = width
        self._lines = 0  # lines drawn by the previous render (tty redraw)

    def render(self, progress: list[DatasetProgress]) -> None:
        lines = text(progress, self.width).splitlines()
        if self.tty:
            up = f"\x1b[{self._lines}F" if self._lines else ""
            body = "".join(f"\x1b[2K{line}\n" for line in lines)
            extra = "".join("\x1b[2K\n" for _ in range(self._lines - len(lines)))
            self.file.write(up + body + extra)
            self._lines = max(len(lines), self._lines)
        else:
            stamp = time.strftime("%H:%M:%S")
            self.file.write(f"[kit {stamp}]\n" + "\n".join(lines) + "\n")
        self.file.flush()


class WidgetMonitor(Monitor):
    """ipywidgets panel: per dataset its name, a bar of tokens vs budget (a pilot's, with no
    budget: requests done of all) and an HTML line of numbers, in a grid whose name column is
    as wide as the longest name (never cut).

    Bar style: see _bar_style. The panel is shown on the first render (`display=False`:
    place `.box` yourself); on close it prints the plain-text table (so a headless notebook
    run keeps the numbers) unless `summary=False`.
    """

    def __init__(self, min_interval: float = 1.0, display: bool = True, summary: bool = True, **kw):
        import ipywidgets  # noqa: F401  (fail here, not mid-run, when it is missing)

        super().__init__(min_interval, **kw)
        self.display, self.summary = display, summary
        self.bars: dict = {}  # dataset -> ipywidgets.IntProgress
        self.labels: dict = {}  # dataset -> ipywidgets.HTML
        self.names: dict = {}  # dataset -> ipywidgets.Label
        self.grid = None  # ipywidgets.GridBox: name, bar, numbers per dataset
        self.total = None  # ipywidgets.HTML, the totals line
        self.box = None  # ipywidgets.VBox holding the grid and the totals

    def _build(self, progress: list[DatasetProgress]) -> None:
        """Create rows for datasets seen for the first time and (re)lay out the box."""
        import ipywidgets as w

        new = [p.dataset for p in progress if p.dataset not in self.bars]
        for name in new:
            self.names[name] = w.Label(name)
            self.bars[name] = w.IntProgress(min=0, max=1, layout=w.Layout(width="auto"))
            self.labels[name] = w.HTML()
        if self.box is None:
            self.total = w.HTML()
            columns = "max-content minmax(120px, 40%) minmax(0, 1fr)"
            self.grid = w.GridBox(
                layout=w.Layout(
                    grid_template_columns=columns, grid_gap="0 8px", align_items="center"
                )
            )
            self.box = w.VBox([self.grid, self.total])
            if self.display:
                from IPython.display import display

                display(self.box)
        if new:
            self.grid.children = tuple(
                c for n in self.bars for c in (self.names[n], self.bars[n], self.labels[n])
            )

    def render(self, progress: list[DatasetProgress]) -> None:
        self._build(progress)
        for p in progress:
            b, (done, total) = self.bars[p.dataset], _scale(p)
            b.max = max(int(total), 1)
            b.value = min(max(int(done), 0), b.max)
            b.bar_style = _bar_style(p)
            self.labels[p.dataset].value = _html(p)
        self.total.value = (
            "<b>" + _html(_totals(progress)) + "</b>" if progress else "no datasets yet"
        )

    def finish(self) -> None:
        if self.summary and self.last:
            print(text(self.last))


def _bar_style(p: DatasetProgress) -> str:
    """'success' at budget, else 'danger' with errors, 'warning' when exhausted, else ''."""
    done, total = _scale(p)
    if p.state == "budget_reached" or done >= total:
        return "success"
    if p.errors or p.state == "failed":
        return "danger"
    return "warning" if p.state == "exhausted" else ""


def _html(p: DatasetProgress) -> str:
    """One dataset's numbers as a compact HTML line."""
    done, total = _scale(p)
    pct = 100 * done / total if total > 0 else 0.0
    err = f"<span style='color:#c00'>{p.errors:,} errors</span>" if p.errors else "0 errors"
    tokens = "" if p.budget else f"{_fmt_count(p.tokens_done)} tokens &middot; "
    return (
        f"{_fmt_count(done)} / {_fmt_count(total)} {'tokens' if p.budget else 'requests'} "
        f"({pct:.0f}%) &middot; {tokens}"
        f"{p.samples_done:,} samples &middot; mean {p.mean_completion:,.0f} &middot; "
        f"{_fmt_count(p.tokens_per_s)} tok/s &middot; ETA {_fmt_duration(p.eta_s)} &middot; {err} "
        f"&middot; {100 * p.truncation_share:.1f}% truncated &middot; {p.state}"
        + (f"<br><span style='color:#a60'>{html.escape(p.note)}</span>" if p.note else "")
    )


def _in_notebook() -> bool:
    """True inside a Jupyter kernel (ipykernel loaded and a ZMQ shell), where widgets render."""
    if "ipykernel" not in sys.modules or "IPython" not in sys.modules:
        return False
    try:
        from IPython import get_ipython

        shell = get_ipython()
    except Exception:
        return False
    return shell is not None and type(shell).__name__ == "ZMQInteractiveShell"


def auto(file=None, **kw) -> Monitor:
    """A WidgetMonitor in a Jupyter kernel (when ipywidgets imports), else a ConsoleMonitor(file).

    Example:
        >>> type(auto()).__name__   # in a plain Python process
        'ConsoleMonitor'
    """
    if _in_notebook():
        try:
            return WidgetMonitor(**kw)
        except ImportError:
            pass
    return ConsoleMonitor(file, **kw)


# ----------------------------------------------------------------------------- watch


def watch(
    run_dir,
    interval: float = 1.0,
    until_done: bool = True,
    monitor: Callable | None = None,
    stall_timeout: float | None = 300.0,
    clock: Callable[[], float] = time.monotonic,
) -> list[DatasetProgress]:
    """Follow a run written by another process: poll its directory and render progress.

    Stops when every dataset is budget_reached, exhausted or failed, or the run's writer has
    ended or its process is gone (if `until_done`; the rows' note says which), or when
    for `stall_timeout` seconds no record or error was added and no live runner reported
    requests in flight (None: never; Ctrl-C ends it). In a notebook, run it in a thread:
    `await asyncio.to_thread(kit.watch, run_dir)`.

    Args:
        run_dir: the run directory.
        interval: seconds between polls.
        until_done: stop once every dataset is done.
        monitor: a progress callback; default `auto()`. Closed on return when it has `close`.
        stall_timeout: seconds without progress after which watching stops.
        clock: the time source the stall timeout is measured with (tests pass a fake one).

    Returns:
        The last progress list read.

    Example (a finished run):
        final = kit.watch("data/runs/demo", monitor=ConsoleMonitor(sys.stdout))
        [p.state for p in final]   # ['budget_reached', 'budget_reached']
    """
    run_dir = Path(run_dir)
    if not isinstance(interval, (int, float)) or interval <= 0:
        raise ConfigError(f"watch: interval must be a number > 0, got {interval!r}")
    if not run_dir.is_dir():
        raise MissingPath(f"watch: run directory {str(run_dir)!r} does not exist")
    if stall_timeout is not None and stall_timeout <= 0:
        raise ConfigError(f"watch: stall_timeout must be > 0 or None, got {stall_timeout!r}")
    monitor = monitor if monitor is not None else auto()
    mark, t_mark = None, clock()
    try:
        while True:
            progress, gone = _read(run_dir)
            now = clock()
            seen = tuple((p.dataset, p.tokens_done, p.samples_done, p.errors) for p in progress)
            if seen != mark or any(p.in_flight for p in progress):  # in flight: not stalled
                mark, t_mark = seen, now
            monitor(progress)
            done = bool(progress) and all(p.state in _DONE_STATES for p in progress)
            if (
                until_done
                and (done or gone)
                or (stall_timeout is not None and now - t_mark >= stall_timeout)
            ):
                return progress
            time.sleep(interval)
    finally:
        if callable(close := getattr(monitor, "close", None)):
            close()


def _read(run_dir: Path) -> tuple[list[DatasetProgress], str | None]:
    """The run's progress from its totals table, and why nothing writes it any more (None
    while a writer may: kit.run.progress.writer_gone); [] before the run made its database."""
    from kit.run.progress import progress_and_writer

    try:
        return progress_and_writer(run_dir)
    except (FileNotFoundError, sqlite3.OperationalError) as e:
        if isinstance(e, sqlite3.OperationalError) and "no such table" not in str(e):
            raise
        return [], None
