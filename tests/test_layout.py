"""The package's architecture, checked: subpackages by stage, imports flowing one way.

Every import of a kit module by a kit module (top-level or inside a function, not under
`if TYPE_CHECKING:`) is read from the source with `ast`; the graph must have no cycle and
no stage may import a stage above it. Each module must also import on its own.
"""

import ast
import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

KIT = Path(__file__).resolve().parent.parent / "kit"
# stage -> rank: a module may import modules of its own rank or lower
RANKS = {
    "errors": 0,
    "types": 0,
    "secrets": 0,
    "data": 1,
    "tokens": 1,
    "run": 2,
    "plan": 3,
    "report": 4,
    "serve": 5,
    "cli": 6,
}


def module_name(path: Path) -> str:
    parts = path.relative_to(KIT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def stage(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def kit_imports(path: Path) -> set[str]:
    """The kit modules a file imports, anywhere but under `if TYPE_CHECKING:`."""
    tree = ast.parse(path.read_text())
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(n) for n in ast.walk(node))
    found = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("kit."))
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "kit" or node.module.startswith("kit."):
                found.update(_imported(node.module, a.name) for a in node.names)
    return found


def _imported(package: str, name: str) -> str:
    """What `from package import name` imports: the module package.name when there is
    one (`from kit.run import progress` is kit.run.progress), else package itself."""
    path = KIT.parent.joinpath(*package.split("."), name)
    is_module = path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()
    return f"{package}.{name}" if is_module else package


def private_uses(path: Path) -> list[str]:
    """Another kit module's `_private` names this file imports or reads off an imported module
    (`from kit.x import _y`, `from kit import x` then `x._y`); dunders are public."""
    tree = ast.parse(path.read_text())
    modules, found = {}, []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "kit" or node.module.startswith("kit."):
                for a in node.names:
                    target = _imported(node.module, a.name)
                    if target != node.module:  # a module: its alias names it here
                        modules[a.asname or a.name] = target
                    elif a.name.startswith("_"):
                        found.append(f"{node.module}.{a.name}")
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            name, attr = node.value.id, node.attr
            if name in modules and attr.startswith("_") and not attr.startswith("__"):
                found.append(f"{modules[name]}.{attr}")
    return found


def graph() -> dict[str, set[str]]:
    return {module_name(p): kit_imports(p) for p in sorted(KIT.rglob("*.py"))}


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a list of modules, or None (depth-first search)."""
    state: dict[str, int] = {}  # 1 on the stack, 2 done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if nxt not in edges:
                continue
            if state.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(edges):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_find_cycle_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_from_a_package_import_a_module_is_that_module(tmp_path):
    path = tmp_path / "m.py"
    path.write_text(
        "from kit.run import progress, db\n"
        "from kit.run.reader import totals\n"
        "from kit.serve import models_root\n"
        "def f():\n    from kit import plan, load\n"
    )
    assert kit_imports(path) == {
        "kit.run.progress",
        "kit.run.db",
        "kit.run.reader",
        "kit.serve",
        "kit.plan",
        "kit",
    }


def test_private_uses_are_found(tmp_path):
    path = tmp_path / "m.py"
    path.write_text(
        "from kit.run.queues import Stall, _Dataset\n"
        "from kit.run import guard as _guard\n"
        "_guard.check(1)\n_guard._cache\n_guard.__name__\n"
    )
    assert private_uses(path) == ["kit.run.queues._Dataset", "kit.run.guard._cache"]


def test_no_module_uses_another_modules_private_names():
    uses = {module_name(p): u for p in sorted(KIT.rglob("*.py")) if (u := private_uses(p))}
    assert uses == {}


def test_no_import_cycle():
    assert find_cycle(graph()) is None


def test_imports_flow_one_way():
    upward = []
    for module, imports in graph().items():
        here = stage(module)
        if here is None:  # kit/__init__.py: lazy re-exports only
            continue
        for target in imports:
            there = stage(target)
            if there is not None and RANKS[there] > RANKS[here]:
                upward.append(f"{module} -> {target}")
    assert upward == []


def test_every_module_has_a_stage():
    for path in KIT.rglob("*.py"):
        name = module_name(path)
        assert name == "kit" or stage(name) in RANKS, name


def test_the_formatter_owns_layout():
    """No line opts out of `ruff format` (its size follows its concept, not a cap)."""
    root = KIT.parent
    opt_out = re.compile(r"#\s*fmt:\s*(skip|off)")
    found = [
        f"{p.relative_to(root)}:{i}"
        for d in ("kit", "tests", "bench")
        for p in sorted((root / d).rglob("*.py"))
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if opt_out.search(line)
    ]
    assert found == []


@pytest.mark.parametrize("module", sorted(m for m in graph() if m != "kit"))
def test_module_imports_alone(module):
    subprocess.run([sys.executable, "-c", f"import {module}"], check=True, timeout=120)
    importlib.import_module(module)


# Record column lists written out at this commit in modules other helpers of issue 33 own:
# (module, the record columns it names). Each goes once derived from kit.types.record_columns.
WRITTEN_OUT_ELSEWHERE = {
    (  # not a record: one earlier turn of Record.turns
        "kit/run/turns.py",
        "completion_tokens count_source finish_reason output_ids prompt_ids reasoning tool_calls",
    ),
}


def record_column_lists(tree: ast.AST, columns: set[str]) -> list[str]:
    """The record columns each list, tuple or set literal or dict's keys name (four or more),
    and each one-line string naming six or more (a SQL column list), as sorted joined names."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.List, ast.Tuple, ast.Set, ast.Dict)):
            elts = node.keys if isinstance(node, ast.Dict) else node.elts
            names = {e.value for e in elts if isinstance(e, ast.Constant)} & columns
            found += [" ".join(sorted(names))] if len(names) >= 4 else []
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            words = set(re.findall(r"\w+", node.value)) & columns
            one_line = "\n" not in node.value.strip()  # a migration's script is history
            found += [" ".join(sorted(words))] if len(words) >= 6 and one_line else []
    return found


def test_the_record_columns_are_written_out_once():
    """kit.types.Record declares the record's columns; everything else derives them (a
    subset by kit.types.record_columns' filters or its checked names), never lists them."""
    from dataclasses import fields

    from kit.types import Record

    columns = {f.name for f in fields(Record)}
    root = KIT.parent
    found = {
        (str(p.relative_to(root)), names)
        for p in sorted(KIT.rglob("*.py"))
        if p != KIT / "types.py"
        for names in record_column_lists(ast.parse(p.read_text()), columns)
    }
    assert found <= WRITTEN_OUT_ELSEWHERE, sorted(found - WRITTEN_OUT_ELSEWHERE)
    planted = ast.parse('COLS = ["dataset", "prompt_id", "sample", "completion"]\nX = ("a", "b")')
    assert record_column_lists(planted, columns) == ["completion dataset prompt_id sample"]
    sql = ast.parse(f'"INSERT INTO records ({", ".join(sorted(columns)[:6])}) VALUES"')
    assert len(record_column_lists(sql, columns)) == 1


# builtins kit may raise: protocols, not errors of kit
PROTOCOL_RAISES = {"SystemExit", "KeyboardInterrupt", "NotImplementedError"}


def test_every_exception_kit_raises_is_under_the_base():
    """kit raises only kit.errors classes on purpose (a bare `raise`, a re-raise and a
    module __getattr__'s AttributeError aside), and defines exception classes only there."""
    import builtins

    names = {n for n in dir(builtins) if isinstance(getattr(builtins, n), type)}
    errors = {n for n in names if issubclass(getattr(builtins, n), BaseException)}
    raised, strays = [], []
    for path in sorted(KIT.rglob("*.py")):
        where = path.relative_to(KIT.parent)
        tree = ast.parse(path.read_text())
        getattrs = {
            id(n)
            for f in ast.walk(tree)
            if isinstance(f, ast.FunctionDef) and f.name == "__getattr__"
            for n in ast.walk(f)
        }
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and where.name != "errors.py":
                if any(isinstance(b, ast.Name) and b.id in errors for b in node.bases):
                    strays.append(f"{where}:{node.lineno} class {node.name}")
            if not isinstance(node, ast.Raise) or node.exc is None or id(node) in getattrs:
                continue
            exc = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
            if isinstance(exc, ast.Name) and exc.id in errors - PROTOCOL_RAISES:
                raised.append(f"{where}:{node.lineno} raise {exc.id}")
    assert raised == [], "raise a kit.errors class instead (errors_codemod.py maps them)"
    assert strays == [], "define exception classes in kit/errors.py, under KitError"


def test_the_readme_maps_every_module_and_no_other():
    """README.md's module map names each kit module (the CLI and the stage packages' docstrings
    in one row each), and every `kit/....py` it names exists."""
    text = (KIT.parent / "README.md").read_text()
    missing = []
    for path in sorted(KIT.rglob("*.py")):
        rel = path.relative_to(KIT.parent).as_posix()
        grouped = (rel.startswith("kit/cli/") and "`kit/cli/`" in text) or (
            rel.endswith("/__init__.py")
            and "`kit/{data,run,plan,report,serve}/__init__.py`" in text
        )
        if f"`{rel}`" not in text and not grouped:
            missing.append(rel)
    stale = [p for p in re.findall(r"`(kit/[\w/]+\.py)`", text) if not (KIT.parent / p).is_file()]
    assert (missing, stale) == ([], [])
