"""kit.report.monitor: text table, throttling, console and widget monitors, watch over a run dir."""

from __future__ import annotations

import asyncio
import dataclasses
import doctest
import io
import time

import pytest

import kit
from kit.report import monitor as M
from kit.run.progress import progress as progress_of
from kit.run.store import RunStore
from kit.types import DatasetProgress, RunConfig, Sampling

# ----------------------------------------------------------------------------- formatting


def test_fmt_count_and_duration():
    assert [M._fmt_count(n) for n in (0, 812, 9_540, 950_000, 6_400_000, 26_600_000, 2e9)] == [
        "0",
        "812",
        "9.54k",
        "950k",
        "6.40M",
        "26.6M",
        "2.00B",
    ]
    assert [M._fmt_duration(s) for s in (None, 0, 42, 245, 5000, 90_000)] == [
        "-",
        "0s",
        "42s",
        "4m05s",
        "1h23m",
        "1d01h",
    ]


def test_bar_fills_and_clips():
    assert M._bar(1, 4, 8) == "[##......]"
    assert M._bar(0, 10, 4) == "[....]"
    assert M._bar(25, 10, 4) == "[####]"  # overshoot clips to full
    assert M._bar(5, 0, 4) == "[....]"  # no budget: empty, no ZeroDivisionError


def story() -> list[DatasetProgress]:
    """The DESIGN.md story: 1,720 responses averaging 3,793 tokens against a 10M budget."""
    a = DatasetProgress(
        "opencode",
        budget=10_000_000,
        tokens_done=1_720 * 3_793,
        samples_done=1_720,
        prompts_total=7_000,
        errors=3,
        truncated=86,
        tokens_per_s=812.0,
        state="running",
    )
    b = DatasetProgress(
        "sharegpt",
        budget=2_000_000,
        tokens_done=2_000_400,
        samples_done=5_000,
        prompts_total=7_000,
        state="budget_reached",
    )
    return [a, b]


def test_text_table_numbers():
    lines = M.text(story(), width=10).splitlines()
    assert lines[0].split() == M._HEADER
    row = lines[1].split()
    # 6,523,960 / 10M = 65%; (10M - 6,523,960) / 812 tok/s = 4,281 s
    assert row == [
        "opencode",
        "[######....]",
        "65%",
        "6.52M/10.0M",
        "1,720/7,000",
        "3,793",
        "812",
        "1h11m",
        "3",
        "5.0%",
        "running",
    ]
    assert lines[2].split() == [
        "sharegpt",
        "[##########]",
        "100%",
        "2.00M/2.00M",
        "5,000/7,000",
        "400",
        "0",
        "-",
        "0",
        "0.0%",
        "budget_reached",
    ]
    total = lines[3].split()  # 8,524,360 of 12M; ETA (12M - 8,524,360) / 812 = 4,280 s
    assert total[0] == "total" and total[2:5] == ["71%", "8.52M/12.0M", "6,720/14,000"]
    assert total[7] == "1h11m" and total[-1] == "running"
    starts = {
        line.rindex(word)
        for line, word in zip(lines, ["state", "running", "budget_", "running"], strict=True)
    }
    assert len(starts) == 1  # the state column starts at the same place on every line


def test_text_single_dataset_has_no_total_and_empty_list_says_so():
    assert len(M.text(story()[:1]).splitlines()) == 2
    assert M.text([]) == "(no datasets yet)"


def test_totals_state_is_least_advanced():
    a, b = story()
    assert M._totals([a, b]).state == "running"
    a.state = "exhausted"
    assert M._totals([a, b]).state == "exhausted"
    assert M._totals([a, b]).errors == 3


# ----------------------------------------------------------------------------- throttling


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


class Recorder(M.Monitor):
    """A Monitor whose render keeps what it was given."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.drawn: list[list[DatasetProgress]] = []

    def render(self, progress):
        self.drawn.append(progress)


def snap(tokens: int) -> list[DatasetProgress]:
    return [DatasetProgress("a", budget=100, tokens_done=tokens, samples_done=1)]


def test_calls_within_a_second_are_coalesced_and_close_renders_the_last():
    clock = Clock()
    mon = Recorder(clock=clock)
    for i, dt in enumerate([0.0, 0.3, 0.3, 0.3]):  # t = 0, .3, .6, .9
        clock.t += dt
        mon(snap(10 * i))
    assert [p[0].tokens_done for p in mon.drawn] == [0]
    clock.t += 0.2  # 1.1 s after the first render
    mon(snap(40))
    clock.t += 0.1
    mon(snap(50))
    assert [p[0].tokens_done for p in mon.drawn] == [0, 40]
    mon.close()
    assert [p[0].tokens_done for p in mon.drawn] == [0, 40, 50]
    mon.close()  # idempotent: nothing new to draw
    assert mon.renders == 3


def test_final_call_always_renders_and_snapshots_are_copies():
    clock = Clock()
    mon = Recorder(clock=clock)
    live = snap(5)
    mon(live)
    live[0].tokens_done = 99  # the runner mutates its objects in place
    mon(live, final=True)  # same instant, still drawn
    assert [p[0].tokens_done for p in mon.drawn] == [5, 99]
    assert mon.closed


def test_a_settled_run_renders_at_once_without_close():
    clock = Clock()
    mon = Recorder(clock=clock)
    mon(snap(10))
    clock.t += 0.1
    mon(snap(20))  # running: coalesced
    done = [
        DatasetProgress("a", budget=100, tokens_done=104, samples_done=8, state="budget_reached")
    ]
    clock.t += 0.1
    mon(done)  # the runner's last report: nothing running, nothing in flight
    assert [p[0].tokens_done for p in mon.drawn] == [10, 104]
    clock.t += 0.1
    mon(done)  # the same settled list again is not redrawn
    draining = [dataclasses.replace(done[0], in_flight=3)]
    mon(draining)  # budget reached but requests still draining: not settled
    assert mon.renders == 2


def test_bad_min_interval_is_refused():
    with pytest.raises(ValueError, match="min_interval.*-1"):
        Recorder(min_interval=-1)


# ----------------------------------------------------------------------------- console


def test_console_plain_blocks_to_a_file():
    out, clock = io.StringIO(), Clock()
    mon = M.ConsoleMonitor(out, clock=clock, width=10)
    assert not mon.tty and mon.min_interval == 30.0  # a log gets a block per 30 s
    mon(story())
    clock.t += 5
    mon(story()[:1])  # coalesced
    assert out.getvalue().count("[kit ") == 1
    a, b = story()
    a.tokens_done, a.state = 10_000_000, "budget_reached"
    mon([a, b], final=True)
    blocks = out.getvalue().split("[kit ")[1:]
    assert len(blocks) == 2 and "\x1b[" not in out.getvalue()
    last = blocks[-1].splitlines()
    assert last[2].split()[:3] == ["opencode", "[##########]", "100%"]
    assert last[-1].startswith("total") and last[-1].endswith("budget_reached")


class TTY(io.StringIO):
    def isatty(self):
        return True


def test_console_redraws_in_place_on_a_tty(monkeypatch):
    monkeypatch.setenv("TERM", "xterm")
    out, clock = TTY(), Clock()
    mon = M.ConsoleMonitor(out, clock=clock)
    assert mon.tty and mon.min_interval == 1.0
    mon(story())  # header + 2 rows + total = 4 lines
    first = out.getvalue()
    assert first.count("\x1b[2K") == 4 and "\x1b[4F" not in first
    clock.t += 1
    mon(story()[:1])  # shrinks to 2 lines: moves up 4, draws 2, blanks 2
    second = out.getvalue()[len(first) :]
    assert second.startswith("\x1b[4F") and second.count("\x1b[2K") == 4
    assert second.endswith("\x1b[2K\n\x1b[2K\n")


def test_auto_outside_a_kernel_is_console():
    assert not M._in_notebook()
    mon = M.auto(file=io.StringIO())
    assert isinstance(mon, M.ConsoleMonitor)


# ----------------------------------------------------------------------------- widget


def test_widget_monitor_builds_and_updates(capsys):
    import ipywidgets

    clock = Clock()
    mon = M.WidgetMonitor(display=False, clock=clock)
    a, b = story()
    a_run = dataclasses.replace(a, errors=0)
    mon([a_run])
    bar = mon.bars["opencode"]
    assert isinstance(bar, ipywidgets.IntProgress)
    assert (bar.max, bar.value, bar.bar_style) == (10_000_000, 6_523_960, "")
    assert "6.52M / 10.0M tokens (65%)" in mon.labels["opencode"].value
    assert len(mon.grid.children) == 3  # one row: name, bar, numbers
    assert mon.names["opencode"].value == "opencode"  # the whole name, in its own column

    clock.t += 1
    mon([a, b])  # a has 3 errors; b appears, over budget
    assert mon.bars["opencode"].bar_style == "danger"
    assert "3 errors" in mon.labels["opencode"].value
    sb = mon.bars["sharegpt"]
    assert (sb.max, sb.value, sb.bar_style) == (2_000_000, 2_000_000, "success")  # clipped
    assert len(mon.grid.children) == 6 and mon.box.children[-1] is mon.total
    assert "8.52M / 12.0M tokens (71%)" in mon.total.value

    a_done = dataclasses.replace(a, tokens_done=10_000_100, state="budget_reached", in_flight=2)
    b_short = dataclasses.replace(b, tokens_done=1_000, state="exhausted")
    clock.t += 0.2
    mon([a_done, b_short])  # throttled ...
    assert mon.bars["opencode"].value == 6_523_960
    mon.close()  # ... but close renders it
    assert mon.bars["opencode"].bar_style == "success"
    assert mon.bars["opencode"].value == 10_000_000
    assert (mon.bars["sharegpt"].value, mon.bars["sharegpt"].bar_style) == (1_000, "warning")
    printed = capsys.readouterr().out  # the plain-text summary for headless runs
    assert "opencode" in printed and "budget_reached" in printed and "exhausted" in printed


# ----------------------------------------------------------------------------- watch
#
# No test here waits on the wall clock: the run grows from the monitor callback (watch calls
# it between two polls, so each poll sees exactly the writes of the step before), and the
# stall timeout runs on a fake clock that moves on by a fixed step at each reading.


class Ticks:
    """A fake clock for watch(clock=...): each reading moves it on by `step` seconds."""

    def __init__(self, step: float = 0.25) -> None:
        self.t, self.step = 0.0, step

    def __call__(self) -> float:
        self.t += self.step
        return self.t


def record(dataset: str, i: int, tokens: int, finish: str = "stop") -> kit.Record:
    return kit.Record(
        dataset=dataset,
        prompt_id=f"{dataset}-{i}",
        sample=0,
        messages=[{"role": "user", "content": "q"}],
        completion="x " * tokens,
        finish_reason=finish,
        completion_tokens=tokens,
        count_source="usage",
        t_done=time.time(),
    )


class Planted:
    """A run written through RunStore while watch reads it: `add` commits records at once
    (commit=False leaves them in the writer's buffer, as a runner between two commits)."""

    def __init__(self, tmp_path, budgets: dict[str, int], prompts: dict[str, int] | None = None):
        import polars as pl
        from test_audit import PROMPT_SCHEMA

        self.dir = tmp_path / "run"
        cfg = RunConfig(model="m", endpoints=["http://x/v1"], sampling=Sampling(), budgets=budgets)
        rows = [
            {
                "dataset": d,
                "prompt_id": f"p{d}{k}",
                "messages": [{"role": "user", "content": f"q{k}"}],
                "tools": None,
                "n_turns": 1,
                "row": k,
            }
            for d, n in (prompts or {}).items()
            for k in range(n)
        ]
        self.store = RunStore(self.dir, flush_every=10**9, flush_interval=10**9)
        self.store.init(cfg, pl.DataFrame(rows, schema=PROMPT_SCHEMA) if rows else None)

    def add(self, records: list[kit.Record], commit: bool = True) -> None:
        for r in records:
            self.store.append(r)
        if commit:
            self.store.flush()


@pytest.fixture
def planted(tmp_path):
    runs: list[Planted] = []

    def make(budgets, prompts=None) -> Planted:
        runs.append(Planted(tmp_path, budgets, prompts))
        return runs[-1]

    yield make
    for run in runs:
        run.store.close()


def writer(run: Planted, steps: list, seen: list):
    """A monitor that keeps (samples_done, tokens_done) of each poll, then applies the next
    step before the next poll: records to commit, ("buffer", records) or "flush"."""
    steps = list(steps)

    def monitor(progress: list[DatasetProgress]) -> None:
        seen.append((progress[0].samples_done, progress[0].tokens_done))
        if not steps:
            return
        step = steps.pop(0)
        if step == "flush":
            run.store.flush()
        elif isinstance(step, tuple):
            run.add(step[1], commit=False)
        else:
            run.add(step)

    return monitor


def test_watch_finished_run_returns_at_once(planted):
    run = planted({"a": 100, "b": 1_000}, prompts={"a": 10, "b": 3})
    run.add(
        [record("a", i, 60) for i in range(2)] + [record("b", i, 5, "length") for i in range(3)]
    )
    out = io.StringIO()
    mon = M.ConsoleMonitor(out, min_interval=0)
    final = kit.watch(run.dir, interval=0.05, monitor=mon)
    assert mon.renders == 1  # one poll, one render: a finished run is not polled again
    assert [(p.dataset, p.tokens_done, p.state) for p in final] == [
        ("a", 120, "budget_reached"),
        ("b", 15, "exhausted"),
    ]
    assert final[1].truncation_share == 1.0
    assert "budget_reached" in out.getvalue() and "100.0%" in out.getvalue()


def test_watch_follows_a_growing_run_until_budget(planted):
    run = planted({"a": 200})
    seen: list[tuple[int, int]] = []
    steps = [[record("a", i, 20)] for i in range(12)]  # 240 tokens: more than the budget
    final = kit.watch(run.dir, interval=0.01, monitor=writer(run, steps, seen))
    assert seen == [(i, 20 * i) for i in range(11)]  # every step seen, stopped at the budget
    assert (final[0].state, final[0].tokens_done) == ("budget_reached", 200)


def test_watch_sees_only_committed_records(planted):
    run = planted({"a": 10_000})
    run.add([record("a", 0, 7)])
    run.add([record("a", 1, 7)], commit=False)  # in the writer's buffer, not in the database
    final = kit.watch(
        run.dir, interval=0.01, stall_timeout=1.0, monitor=lambda ps: None, clock=Ticks()
    )
    assert (final[0].samples_done, final[0].tokens_done) == (1, 7)
    assert final[0].state == "stopped"  # no live runner status: stalled, not done


def test_watch_counts_records_when_their_commit_lands(planted):
    run = planted({"a": 100})
    seen: list[tuple[int, int]] = []
    recs = [record("a", i, 20) for i in range(5)]
    steps = [[recs[0]], [recs[1]], ("buffer", [recs[2]]), "flush", [recs[3]], [recs[4]]]
    final = kit.watch(run.dir, interval=0.01, monitor=writer(run, steps, seen))
    assert (final[0].samples_done, final[0].tokens_done) == (5, 100)
    # it sat at 2 records while the third was buffered, and never counted it early
    assert seen == [(0, 0), (1, 20), (2, 40), (2, 40), (3, 60), (4, 80), (5, 100)]


def test_watch_stops_when_the_run_stalls_or_never_starts(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    polls: list = []
    final = kit.watch(empty, interval=0.01, stall_timeout=1.0, monitor=polls.append, clock=Ticks())
    # clock 0.25 at the start, 0.5 at the first poll (the mark), then 0.75 .. 1.5: 1 s unchanged
    assert final == [] and polls == [[]] * 5


def test_watch_is_not_stalled_while_a_live_runner_has_requests_in_flight(planted):
    run = planted({"a": 1_000})
    run.add([record("a", 0, 10)])
    live = DatasetProgress("a", budget=1_000, in_flight=2, state="running")

    def beat() -> None:  # a live runner's status row (RunStore.write_status)
        run.store.write_status([live])

    in_flight: list[int] = []

    def monitor(progress):  # the runner beats before each of the first 8 polls, then ends
        in_flight.append(progress[0].in_flight)
        if len(in_flight) < 8:
            beat()
        elif len(in_flight) == 8:
            run.store.write_status([live], finished=True)

    beat()
    final = kit.watch(run.dir, interval=0.01, stall_timeout=1.0, monitor=monitor, clock=Ticks())
    # 8 live polls span 2 s of the clock with no new record (the stall timeout is 1 s); once
    # the runner has ended, the next poll says so and it stops
    assert in_flight == [2] * 8 + [0]
    assert final[0].in_flight == 0 and final[0].tokens_done == 10
    assert final[0].note.startswith("the run stopped (its writer, pid")


def test_watch_until_done_false_keeps_watching_until_stall(planted):
    run = planted({"a": 10})
    run.add([record("a", 0, 50)])
    polls: list = []
    final = kit.watch(
        run.dir,
        interval=0.01,
        until_done=False,
        stall_timeout=1.0,
        monitor=polls.append,
        clock=Ticks(),
    )
    assert final[0].state == "budget_reached" and len(polls) == 5  # done at once, kept 1 s more


def test_watch_first_read_is_a_few_small_queries(planted, monkeypatch):
    """watch reads the totals table, never the records: its cost does not grow with the run."""
    import sqlite3

    run = planted({"a": 10**9})
    run.add([record("a", i, 3) for i in range(500)])
    statements: list[str] = []
    connect = sqlite3.connect

    def traced(*args, **kw):
        conn = connect(*args, **kw)
        conn.set_trace_callback(statements.append)
        return conn

    monkeypatch.setattr(sqlite3, "connect", traced)
    final = kit.watch(run.dir, stall_timeout=0.5, monitor=lambda ps: None, clock=Ticks())
    assert final[0].samples_done == 500 and final[0].tokens_done == 1500
    scans = [
        s for s in statements if "FROM records" in s and "rowid >" not in s and "EXISTS" not in s
    ]
    assert statements and scans == [] and len(statements) < 40, statements


def test_watch_refuses_bad_arguments(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope"):
        kit.watch(tmp_path / "nope")
    with pytest.raises(ValueError, match="interval.*0"):
        kit.watch(tmp_path, interval=0)
    with pytest.raises(ValueError, match="stall_timeout.*-1"):
        kit.watch(tmp_path, stall_timeout=-1)


def test_docstring_examples_hold():
    result = doctest.testmod(M)
    assert result.attempted >= 4 and result.failed == 0


# ----------------------------------------------------------------------------- real run


@pytest.mark.server
@pytest.mark.slow
def test_monitor_and_watch_follow_a_real_run(embedded_server, tmp_path):
    import polars as pl

    questions = [f"Name {k} fruits." for k in range(2, 10)] + [
        f"Say hi {k} times." for k in range(4)
    ]
    names = ["fruits"] * 8 + ["hi"] * 4
    frame = pl.DataFrame(
        {
            "dataset": names,
            "prompt_id": [f"p{i}" for i in range(12)],
            "messages": [[{"role": "user", "content": q}] for q in questions],
            "n_turns": [1] * 12,
            "row": list(range(12)),
        }
    )
    run_dir, out = tmp_path / "run", io.StringIO()
    live = M.ConsoleMonitor(out, min_interval=1.0)  # never closed: the settled rule draws the end

    async def main():
        config = RunConfig(
            model=embedded_server.model,
            endpoints=embedded_server.base_url,
            budgets={"fruits": 120, "hi": 10_000},
            sampling=Sampling(max_tokens=32, seed=1),
            concurrency=4,
        )
        run = await kit.generate(frame, config, run_dir=run_dir, progress=live, background=True)
        watched = await asyncio.to_thread(
            kit.watch, run_dir, interval=0.2, monitor=lambda ps: None, stall_timeout=120
        )
        await run.wait()
        return run, watched

    t0 = time.monotonic()
    run, watched = asyncio.run(main())
    print(f"real run + watch: {time.monotonic() - t0:.1f} s")
    final = run.status().datasets
    states = {p.dataset: p.state for p in final}
    assert run.stop_reason is None and set(states.values()) <= set(M._DONE_STATES), (
        run.stop_reason,
        final,
    )
    assert {p.dataset: p.state for p in watched} == states  # watch saw the same ending
    assert all(w.tokens_done <= f.tokens_done for w, f in zip(watched, final, strict=True))  # drain
    # the live monitor was never closed, yet its last render is the runner's final report
    assert [(p.dataset, p.state, p.tokens_done) for p in live.last] == [
        (p.dataset, p.state, p.tokens_done) for p in final
    ]
    last_block = out.getvalue().split("[kit ")[-1].splitlines()[2:]
    for line, p in zip(last_block, final, strict=False):  # tokens, samples, state as rendered
        cells = M._row(p, 20)
        assert line.split()[:5] == cells[:5] and line.split()[-1] == p.state
    on_disk = progress_of(run_dir)  # watch's view after the drain equals the runner's
    assert [(p.tokens_done, p.samples_done) for p in on_disk] == [
        (p.tokens_done, p.samples_done) for p in final
    ]
