"""kit: prompt datasets -> drafter training data under per-dataset token budgets.

Re-exports only. The stages are subpackages, imports flowing one way:
types -> data, tokens -> run -> plan -> report; serve and cli on top
(tests/test_layout.py fails on a cycle or an upward import). Names load on first use,
so `import kit` imports no torch, transformers or polars.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

# public name -> "module:attribute" (attribute empty for a module)
_EXPORTS = {
    # stages
    "types": "kit.types:",
    "errors": "kit.errors:",
    "data": "kit.data:",
    "tokens": "kit.tokens:",
    "run": "kit.run:",
    "plan": "kit.plan:",
    "report": "kit.report:",
    "serve": "kit.serve:",
    # the job, as plain functions
    "load": "kit.data.sources:load",
    "generate": "kit.run.generate:generate",
    "generate_sync": "kit.run.generate:generate_sync",
    "resume": "kit.cli.commands:resume",
    "audit": "kit.report.audit:audit",
    "export": "kit.report.export:export",
    "validate": "kit.report.validate:validate",
    "watch": "kit.report.monitor:watch",
    # the shared types
    "RunConfig": "kit.types:RunConfig",
    "Sampling": "kit.types:Sampling",
    "Record": "kit.types:Record",
    "Completion": "kit.types:Completion",
    "Budget": "kit.types:Budget",
    "BackendError": "kit.errors:BackendError",
    "KitError": "kit.errors:KitError",
}

__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name: str):
    target = _EXPORTS.get(name)
    if target is None:
        raise AttributeError(f"module 'kit' has no attribute {name!r}")
    module_name, _, attr = target.partition(":")
    module = importlib.import_module(module_name)
    value = getattr(module, attr) if attr else module
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
