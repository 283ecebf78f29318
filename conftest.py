"""Doctests: `pytest` runs every `>>>` example in kit/ (`--doctest-modules`, pyproject.toml).

Each example runs from the repository root, so paths like "data/samples/..." work, with
`pl` (polars) and `kit` in its namespace. An example that names `tok` gets the prepared
embedded model's tokenizer, one that names `model_dir` its folder (prepared once, ~20 s
the first time; tests/conftest.py has the same model as the `model_dir` fixture).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent
os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(autouse=True)
def _doctest_context(request):
    """For a doctest item only: cwd = the repository root and the names its examples use."""
    dtest = getattr(request.node, "dtest", None)  # set on pytest's DoctestItem
    if dtest is None:
        return
    request.getfixturevalue("monkeypatch").chdir(ROOT)
    names = {n for ex in dtest.examples for n in re.findall(r"[A-Za-z_]\w*", ex.source)}
    namespace = request.getfixturevalue("doctest_namespace")
    namespace.update(_namespace(names))


def _namespace(names: set[str]) -> dict:
    import polars as pl

    import kit

    out = {"pl": pl, "kit": kit}
    if names & {"tok", "model_dir"}:
        from kit.serve import prepare_model

        out["model_dir"] = prepare_model()
    if "tok" in names:
        from kit.tokens import load_tokenizer

        out["tok"] = load_tokenizer(out["model_dir"])
    return out
