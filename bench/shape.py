"""The shape of kit/, measured: the targets of issue 33 (one shape), with PASS/FAIL.

    python bench/shape.py

Prints: opt-outs of the formatter, `ruff format --check`, kit/'s lines as formatted (target
<= 14,000), function lengths (median, p90), the modules that write out a list of record
columns (target: one), the exception classes kit defines outside one tree and the builtin
exceptions it raises on purpose (target: none), kit/'s modules over 500 lines (no cap, shown
for scale). Exits 1 when a target fails.
"""

from __future__ import annotations

import ast
import builtins
import dataclasses
import re
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
KIT = ROOT / "kit"
BUILTIN_ERRORS = {
    n for n in dir(builtins) if isinstance(getattr(builtins, n), type) and n.endswith("Error")
} | {"Exception"}
PROTOCOL = {"NotImplementedError"}  # an abstract method's raise: Python's protocol, not kit's
OPT_OUT = re.compile(r"#\s*fmt:\s*(skip|off)")


def sources(*dirs: str) -> list[Path]:
    return sorted(p for d in dirs for p in (ROOT / d).rglob("*.py"))


def record_columns() -> set[str]:
    sys.path.insert(0, str(ROOT))
    from kit.types import Record

    return {f.name for f in dataclasses.fields(Record)}


def column_lists(tree: ast.AST, columns: set[str]) -> int:
    """Literal lists/tuples/sets in a module naming four or more record columns."""
    found = 0
    for node in ast.walk(tree):
        if isinstance(node, (ast.List, ast.Tuple, ast.Set)):
            names = {e.value for e in node.elts if isinstance(e, ast.Constant)}
            found += len(names & columns) >= 4
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            words = set(node.value.replace(",", " ").split())
            found += len(words & columns) >= 6 and "\n" not in node.value.strip()
    return found


def exceptions(tree: ast.AST) -> tuple[list[str], list[str]]:
    """(classes deriving from a builtin exception, builtin exceptions raised by name)."""
    classes, raised = [], []
    getattrs = [n for n in ast.walk(tree) if getattr(n, "name", "") == "__getattr__"]
    protocol = {id(r) for f in getattrs for r in ast.walk(f) if isinstance(r, ast.Raise)}
    for node in ast.walk(tree):
        if id(node) in protocol:  # a module's __getattr__ raises AttributeError by protocol
            continue
        if isinstance(node, ast.ClassDef):
            bases = {b.id for b in node.bases if isinstance(b, ast.Name)}
            if bases and bases <= BUILTIN_ERRORS and node.name != "KitError":
                classes.append(node.name)
        elif isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call):
            func = node.exc.func
            if isinstance(func, ast.Name) and func.id in BUILTIN_ERRORS - PROTOCOL:
                raised.append(func.id)
    return classes, raised


def main() -> int:
    failed = []

    def target(name: str, ok: bool, shown: str) -> None:
        print(f"{'PASS' if ok else 'FAIL'}  {name}: {shown}")
        if not ok:
            failed.append(name)

    files = sources("kit", "tests", "bench")
    skips = sum(bool(OPT_OUT.search(p.read_text())) for p in files)
    target("formatter opt-outs in kit, tests, bench", skips == 0, f"{skips} files")
    ruff = ROOT / ".venv" / "bin" / "ruff"
    check = subprocess.run(
        [str(ruff) if ruff.exists() else "ruff", "format", "--check", "kit", "tests", "bench"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    target("ruff format --check kit tests bench", check.returncode == 0, check.stdout.strip()[-80:])

    kit = sources("kit")
    lines = {p: len(p.read_text().splitlines()) for p in kit}
    total = sum(lines.values())
    target("kit/ lines as formatted", total <= 14_000, f"{total:,} (target <= 14,000)")

    columns = record_columns()
    holders, strays, raised, lengths = [], [], [], []
    for path in kit:
        tree = ast.parse(path.read_text())
        name = str(path.relative_to(ROOT))
        if column_lists(tree, columns):
            holders.append(name)
        classes, raises = exceptions(tree)
        strays += [f"{name}:{c}" for c in classes]
        raised += [f"{name}:{r}" for r in raises]
        lengths += [
            n.end_lineno - n.lineno + 1
            for n in ast.walk(tree)
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
        ]
    target("modules writing out record columns", len(holders) <= 1, ", ".join(holders) or "none")
    shown = ", ".join(strays[:6]) + (" ..." if len(strays) > 6 else "")
    target("exception classes outside the tree", not strays, f"{len(strays)}: {shown}")
    target("builtin exceptions raised on purpose", not raised, f"{len(raised)}")
    p90 = statistics.quantiles(lengths, n=10)[-1]
    med = statistics.median(lengths)
    print(f"info  functions: {len(lengths)}, median {med:.0f} lines, p90 {p90:.0f}")
    big = sorted(((n, p) for p, n in lines.items() if n > 500), reverse=True)
    print("info  modules past 500 lines:", ", ".join(f"{p.relative_to(KIT)} {n}" for n, p in big))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
