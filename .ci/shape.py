"""The tree's shape rules (issues 24 and 50), checked in CI: no module in batchmlx/ or
benchmarks/ over 600 lines, no function body over 80 lines (signature and docstring not counted,
so typer's declarative option lists stay readable), no import circle among batchmlx/'s or
benchmarks/' modules, and no read of the environment in batchmlx/ outside config.py and a short
allow-list."""

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


# Configuration is read once, in batchmlx/config.py, and passed down (issue 50): no other module
# of batchmlx/ reads os.environ / os.getenv. The exceptions, each with its reason:
ENVIRON_READS_ALLOWED = {
    "batchmlx/config.py": "the one place settings are read from the environment",
    "batchmlx/faults.py": "test infrastructure: fault points read where they fire (tests/crash)",
    "batchmlx/engine/host/fast_blas.py": "the fast BLAS is chosen before anything else loads "
    "(its switch, LD_PRELOAD and the re-exec marker), and a re-exec's environment built",
    "batchmlx/cli/common.py": "report_error's traceback switch, which must work when loading "
    "the settings is what failed",
    "batchmlx/batches/models.py": "HF_HUB_OFFLINE: huggingface_hub's own variable, read at the "
    "call as the hub reads it",
    "batchmlx/engine/models/default_model.py": "BATCHMLX_GGUF_WHEEL, the default model's "
    "offline download override, read where it downloads (to move into Settings)",
}
# modules that only write variables a C library reads when it starts (os.environ[k] = v,
# setdefault, update), never read them back
ENVIRON_WRITES_ALLOWED = {
    "batchmlx/engine/host/threads.py": "BLAS and OpenMP thread counts and libgomp's spin "
    "defaults, for libraries loaded after them",
    "batchmlx/engine/models/quick.py": "transformers' advisory-warning switch, which mlx_lm's "
    "__init__ sets and a deferred __init__ has not set yet",
}
_WRITE_METHODS = ("setdefault", "update")


def _environ_uses(tree: ast.AST) -> list[tuple[int, bool]]:
    """(line, is_write) of every use of os.environ, environ and os.getenv / getenv in `tree`."""
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    uses = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and (
            (isinstance(node.func, ast.Attribute) and node.func.attr == "getenv")
            or (isinstance(node.func, ast.Name) and node.func.id == "getenv")
        ):
            uses.append((node.lineno, False))
        elif (isinstance(node, ast.Attribute) and node.attr in ("environ", "environb")) or (
            isinstance(node, ast.ImportFrom) and node.module == "os"
            and any(a.name in ("environ", "environb", "getenv") for a in node.names)
        ):  # fmt: skip
            up = parents.get(node)
            write = (isinstance(up, ast.Subscript) and isinstance(up.ctx, ast.Store | ast.Del)) or (
                isinstance(up, ast.Attribute) and up.attr in _WRITE_METHODS
            )
            uses.append((node.lineno, write))
    return uses


def environ_reads(package: Path) -> list[str]:
    """Reads of the environment in `package` outside the allow-lists, and stale entries."""
    problems, used = [], set()
    for path in sorted(package.rglob("*.py")):
        rel = str(path.relative_to(ROOT))
        for line, write in _environ_uses(ast.parse(path.read_text())):
            if rel in ENVIRON_READS_ALLOWED or (write and rel in ENVIRON_WRITES_ALLOWED):
                used.add(rel)
                continue
            what = "writes" if write else "reads"
            problems.append(f"{rel}:{line} {what} the environment (only config.py reads "
                            "it: pass settings down, or allow-list it here)")  # fmt: skip
    listed = {**ENVIRON_READS_ALLOWED, **ENVIRON_WRITES_ALLOWED}
    problems += [f"{rel}: on the environ allow-list but uses no environment"
                 for rel in sorted(set(listed) - used)]  # fmt: skip
    return problems


def main() -> int:
    sys.path.insert(0, str(ROOT))
    problems = sizes(ROOT / "batchmlx") + sizes(ROOT / "benchmarks")
    problems += circles("batchmlx") + circles("benchmarks")
    problems += environ_reads(ROOT / "batchmlx")
    for p in problems:
        print(p)
    print(f"shape: {len(problems)} problem(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
