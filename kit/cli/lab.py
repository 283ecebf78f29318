"""`kit lab`: JupyterLab on the repository's notebooks, which it saves without outputs.

The committed notebooks stay clean (tests/test_notebooks.py) with no per-clone git config:
the Jupyter server started here runs `strip_outputs` before every save, so a notebook under
notebooks/ reaches the disk with its cells' outputs and execution counts cleared while the
open page keeps showing them. A notebook saved elsewhere keeps its outputs.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from kit.errors import UsageError

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"
HOOK = f"{__name__}.strip_outputs"


def strip_outputs(model: dict, path: str, contents_manager, **_) -> None:
    """Jupyter's pre_save_hook: a notebook saved into NOTEBOOKS loses its outputs, execution
    counts and saved widget state (the model is changed in place, as Jupyter asks)."""
    if model.get("type") != "notebook" or not isinstance(model.get("content"), dict):
        return
    where = Path(contents_manager.root_dir, path.lstrip("/")).resolve()
    if where.parent != NOTEBOOKS.resolve():
        return
    content = model["content"]
    content.get("metadata", {}).pop("widgets", None)
    for cell in content.get("cells", []):
        cell.get("metadata", {}).pop("execution", None)
        if cell.get("cell_type") == "code":
            cell["outputs"], cell["execution_count"] = [], None


def command(jupyter_args: list[str]) -> list[str]:
    """The JupyterLab command line: this interpreter's, rooted at NOTEBOOKS, with the hook."""
    hook = f"--ContentsManager.pre_save_hook={HOOK}"
    return [sys.executable, "-m", "jupyterlab", f"--notebook-dir={NOTEBOOKS}", hook, *jupyter_args]


def cmd_lab(args) -> int:
    """Replace this process with JupyterLab (Ctrl-C there stops it)."""
    given = args.jupyter_args
    if given and given[0] != "--":
        raise UsageError(f"JupyterLab's options go after `--`: kit lab -- {' '.join(given)}")
    argv = command(given[1:])
    print(f"kit lab: notebooks in {NOTEBOOKS} are saved without outputs", file=sys.stderr)
    os.execv(argv[0], argv)
    return 0  # not reached
