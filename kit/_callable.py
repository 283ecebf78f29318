"""Make a stage module callable, so `kit.audit(run_dir)` and `kit.audit.flags` both work.

Python sets `kit.<submodule>` to the module object whenever the submodule is imported,
so a function re-exported under the module's own name would be clobbered. Instead the
module itself becomes callable: call `make_callable(__name__, fn)` at the end of it.
"""

from __future__ import annotations

import sys
import types


def make_callable(module_name: str, fn) -> None:
    """Turn sys.modules[module_name] into a module whose call runs fn."""

    class _CallableModule(types.ModuleType):
        def __call__(self, *args, **kwargs):
            return fn(*args, **kwargs)

    sys.modules[module_name].__class__ = _CallableModule
