"""Pins the public surface of `kit` (httpx test_exported_members style)."""

import inspect
import subprocess
import sys

import kit

EXPECTED = [
    "BackendError",
    "Budget",
    "Completion",
    "KitError",
    "Record",
    "RunConfig",
    "Sampling",
    "__version__",
    "audit",
    "data",
    "errors",
    "export",
    "generate",
    "generate_sync",
    "load",
    "plan",
    "report",
    "resume",
    "run",
    "serve",
    "tokens",
    "types",
    "validate",
    "watch",
]


def test_all_is_pinned():
    assert sorted(kit.__all__) == EXPECTED


def test_every_export_resolves_to_what_it_names():
    for name in kit.__all__:
        if name == "__version__":
            continue
        value = getattr(kit, name)
        assert inspect.ismodule(value) or callable(value), name
    assert inspect.ismodule(kit.plan) and inspect.ismodule(kit.run)


def test_stage_functions_are_plain_functions_with_real_signatures():
    for name in ("generate", "audit", "export", "validate", "load", "watch"):
        fn = getattr(kit, name)
        assert inspect.isfunction(fn) or inspect.iscoroutinefunction(fn), name
        params = inspect.signature(fn).parameters
        assert not any(p.kind is p.VAR_KEYWORD for p in params.values()), name
        assert fn.__doc__ and "Args:" in fn.__doc__, f"{name} lacks an Args: section"
    assert list(inspect.signature(kit.generate).parameters)[:2] == ["prompts", "config"]
    assert "run_dir" in inspect.signature(kit.audit).parameters


def test_importing_the_stage_modules_keeps_the_functions():
    import kit.report.audit  # noqa: F401
    import kit.report.export  # noqa: F401
    import kit.run.generate  # noqa: F401

    assert inspect.isfunction(kit.audit) and inspect.iscoroutinefunction(kit.generate)
    assert kit.plan.budget.__module__ == "kit.plan.estimate"
    assert kit.plan.pilot.__module__ == "kit.plan.pilots"


def test_import_is_light():
    code = "import sys, kit; print(sorted(m for m in ('torch', 'transformers', 'polars', 'altair', 'ipywidgets', 'aiohttp') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
