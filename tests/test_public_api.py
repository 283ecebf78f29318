"""Pins the public surface of `kit` (httpx test_exported_members style)."""

import importlib
import subprocess
import sys

import kit

EXPECTED = [
    "BackendError",
    "Budget",
    "Completion",
    "Record",
    "Sampling",
    "__version__",
    "audit",
    "backends",
    "charts",
    "export",
    "generate",
    "generate_sync",
    "load",
    "monitor",
    "plan",
    "serve",
    "sources",
    "store",
    "tokens",
    "types",
    "watch",
    "widgets",
]


def test_all_is_pinned():
    assert sorted(kit.__all__) == EXPECTED


def test_every_export_resolves():
    for name in kit.__all__:
        assert getattr(kit, name) is not None, name


def test_callable_stage_modules():
    assert callable(kit.generate) and callable(kit.audit)
    importlib.import_module("kit.audit")  # importing the submodule must not clobber the callable

    assert callable(kit.audit)


def test_import_is_light():
    code = "import sys, kit; print(sorted(m for m in ('torch', 'transformers', 'polars', 'altair', 'ipywidgets') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
