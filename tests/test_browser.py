"""The four notebooks as people use them: JupyterLab in headless Chromium, Run All Cells.

One JupyterLab serves copies of the notebooks with their parameters injected the way
papermill does (a cell tagged `injected-parameters` after the `parameters` cell; what
`kit demo` does): one server and one run directory (../data/runs/demo beside the copies)
for 01 -> 04. The test asserts what a person sees: planner widgets that answer a typed
budget, monitor bars that move and end full, charts with drawn marks, no error output.

In the test suite the run is small (the session's `transformers serve`, max_tokens 32).
With $KIT_SCREENSHOTS (`make screenshots`: docs/img) it is the demo's own run instead:
`kit demo`'s parameters and engine (vLLM), its budgets typed into the planner, and the
screenshots go there (else to a temp dir).

Needs /usr/bin/chromium (`make browser`) and the `playwright` package (dev extra).
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

import nbformat
import pytest
from browser_helpers import (
    JupyterLab,
    NotebookPage,
    chromium_missing_message,
    drawn_charts,
    launch_chromium,
    overruns,
)

from kit.cli.demo import DEMO_BUDGETS, DEMO_PARAMETERS, NOTEBOOKS, parameterized
from kit.plan import read_plan

pytestmark = [pytest.mark.browser, pytest.mark.server, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[1]
SCREENSHOTS = os.environ.get("KIT_SCREENSHOTS")  # the pictures: the demo's own run
if SCREENSHOTS:
    # the demo's parameters; the planner starts at a small budget and the demo's are typed
    NOTEBOOK_PARAMETERS = {**DEMO_PARAMETERS, "budgets": 500}
    TYPED_BUDGETS = DEMO_BUDGETS
    CELL_TIMEOUT = 1800  # the demo's pilot and run, on a loaded 2-core machine
else:
    # small on purpose: 8 datasets x (2 pilot prompts + ~3 samples) x <= 32 tokens
    NOTEBOOK_PARAMETERS = {"max_tokens": 32, "pilot_per_dataset": 2, "concurrency": 8}
    TYPED_BUDGETS = dict.fromkeys(DEMO_BUDGETS, 96)  # typed into the planner's IntText boxes
    CELL_TIMEOUT = 420  # seconds for one notebook's Run All on a loaded 2-core machine


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("lab")


@pytest.fixture(scope="module")
def run_dir(root) -> Path:
    return root / "data" / "runs" / "demo"  # "../data/runs/demo" from the notebooks


@pytest.fixture(scope="module")
def server(request):
    """The demo's engine (vLLM) for the pictures, the session's light server otherwise."""
    return request.getfixturevalue("vllm_server" if SCREENSHOTS else "embedded_server")


@pytest.fixture(scope="module")
def lab(server, root, free_port, tmp_path_factory):
    """JupyterLab on parameterized copies of the notebooks: one server, one run dir."""
    parameters = {
        **NOTEBOOK_PARAMETERS,
        "run_dir": "../data/runs/demo",
        "data": str(REPO / "data" / "samples"),
        "base_url": server.base_url,
        "api": server.api,
        "model": server.model,
        "tokenizer": str(server.model_dir),
    }
    (root / "notebooks").mkdir()
    for name in NOTEBOOKS:
        nbformat.write(parameterized(name, parameters), root / "notebooks" / f"{name}.ipynb")
    committed = {p: p.read_bytes() for p in (REPO / "notebooks").glob("*.ipynb")}
    env = {"HF_HUB_OFFLINE": "1"}
    jupyter = JupyterLab(root, tmp_path_factory.mktemp("jupyter"), free_port(), env)
    try:
        jupyter.wait_ready()
        yield jupyter
    finally:
        jupyter.stop()
    changed = [p.name for p, data in committed.items() if p.read_bytes() != data]
    assert not changed, f"the browser session wrote into committed notebooks: {changed}"


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    """Headless Debian Chromium on a fresh profile; fails (never skips) when it is missing."""
    missing = chromium_missing_message()
    if missing:
        pytest.fail(missing)
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        context = launch_chromium(playwright, tmp_path_factory.mktemp("chromium-profile"))
        try:
            yield context
        finally:
            context.close()


@pytest.fixture(scope="module")
def shots(tmp_path_factory) -> Path:
    """Where screenshots go: $KIT_SCREENSHOTS (relative to the repo) or a temp dir."""
    target = os.environ.get("KIT_SCREENSHOTS")
    return REPO / target if target else tmp_path_factory.mktemp("screenshots")


def run_notebook(browser, lab, name: str, poll=None) -> NotebookPage:
    """Open notebooks/<name>.ipynb, Run All Cells, wait for every execution count."""
    page = browser.new_page()
    nb = NotebookPage(page, lab, f"notebooks/{name}.ipynb")
    nb.open()
    nb.run_all()
    nb.wait_all_run(CELL_TIMEOUT, poll=poll)
    assert nb.errors() == [], f"{name}: error output shown:\n{nb.errors()[0]}"
    return nb


def assert_charts_drawn(nb: NotebookPage, at_least: int) -> list[dict]:
    """At least `at_least` vega-embed charts, each with drawn marks (svg marks or inked canvas),
    no bar or label past its plot and no chart cut by the box it is drawn in."""
    deadline = time.monotonic() + 60
    while True:
        charts = drawn_charts(nb.notebook)
        drawn = [c for c in charts if c["marks"] > 0 or c["inked"] > 0]
        if len(drawn) >= at_least and len(drawn) == len(charts):
            past = overruns(nb.notebook)
            assert not past, f"{nb.path}: drawn past its chart or cut: {past}"
            return charts
        if time.monotonic() > deadline:
            raise AssertionError(f"{nb.path}: want {at_least} drawn charts, saw {charts}")
        time.sleep(1)


def finish(nb: NotebookPage) -> None:
    """Shut the notebook's kernel down and close its tab (unsaved: nothing reaches disk)."""
    nb.lab.shutdown_kernels()
    nb.page.close()


def test_notebooks_in_jupyterlab(lab, browser, shots, run_dir, server):
    """01 -> 04 in JupyterLab, as a person runs them, against one embedded server."""
    check_plan(run_notebook(browser, lab, "01_plan"), run_dir, shots)
    check_generate(browser, lab, run_dir, shots)
    check_audit(run_notebook(browser, lab, "03_audit"), shots)
    check_export(run_notebook(browser, lab, "04_export"), run_dir, shots)
    assert server.alive(), "a notebook stopped the shared server"


# ----------------------------------------------------------------------------- 01 plan


PLAN_TABLE_JS = """(root) => {
  const table = root.querySelector('table');
  if (!table) return null;
  const head = Array.from(table.querySelectorAll('thead tr:first-child th')).map(th => th.innerText.trim());
  const rows = Array.from(table.querySelectorAll('tbody tr')).map(
    tr => Array.from(tr.querySelectorAll('td')).map(td => td.innerText.trim()));
  return rows.map(r => Object.fromEntries(head.map((h, i) => [h, r[i]])));
}"""


def planner_table(nb: NotebookPage) -> dict[str, dict]:
    """dataset -> row of the plan table shown under the planner widgets."""
    rows = nb.page.locator(".jp-NotebookPanel .widget-output").first.evaluate(PLAN_TABLE_JS)
    assert rows, f"{nb.path}: no plan table under the planner widgets"
    quoted = [v for row in rows for v in row.values() if v.startswith('"')]
    assert not quoted, f"plan table cells shown in quotes: {quoted[:3]}"
    return {row["dataset"]: row for row in rows}


def budget_box(nb: NotebookPage, dataset: str):
    """The planner's IntText input for one dataset."""
    label = nb.page.locator("label.widget-label", has_text=re.compile(f"^{dataset}$"))
    return nb.page.locator(".jp-NotebookPanel .widget-text", has=label).locator("input")


def wait_table(nb: NotebookPage, dataset: str, budget: int, timeout: float = 60) -> dict:
    """Poll the shown plan table until the dataset's row says `budget`."""
    deadline = time.monotonic() + timeout
    while True:
        row = planner_table(nb).get(dataset, {})
        shown = row.get("budget", "").replace(",", "")
        if re.fullmatch(r"[\d.]+", shown) and float(shown) == budget:
            return row
        if time.monotonic() > deadline:
            raise AssertionError(f"plan table did not follow the typed budget {budget}: {row}")
        time.sleep(0.5)


def check_plan(nb: NotebookPage, run_dir: Path, shots: Path) -> None:
    """Widgets answer a typed budget; charts drawn; the re-run write cell stores it."""
    assert_charts_drawn(nb, at_least=4)  # prompt lengths, pilot lengths, the planner's two
    before = planner_table(nb)
    datasets = [name for name in before if name.lower() != "total"]
    assert len(datasets) >= 2, f"plan table rows: {list(before)}"
    for name in datasets:  # type each dataset's budget, as a person plans
        box = budget_box(nb, name)
        box.fill(str(TYPED_BUDGETS[name]))
        box.press("Enter")
        after = wait_table(nb, name, TYPED_BUDGETS[name])
        assert after != before[name], f"{name}: plan row unchanged after typing a budget"
    assert_charts_drawn(nb, at_least=4)  # the planner's charts were redrawn, not lost
    nb.screenshot(shots / "01_plan.png", cell_index=planner_cell(nb))
    rerun_last_cell(nb)
    plan = read_plan(run_dir)
    assert plan["budgets"] == {name: TYPED_BUDGETS[name] for name in datasets}
    finish(nb)


def planner_cell(nb: NotebookPage) -> int:
    """Index of the code cell whose output holds the planner widgets."""
    return nb.page.evaluate(
        """() => Array.from(document.querySelectorAll('.jp-NotebookPanel .jp-CodeCell'))
                 .findIndex(c => c.querySelector('.widget-text'))"""
    )


def rerun_last_cell(nb: NotebookPage) -> None:
    """Click into the last code cell and run it (Ctrl+Enter), as a person re-writes the plan."""
    last = nb.page.locator(".jp-NotebookPanel .jp-CodeCell").last
    count = nb.prompts()[-1]

    def ran() -> bool:
        now = nb.prompts()[-1]
        return now == "*" or (now.isdigit() and now != count)

    for _ in range(3):  # a click can land while the planner's redraw moves the layout
        last.locator(".jp-InputArea-editor").click()
        nb.page.keyboard.press("Control+Enter")
        deadline = time.monotonic() + 10
        while not ran() and time.monotonic() < deadline:
            time.sleep(0.5)
        if ran():
            break
    assert ran(), "the write-plan cell did not run again"
    nb.wait_all_run(120)
    assert nb.errors() == [], f"write-plan cell failed:\n{nb.errors()[0]}"


# ------------------------------------------------------------------------- 02 generate


BARS_BY_CELL_JS = """() => {
  const out = {};
  document.querySelectorAll('.jp-NotebookPanel .jp-CodeCell').forEach((cell, i) => {
    const bars = Array.from(cell.querySelectorAll('.widget-hprogress')).map(el => {
      const bar = el.querySelector('.progress-bar');
      const track = bar && bar.parentElement;
      const name = el.previousElementSibling;  // the monitor's grid: name, bar, numbers
      return {
        label: ((name && name.innerText) || '').trim(),
        cut: !!name && name.scrollWidth > name.clientWidth,  // an ellipsis hides the rest
        past: el.getBoundingClientRect().right > cell.getBoundingClientRect().right,
        fraction: track && track.clientWidth ? bar.clientWidth / track.clientWidth : 0,
        success: !!bar && bar.classList.contains('progress-bar-success'),
      };
    });
    const text = Array.from(cell.querySelectorAll('.widget-html')).map(h => h.innerText).join('\\n');
    if (bars.length) out[i] = {bars, text};
  });
  return out;
}"""


def check_generate(browser, lab, run_dir: Path, shots: Path) -> None:
    """The monitor's bars move while the run goes and end full at the budget."""
    samples: list[dict] = []  # per poll: cell index -> {"bars": [...], "text": str}
    page_box: dict = {}

    def sample() -> None:
        if "nb" in page_box:
            samples.append(page_box["nb"].page.evaluate(BARS_BY_CELL_JS))

    page = browser.new_page()
    nb = NotebookPage(page, lab, "notebooks/02_generate.ipynb")
    page_box["nb"] = nb
    nb.open()
    nb.run_all()
    nb.wait_all_run(CELL_TIMEOUT, poll=sample, interval=1.0)
    assert nb.errors() == [], f"02_generate: error output shown:\n{nb.errors()[0]}"

    totals = [sum(b["fraction"] for s in snap.values() for b in s["bars"]) for snap in samples]
    rising = [b for a, b in zip(totals, totals[1:], strict=False) if b > a + 1e-6]
    assert len(rising) >= 2, f"progress bars did not move during generation: {totals}"

    final = nb.page.evaluate(BARS_BY_CELL_JS)
    assert len(final) == 1, f"want one monitor, under the run cell: {final}"
    last_cell = max(final, key=int)
    bars = final[last_cell]["bars"]
    plan = read_plan(run_dir)
    assert sorted(b["label"] for b in bars) == sorted(plan["budgets"])  # whole names ...
    assert not [b for b in bars if b["cut"] or b["past"]], bars  # ... none cut, inside the cell
    assert all(b["fraction"] > 0.99 and b["success"] for b in bars), bars
    assert "budget_reached" in final[last_cell]["text"], final[last_cell]["text"]
    nb.screenshot(shots / "02_generate.png", cell_index=int(last_cell))
    finish(nb)


# --------------------------------------------------------------------- 03 audit, 04 export


def check_audit(nb: NotebookPage, shots: Path) -> None:
    """Every chart cell draws marks."""
    charts = assert_charts_drawn(nb, at_least=5)
    assert all(c["width"] > 100 for c in charts), charts
    first_chart = nb.page.evaluate(
        """() => Array.from(document.querySelectorAll('.jp-NotebookPanel .jp-CodeCell'))
                 .findIndex(c => c.querySelector('.vega-embed'))"""
    )
    nb.screenshot(shots / "03_audit.png", cell_index=first_chart)
    finish(nb)


def check_export(nb: NotebookPage, run_dir: Path, shots: Path) -> None:
    """The export is written and validated; the printed results show."""
    out = run_dir / "export"
    assert (out / "manifest.json").is_file(), f"no manifest in {out}"
    text = nb.notebook.inner_text()
    assert "ok" in text.lower(), text[-2000:]
    nb.screenshot(shots / "04_export.png", cell_index=0)
    finish(nb)
