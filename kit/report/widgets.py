"""Interactive planning for notebooks: budget per dataset, throughput and confidence as
ipywidgets; the plan table and its charts redraw as you move them.

The planner keeps no state of its own beyond its inputs: every change calls
kit.plan.budget again, so what you see is what write_plan will store.
"""

from __future__ import annotations

from typing import Any


class Planner:
    """Widgets over kit.plan.budget, which takes the same arguments: `budgets` the starting
    ones (a RunConfig's as they come), `throughput` the starting tokens/s (a pilot's
    Throughput is extrapolated to `concurrency` while the box shows its rate).

    Example:
        planner = Planner(config.budgets, pilot, prompts_available=frame, throughput=120.0)
        planner.widget        # display it in a cell
        planner.table         # the current plan (a polars frame)
    """

    def __init__(
        self,
        budgets,
        samples,
        *,
        prompts_available,
        throughput,
        max_tokens=None,
        sample_cap=None,
        concurrency=None,
    ):
        import ipywidgets as w

        # a Throughput is kept while the box shows its rate; a number typed in is the run's rate
        self._measured = throughput if hasattr(throughput, "tokens_per_s") else None
        rate = throughput.tokens_per_s if self._measured else throughput
        self._concurrency = concurrency
        self._samples = samples
        self._available = prompts_available
        self._max_tokens = max_tokens
        self._cap = sample_cap
        if not isinstance(budgets, dict):  # one number: every dataset the pilot measured
            budgets = dict.fromkeys(_datasets(samples), budgets)
        look = {"style": {"description_width": "140px"}, "layout": w.Layout(width="480px")}
        self.budget_inputs = {
            name: w.IntText(value=int(v), description=name, step=500, **look)
            for name, v in sorted(budgets.items())
        }
        self.throughput = w.FloatText(
            value=round(float(rate), 2), description="throughput tok/s", **look
        )
        self.confidence = w.FloatSlider(
            value=0.95, min=0.5, max=0.995, step=0.005, description="confidence", **look
        )
        self.output = w.Output()  # the plan table
        self.charts = [w.Output(), w.Output()]  # side by side where they fit, else stacked
        self.message = w.HTML()
        controls = [*self.budget_inputs.values(), self.throughput, self.confidence]
        for control in controls:
            control.observe(self._changed, names="value")
        title = w.HTML("<b>Token budget per dataset</b>")
        row = w.HBox(self.charts, layout=w.Layout(flex_flow="row wrap"))
        self.widget = w.VBox([title, *controls, self.message, self.output, row])
        self.table = self.compute()
        self._draw()

    @property
    def budgets(self) -> dict[str, int]:
        """dataset -> the budget currently entered."""
        return {name: int(box.value) for name, box in self.budget_inputs.items()}

    def compute(self):
        """kit.plan.budget over the current widget values."""
        from kit import plan

        throughput = self.throughput.value
        if self._measured is not None and throughput == round(self._measured.tokens_per_s, 2):
            throughput = self._measured
        return plan.budget(
            self.budgets,
            self._samples,
            prompts_available=self._available,
            throughput=throughput,
            max_tokens=self._max_tokens,
            confidence=self.confidence.value,
            sample_cap=self._cap,
            concurrency=self._concurrency,
        )

    def _changed(self, _change: Any) -> None:
        try:
            self.table = self.compute()
        except ValueError as exc:  # a bad value typed in: say so, keep the last good plan
            self.message.value = f"<span style='color:#b00'>{exc}</span>"
            return
        self.message.value = ""
        self._draw()

    def _draw(self) -> None:
        from IPython.display import HTML, display

        from kit.report import charts, tables

        self.output.clear_output(wait=True)
        with self.output:
            display(HTML(tables.html(summary_frame(self.table))))
        for out, chart in zip(
            self.charts, (charts.samples_needed, charts.budget_vs_cap), strict=True
        ):
            out.clear_output(wait=True)
            with out:
                display(chart(self.table))

    def summary(self) -> str:
        """The plan as plain text, for headless runs."""
        return summary_text(self.table)


def _datasets(samples) -> list[str]:
    """Dataset names of budget()'s samples: a PilotResult, a frame or a dict of lengths."""
    frame = getattr(samples, "frame", samples)
    if isinstance(frame, dict):
        return sorted(frame)
    return sorted(frame["dataset"].unique().to_list())


def summary_frame(table):
    """The plan in eight columns of text, one row a dataset (TOTAL last), its notes apart:
    "samples" is the estimate with its 90% interval, "cap" what the sample cap would give."""
    import polars as pl

    def num(v, fmt="{:,.0f}"):
        return "-" if v is None or v != v else fmt.format(v)

    rows = []
    for r in table.iter_rows(named=True):
        samples = num(r["samples_needed"])
        if r["samples_low"] is not None and r["samples_high"] is not None:
            samples += f" ({num(r['samples_low'])}-{num(r['samples_high'])})"
        elif r["samples_low"] is not None:  # no upper end: more than the prompts left
            samples += f" ({num(r['samples_low'])} or more)"
        hours = _duration(r["hours_to_go"])
        if r["hours_low"] is not None and r["hours_high"] is not None:
            hours += f" ({_duration(r['hours_low'])} to {_duration(r['hours_high'])})"
        cap = "-" if r["cap_tokens"] is None else f"{num(r['cap_tokens'])} (x{r['overshoot']:.2f})"
        rows.append(
            {
                "dataset": r["dataset"],
                "budget": num(r["budget"]),
                "mean": num(r["mean"]),
                "samples (90%)": samples,
                "upper": num(r["samples_needed_upper"]),
                "prompts": num(r["prompts_available"]),
                "time (90%)": hours,
                "cap tokens": cap,
            }
        )
    return pl.DataFrame(rows)


def _duration(hours) -> str:
    """Hours as a person reads them: "-", "<1 min", "42 min", "3.5 h"."""
    if hours is None or hours != hours:
        return "-"
    if hours * 60 < 1:
        return "<1 min"
    return f"{hours * 60:.0f} min" if hours < 1.5 else f"{hours:,.1f} h"


def summary_text(table) -> str:
    """A plan table as plain text for logs: every row, whole words, then one line per note."""
    import polars as pl

    frame = summary_frame(table)
    with pl.Config(
        tbl_rows=-1,
        tbl_cols=-1,
        tbl_width_chars=200,
        fmt_str_lengths=200,
        tbl_hide_dataframe_shape=True,
        tbl_hide_column_data_types=True,
        tbl_cell_alignment="RIGHT",
    ):
        text = str(frame)
    notes = [f"  {d}: {n}" for d, n in table.select("dataset", "note").iter_rows() if n]
    return text + ("\nnotes:\n" + "\n".join(notes) if notes else "")
