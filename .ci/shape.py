"""The tree's shape rules (issues 24 and 50), checked in CI: no module in batchmlx/ or
benchmarks/ over 600 lines, no function body over 80 lines (signature and docstring not counted,
so typer's declarative option lists stay readable), and no import circle among batchmlx/'s or
benchmarks/' modules."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 80
ROOT = Path(__file__).resolve().parent.parent


def _body_lines(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    body = fn.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]  # the docstring
    if not body:
        return 0
    return (body[-1].end_lineno or body[-1].lineno) - body[0].lineno + 1


def sizes(package: Path) -> list[str]:
    problems = []
    for path in sorted(package.rglob("*.py")):
        rel = path.relative_to(ROOT)
        text = path.read_text()
        n = text.count("\n")
        if n > MAX_MODULE_LINES:
            problems.append(f"{rel}: {n} lines (> {MAX_MODULE_LINES})")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                k = _body_lines(node)
                if k > MAX_FUNCTION_LINES:
                    problems.append(
                        f"{rel}:{node.lineno} {node.name}: {k} lines (> {MAX_FUNCTION_LINES})"
                    )
    return problems


def circles(package: str) -> list[str]:
    import grimp  # comes with import-linter

    graph = grimp.build_graph(package, include_external_packages=False)
    modules = sorted(graph.modules)
    problems = []
    seen: set[frozenset[str]] = set()
    for m in modules:
        for other in graph.find_modules_directly_imported_by(m):
            if other == m:
                continue
            chain = graph.find_shortest_chain(importer=other, imported=m)
            if chain:
                key = frozenset(chain)
                if key not in seen:
                    seen.add(key)
                    problems.append("import circle: " + " -> ".join([m, *chain]))
    return problems


def main() -> int:
    sys.path.insert(0, str(ROOT))
    problems = sizes(ROOT / "batchmlx") + sizes(ROOT / "benchmarks")
    problems += circles("batchmlx") + circles("benchmarks")
    for p in problems:
        print(p)
    print(f"shape: {len(problems)} problem(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
