"""The four notebooks: committed clean (a parameters cell first, no outputs), and executed
cold, in order, against one embedded server with papermill-style injected parameters
(kit.cli.demo.run_notebooks, what `kit demo` runs)."""

from __future__ import annotations

import ast
import copy
import re
from pathlib import Path

import nbformat
import pytest

from kit.cli import demo
from kit.plan import read_plan
from kit.run.reader import read_config, records_frame

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("name", demo.NOTEBOOKS)
def test_committed_clean_with_a_parameters_cell_first(name):
    nb = nbformat.read(REPO / "notebooks" / f"{name}.ipynb", as_version=4)
    nbformat.validate(nb)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(c.outputs == [] and c.execution_count is None for c in code), "outputs not cleared"
    tagged = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
    assert len(tagged) == 1 and tagged[0] is code[0], "one parameters cell, the first code cell"
    body = ast.parse(code[0].source).body
    assert body and all(isinstance(node, ast.Assign) for node in body), "parameters: assignments"
    assert "run_dir" in demo.notebook_parameters(nb)
    assert not any("injected-parameters" in c.metadata.get("tags", []) for c in nb.cells)
    assert "os.environ" not in "".join(c.source for c in code), "parameters come from the cell"


@pytest.mark.server
@pytest.mark.slow
def test_notebooks_run_cold_in_order(embedded_server, tmp_path):
    """01 -> 04 each in a fresh kernel; they hand over only through the run directory."""
    run_dir = tmp_path / "run"
    budgets = {"chat_general": 150, "essays": 200}
    parameters = {
        "run_dir": run_dir,
        "data": [REPO / "data/samples/chat_general.jsonl", REPO / "data/samples/essays.parquet"],
        "budgets": budgets,
        "max_tokens": 32,
        "pilot_per_dataset": 3,
        "concurrency": 8,
        "base_url": embedded_server.base_url,
        "model": embedded_server.model,
        "tokenizer": str(embedded_server.model_dir),
    }
    parameters["data"] = [str(p) for p in parameters["data"]]
    executed = demo.run_notebooks(run_dir, parameters)

    for name in demo.NOTEBOOKS:
        nb = nbformat.read(executed / f"{name}.ipynb", as_version=4)
        errors = [o for c in nb.cells for o in c.get("outputs", []) if o.output_type == "error"]
        assert not errors, f"{name}: {errors[0]}"
    plan = read_plan(run_dir)
    assert plan["budgets"] == budgets and plan["config"].sampling.max_tokens == 32
    assert read_config(run_dir).endpoints == [embedded_server.base_url]
    records = records_frame(run_dir, prompts=False)
    assert records["completion_tokens"].sum() >= sum(budgets.values())
    assert (run_dir / "export" / "manifest.json").is_file()
    assert embedded_server.alive(), "a notebook stopped the shared server"
    # a headless run keeps the numbers: the monitor's plain-text table under its bars, and
    # the validation's summary, not an object dump
    text = {
        name: "".join(
            o.get("text", "")
            for c in nbformat.read(executed / f"{name}.ipynb", as_version=4).cells
            for o in c.get("outputs", [])
            if o.output_type == "stream"
        )
        for name in ("01_plan", "02_generate", "04_export")
    }
    # the pilot's monitor, left as text under its bars: every request of both datasets done
    bar = re.compile(rf"^({'|'.join(budgets)}) +\[[#.]+\] ", re.M)
    pilot_rows = [line for line in text["01_plan"].splitlines() if bar.match(line)]
    assert len(pilot_rows) == 2 and all(" 100% " in r and " 3/3 " in r for r in pilot_rows), text
    assert all(f"{d} " in text["02_generate"] for d in budgets), text["02_generate"]
    assert "budget_reached" in text["02_generate"] and "the run is complete" in text["02_generate"]
    assert ": OK" in text["04_export"] and "ValidationResult(" not in text["04_export"]


def test_kit_lab_saves_notebooks_without_outputs(tmp_path, monkeypatch):
    """Jupyter's own contents manager, with the hook `kit lab` configures: a notebook saved
    into notebooks/ loses its outputs, counts and widget state; one saved elsewhere keeps
    them; `kit lab` runs JupyterLab rooted there with that hook."""
    from jupyter_server.services.contents.filemanager import FileContentsManager

    from kit import cli
    from kit.cli import lab

    (tmp_path / "notebooks").mkdir()
    (tmp_path / "scratch").mkdir()
    monkeypatch.setattr(lab, "NOTEBOOKS", tmp_path / "notebooks")
    cell = nbformat.v4.new_code_cell("1 + 1", execution_count=3)
    cell.outputs = [
        nbformat.v4.new_output("execute_result", {"text/plain": "2"}, execution_count=3)
    ]
    cell.metadata["execution"] = {"iopub.status.idle": "2026-12-07T20:00:00Z"}
    nb = nbformat.v4.new_notebook(cells=[cell], metadata={"widgets": {"state": {}}})
    manager = FileContentsManager(root_dir=str(tmp_path), pre_save_hook=lab.HOOK)
    for where in ("notebooks/a.ipynb", "scratch/a.ipynb"):
        manager.save({"type": "notebook", "format": "json", "content": copy.deepcopy(nb)}, where)
    clean = nbformat.read(tmp_path / "notebooks/a.ipynb", as_version=4)
    kept = nbformat.read(tmp_path / "scratch/a.ipynb", as_version=4)
    assert clean.cells[0].outputs == [] and clean.cells[0].execution_count is None
    assert "execution" not in clean.cells[0].metadata and "widgets" not in clean.metadata
    assert clean.cells[0].source == "1 + 1"
    assert kept.cells[0].outputs[0]["data"] == {"text/plain": "2"} and "widgets" in kept.metadata
    ran = []
    monkeypatch.setattr(lab.os, "execv", lambda exe, argv: ran.append(argv))
    assert cli.main(["lab", "--", "--no-browser"]) == 0
    assert ran[0][1:3] == ["-m", "jupyterlab"] and ran[0][-1] == "--no-browser"
    assert f"--ContentsManager.pre_save_hook={lab.HOOK}" in ran[0]
    assert f"--notebook-dir={tmp_path / 'notebooks'}" in ran[0]
