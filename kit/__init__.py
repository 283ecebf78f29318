"""kit: prompt datasets -> drafter training data under per-dataset token budgets.

Re-exports only. Attributes load on first use so `import kit` stays fast and never
imports torch or transformers.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

# public name -> "module:attribute" (attribute empty for a module)
_EXPORTS = {
    "types": "kit.types:",
    "sources": "kit.sources:",
    "tokens": "kit.tokens:",
    "plan": "kit.plan:",
    "backends": "kit.backends:",
    "store": "kit.store:",
    "monitor": "kit.monitor:",
    "audit": "kit.audit:",  # callable module: kit.audit(run_dir)
    "export": "kit.export:",
    "charts": "kit.charts:",
    "serve": "kit.serve:",
    "load": "kit.sources:load",
    "generate": "kit.generate:",  # callable module: await kit.generate(...)
    "generate_sync": "kit.generate:generate_sync",
    "watch": "kit.monitor:watch",
    "widgets": "kit.widgets:",
    "Sampling": "kit.types:Sampling",
    "Record": "kit.types:Record",
    "Completion": "kit.types:Completion",
    "Budget": "kit.types:Budget",
    "BackendError": "kit.types:BackendError",
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
